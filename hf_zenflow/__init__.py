"""hf_zenflow: ZenFlow's importance-aware, stall-free CPU-offloaded AdamW for the Hugging Face stack.

Where things live:

- `ZenFlowAdamW` (`optimizer.py`) orchestrates a step and holds the public API; it decides nothing itself:
  - its arguments made into state (settings, param-group checks, split or dense per parameter): `params.py`;
  - the schedule, pure decisions with no tensors: `schedule.py` (step kinds, windows, Zen-auto votes, write-back
    lags), and the lag `writeback_lag="auto"` chooses from measured times: `writeback_lag.py`;
  - reading each gradient as backward produces it: `gradients.py` (hooks: norms, early copies to the host);
  - the device path: `device_step.py` (selected-column and dense AdamW state, gather, fused update);
  - the host side of a step: `windows.py` (hand-offs, window closes, write-backs), over the host path in `host.py`
    (host state, accumulation, the window's AdamW) and `worker.py` (`HostAdamWorker`);
  - what crosses the link: `transport.py` (one interface; CUDA streams, events, pinned arena);
  - the host work split across data-parallel ranks (DDP): `sharding.py` (shares, the batched collectives); FSDP2's
    sharded parameters, each rank on its own shards: `fsdp.py`;
  - one matrix's two sides and its selection: `split_matrix.py`, `selection.py`;
  - checkpoints: `checkpoint.py` (format, validation, migration), `checkpoint_convert.py` (settings changed on resume,
    to/from `torch.optim.AdamW`), `checkpoint_reshard.py` (rank states for another world size); weights changed
    from outside: `weight_marks.py`;
  - the CPU as the device: `cpu_device/` (C kernels, `column_major_`, the reference-and-swap transport);
- settings: `config.py` (`ZenFlowConfig`), their flags/plugin arguments/env vars/docs in `settings.py`, DeepSpeed
  configs in `deepspeed_config.py`, the thread rule in `threads.py`, the multi-process notice in
  `distributed_check.py`, telemetry in `telemetry.py`;
- the synchronous offload baseline: `baselines.py` (`SyncOffloadAdamW`);
- the Hugging Face glue: `hf/` (`ZenFlowTrainer` in `trainer.py` with its telemetry `trainer_telemetry.py`, its
  card `trainer_card.py` and its per-rank optimizer files `rank_checkpoint.py`, `ZenFlowTrainingArguments`,
  `ZenFlowPlugin` with its per-rank `save_state` files `accelerate_checkpoint.py`, model cards, `convert-checkpoint`);
- the side-by-side comparison (`compare/runner.py`: its settings `compare_config.py`, one timed run
  `training_run.py`), the emulated accelerator, the hardware bound model and the settings tuner (`hf_zenflow.tune`:
  `compare/tune.py`, over `tune_grid.py`, `pareto.py`, `tune_report.py`; `paired_stats.py`): `compare/`, driven by
  `cli.py` (`hf-zenflow`).
"""

from typing import Any

from .baselines import SyncOffloadAdamW
from .checkpoint import CheckpointError
from .checkpoint_convert import to_torch_adamw
from .config import ZenFlowConfig
from .cpu_device.layout import column_major_
from .optimizer import ZenFlowAdamW
from .worker import HostWorkerError


__version__ = "0.1.0"

_HF_EXPORTS = {"ZenFlowCallback", "ZenFlowTrainer", "ZenFlowTrainingArguments", "ZenFlowPlugin"}


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
