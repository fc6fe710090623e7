"""trl with ZenFlow: `ZenFlowSFTConfig` and `ZenFlowSFTTrainer` (also importable as `hf_zenflow.trl`).

Only this module imports trl, so ``import hf_zenflow`` never needs it. For another trl Trainer, mix
`ZenFlowTrainer` in first, the same way: ``class ZenFlowDPOTrainer(ZenFlowTrainer, DPOTrainer)`` with
``zenflow_args_base = DPOConfig``; a `DPOConfig` given to it gains the ZenFlow settings (`args_upgrade`).

Example:
    >>> from hf_zenflow.trl import ZenFlowSFTConfig, ZenFlowSFTTrainer
    >>> args = ZenFlowSFTConfig(output_dir="out", max_steps=4, zenflow_topk_ratio=0.1)  # doctest: +SKIP
    >>> ZenFlowSFTTrainer(model=model, args=args, train_dataset=dataset).train()  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import SFTConfig, SFTTrainer

from .args_upgrade import register_zenflow_arguments_class
from .callback import ZenFlowCallback
from .trainer import ZenFlowTrainer
from .training_args import ZenFlowTrainingArguments


@dataclass
class ZenFlowSFTConfig(SFTConfig, ZenFlowTrainingArguments):
    """trl's [`SFTConfig`] with the `zenflow_*` settings of [`ZenFlowTrainingArguments`].

    `SFTConfig` comes first so that trl's defaults survive (`learning_rate=2e-5`, `logging_steps=10`,
    `gradient_checkpointing=True`, `bf16` on unless `fp16`): in the order `(ZenFlowTrainingArguments, SFTConfig)`
    the dataclass would take `TrainingArguments`' own defaults again. ZenFlow's checks run after trl has resolved
    its defaults and before `TrainingArguments.__post_init__`.
    """


register_zenflow_arguments_class(SFTConfig, ZenFlowSFTConfig)


class ZenFlowSFTTrainer(ZenFlowTrainer, SFTTrainer):
    """trl's [`SFTTrainer`] training with `ZenFlowAdamW`: takes `SFTTrainer`'s arguments; `args` may be a
    `ZenFlowSFTConfig`, an `SFTConfig` or a `TrainingArguments` (each gains the ZenFlow defaults, its own values
    kept). Checkpoints, exact resume, the end-of-training flush and the ZenFlow model card (tags `trl`, `sft`,
    `hf_zenflow`) are `ZenFlowTrainer`'s."""

    zenflow_args_base = SFTConfig


__all__ = ["ZenFlowCallback", "ZenFlowSFTConfig", "ZenFlowSFTTrainer", "ZenFlowTrainer"]
