"""hf_zenflow: ZenFlow's importance-aware, stall-free CPU-offloaded AdamW for the Hugging Face stack.

Where things live:

- the optimizer engine: `optimizer.py` (`ZenFlowAdamW`, orchestration and checkpoints), with the device path in
  `device_step.py`, the host path (host state, accumulation, the worker thread) in `host.py`, column selection and
  windows in `selection.py`, one matrix's two sides in `split_matrix.py`, the checkpoint format (validation,
  migration, conversion to/from `torch.optim.AdamW`) in `checkpoint.py`, telemetry in `telemetry.py`, settings in
  `config.py` (their flags, plugin arguments, environment variables and docs derived from its fields in
  `settings.py`; DeepSpeed configs read by `deepspeed_config.py`), the once-per-process multi-process warning in
  `distributed_check.py`, the column-major weight layout for CPU devices in `layout.py` (`column_major_`);
- the synchronous offload baseline: `baselines.py` (`SyncOffloadAdamW`);
- the Hugging Face glue: `hf/` (`ZenFlowTrainer`, `ZenFlowTrainingArguments`, `ZenFlowPlugin`, model cards);
- the side-by-side comparison, the emulated accelerator, the hardware bound model and the settings tuner
  (`hf_zenflow.tune`): `compare/`, driven by `cli.py` (`hf-zenflow`).
"""

from typing import Any

from .baselines import SyncOffloadAdamW
from .checkpoint import CheckpointError
from .checkpoint_convert import to_torch_adamw
from .config import ZenFlowConfig
from .layout import column_major_
from .optimizer import ZenFlowAdamW
from .worker import HostWorkerError


__version__ = "0.1.0"

_HF_EXPORTS = {"ZenFlowTrainer", "ZenFlowTrainingArguments", "ZenFlowPlugin"}


def __getattr__(name: str) -> Any:
    # The HF glue imports transformers/accelerate (seconds); load it only when asked for.
    if name in _HF_EXPORTS:
        from . import hf

        return getattr(hf, name)
    if name == "tune":  # trials import transformers and the compare runner: load them only when asked for
        from .compare.tune import tune

        return tune
    raise AttributeError(f"module 'hf_zenflow' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "HostWorkerError",
    "SyncOffloadAdamW",
    "ZenFlowAdamW",
    "ZenFlowConfig",
    "ZenFlowPlugin",
    "ZenFlowTrainer",
    "ZenFlowTrainingArguments",
    "__version__",
    "column_major_",
    "to_torch_adamw",
    "tune",
]
