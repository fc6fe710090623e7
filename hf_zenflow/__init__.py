"""hf_zenflow: ZenFlow's importance-aware, stall-free CPU-offloaded AdamW for the Hugging Face stack.

One subpackage per concern, each importing only the ones below it (`pyproject.toml`'s import-linter contract; the
docs/how-it-works.md's *Package map* says where each part of a step lives):

- `cli.py` (`hf-zenflow`) on top; `tuning/` (`hf_zenflow.tune`, `hf-zenflow tune`) over `compare/` (`hf-zenflow
  compare`), which uses `estimate/` (the emulated accelerator and the hardware bound model, `hf-zenflow estimate`)
  and `hf/` (the Hugging Face glue: `ZenFlowTrainer`, `ZenFlowTrainingArguments`, `ZenFlowPlugin`, model cards);
- `optimizer/`: `ZenFlowAdamW` and `SyncOffloadAdamW`, over `checkpoint/` (the format, conversion, re-sharding) and
  `engine/` (the parts of a step: device path, host path, windows and worker, schedule, gradient reads, telemetry);
- `distributed/` (DDP host sharding, FSDP2), `transport/` (the link between device and host, one module per kind,
  the CPU-device kernels), `settings/` (`ZenFlowConfig`, flags, DeepSpeed configs, the thread rule);
- `_base.py` (tensor helpers every layer uses) and `_extras.py` (the optional dependencies) at the bottom.
"""

from typing import Any

from .checkpoint.convert import to_torch_adamw
from .checkpoint.format import CheckpointError
from .engine.layout import column_major_
from .engine.worker import HostWorkerError
from .optimizer import SyncOffloadAdamW, ZenFlowAdamW
from .settings import ZenFlowConfig, __version__


_HF_EXPORTS = {"ZenFlowCallback", "ZenFlowTrainer", "ZenFlowTrainingArguments", "ZenFlowPlugin"}



def __getattr__(name: str) -> Any:
    # The HF glue imports transformers/accelerate (seconds); load it only when asked for.
    if name in _HF_EXPORTS:
        from . import hf

        return getattr(hf, name)
    if name == "tune":  # trials import transformers and the compare runner: load them only when asked for
        from .tuning.tune import tune

        return tune
    raise AttributeError(f"module 'hf_zenflow' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "HostWorkerError",
    "SyncOffloadAdamW",
    "ZenFlowAdamW",
    "ZenFlowCallback",
    "ZenFlowConfig",
    "ZenFlowPlugin",
    "ZenFlowTrainer",
    "ZenFlowTrainingArguments",
    "__version__",
    "column_major_",
    "to_torch_adamw",
    "tune",
]
