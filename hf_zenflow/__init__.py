"""hf_zenflow: ZenFlow's importance-aware, stall-free CPU-offloaded AdamW for the Hugging Face stack.

One subpackage per concern, each importing only the ones below it (`pyproject.toml`'s import-linter contract; the
docs/how-it-works.md's *Package map* says where each part of a step lives):

- `cli.py` (`hf-zenflow`) on top; `tuning/` (`hf_zenflow.tune`, `hf-zenflow tune`) over `compare/` (`hf-zenflow
  compare`), which uses `estimate/` (the hardware bound model and what fits, `hf-zenflow estimate`)
  and `hf/` (the Hugging Face glue: `ZenFlowTrainer`, `ZenFlowTrainingArguments`, `ZenFlowPlugin`, model cards);
- `optimizer/`: `ZenFlowAdamW` and `SyncOffloadAdamW`, over `checkpoint/` (the format, conversion, re-sharding) and
  `engine/` (the parts of a step: device path, host path, windows and worker, schedule, gradient reads, telemetry);
- `distributed/` (DDP host sharding, FSDP2), `transport/` (the link between device and host, one module per kind,
  the CPU-device kernels), `settings/` (`ZenFlowConfig`, flags, DeepSpeed configs, the thread rule);
- `_base.py` (tensor helpers every layer uses) and `_extras.py` (the optional dependencies) at the bottom.
"""

import importlib
import sys
from typing import Any


if "torch" in sys.modules:
    # The thread rule tells a pool the user chose from torch's own by its size at ``import hf_zenflow``
    # (`settings.threads`): with torch loaded already, read it now, as when this import loaded everything.
    from .settings import threads as _threads  # noqa: F401


#: The top-level names and the modules they are imported from when first used: ``import hf_zenflow`` (and the
#: ``hf-zenflow`` command line, which answers --help and bad flags before anything heavy is imported) imports no
#: torch.
_LAZY_EXPORTS = {
    "to_torch_adamw": "checkpoint.convert", "CheckpointError": "checkpoint.format", "column_major_": "engine.layout",
    "HostWorkerError": "engine.worker", "SyncOffloadAdamW": "optimizer", "ZenFlowAdamW": "optimizer",
    "ZenFlowConfig": "settings", "__version__": "settings",
}


_HF_EXPORTS = {"ZenFlowCallback", "ZenFlowTrainer", "ZenFlowTrainingArguments", "ZenFlowPlugin"}


def __getattr__(name: str) -> Any:
    # The HF glue imports transformers/accelerate (seconds); load it only when asked for.
    if name in _LAZY_EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
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
