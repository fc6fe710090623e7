"""`hf_zenflow.trl`: ZenFlow for trl (`ZenFlowSFTConfig`, `ZenFlowSFTTrainer`); see `hf_zenflow.hf.trl`. Importing
this module imports trl; ``import hf_zenflow`` does not."""

from .hf.trl import ZenFlowCallback, ZenFlowSFTConfig, ZenFlowSFTTrainer, ZenFlowTrainer


__all__ = ["ZenFlowCallback", "ZenFlowSFTConfig", "ZenFlowSFTTrainer", "ZenFlowTrainer"]
