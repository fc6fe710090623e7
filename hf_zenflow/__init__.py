"""hf_zenflow: ZenFlow's importance-aware, stall-free CPU-offloaded AdamW for the Hugging Face stack.

One subpackage per concern, each importing only the ones below it (`pyproject.toml`'s import-linter contract; the
README's *Package map* says where each part of a step lives):

- `cli.py` (`hf-zenflow`) on top; `tuning/` (`hf_zenflow.tune`, `hf-zenflow tune`) over `compare/` (`hf-zenflow
  compare`), which uses `estimate/` (the emulated accelerator and the hardware bound model, `hf-zenflow estimate`)
  and `hf/` (the Hugging Face glue: `ZenFlowTrainer`, `ZenFlowTrainingArguments`, `ZenFlowPlugin`, model cards);
- `optimizer/`: `ZenFlowAdamW` and `SyncOffloadAdamW`, over `checkpoint/` (the format, conversion, re-sharding) and
  `engine/` (the parts of a step: device path, host path, windows and worker, schedule, gradient reads, telemetry);
- `distributed/` (DDP host sharding, FSDP2), `transport/` (the link between device and host, one module per kind,
  the CPU-device kernels), `settings/` (`ZenFlowConfig`, flags, DeepSpeed configs, the thread rule);
- `_base.py` (tensor helpers every layer uses) and `_extras.py` (the optional dependencies) at the bottom.

Modules that lived flat in `hf_zenflow/` before the re-layout still import under their old names
(``hf_zenflow.config``, ``hf_zenflow.windows``, ``hf_zenflow.compare.tune``, ...): `_MOVED` maps each to its new
module, which is returned as it is (one module object, whichever name imported it).
"""

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

from .checkpoint.convert import to_torch_adamw
from .checkpoint.format import CheckpointError
from .engine.layout import column_major_
from .engine.worker import HostWorkerError
from .optimizer import TRAIN_HOOKS, SyncOffloadAdamW, ZenFlowAdamW
from .settings import ZenFlowConfig, __version__


#: Old module path (under hf_zenflow) -> where it lives now.
_MOVED = {
    "accumulation": "engine.accumulation",
    "amp": "engine.amp",
    "baselines": "optimizer.sync_offload",
    "checkpoint_convert": "checkpoint.convert",
    "checkpoint_reshard": "checkpoint.reshard",
    "checkpoint_seal": "checkpoint.seal",
    "checkpoint_validate": "checkpoint.validate",
    "cli_types": "settings.cli_types",
    "compare.emulator": "estimate.emulator",
    "compare.emulator_cli": "estimate.emulator_cli",
    "compare.emulator_device": "estimate.emulator_device",
    "compare.emulator_report": "estimate.emulator_report",
    "compare.emulator_scenario": "estimate.emulator_scenario",
    "compare.emulator_schedules": "estimate.emulator_schedules",
    "compare.hardware": "estimate.hardware",
    "compare.host_rates": "estimate.host_rates",
    "compare.paired_stats": "tuning.paired_stats",
    "compare.pareto": "tuning.pareto",
    "compare.ranks": "estimate.ranks",
    "compare.tune": "tuning.tune",
    "compare.tune_grid": "tuning.tune_grid",
    "compare.tune_report": "tuning.tune_report",
    "config": "settings.config",
    "cpu_device": "transport.cpu_device",
    "cpu_device.kernels": "transport.cpu_device.kernels",
    "cpu_device.layout": "engine.layout",
    "cpu_device.transport": "transport.cpu_device.transport",
    "deepspeed_config": "settings.deepspeed_config",
    "device_step": "engine.device_step",
    "distributed_check": "distributed.replica_check",
    "fsdp": "distributed.fsdp",
    "gradients": "engine.gradients",
    "handoff": "engine.handoff",
    "held_handoff": "engine.held_handoff",
    "host": "engine.host",
    "host_lr": "engine.host_lr",
    "params": "engine.params",
    "pinned": "transport.pinned",
    "reselection": "engine.reselection",
    "schedule": "engine.schedule",
    "selection": "engine.selection",
    "sharding": "distributed.sharding",
    "split_matrix": "engine.split_matrix",
    "telemetry": "engine.telemetry",
    "threads": "settings.threads",
    "weight_marks": "engine.weight_marks",
    "windows": "engine.windows",
    "worker": "engine.worker",
    "writeback_lag": "engine.writeback_lag",
}

_HF_EXPORTS = {"ZenFlowCallback", "ZenFlowTrainer", "ZenFlowTrainingArguments", "ZenFlowPlugin"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as its new module (no second copy: `create_module` returns the module itself)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("hf_zenflow.") or fullname[len("hf_zenflow.") :] not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module("hf_zenflow." + _MOVED[spec.name[len("hf_zenflow.") :]])
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system has just set the alias's spec on the module: give it its own back
        module.__spec__ = self._own_specs[module.__name__]


# First in line: an old name whose file is gone must not be found as a second copy under a moved folder
# (``hf_zenflow.cpu_device.kernels`` would otherwise load transport/cpu_device/kernels.py again).
sys.meta_path.insert(0, _MovedModules())


def _attach_to_calling_trainer(optimizer: ZenFlowAdamW) -> None:
    """`ZenFlowAdamW.train()`'s hook (`optimizer.TRAIN_HOOKS`): given to a Trainer through ``optimizers=(...)``,
    nothing there would flush the last window or stop the worker; find that Trainer and give it a `ZenFlowCallback`
    unless it has one. Wired here, at the top: the optimizer's layer does not import the Hugging Face glue."""
    if "transformers" in sys.modules:  # no Trainer can be calling without it
        from .hf.callback import attach_to_calling_trainer

        attach_to_calling_trainer(optimizer, max_depth=7)  # (one frame more than from train() itself: this one)


TRAIN_HOOKS.append(_attach_to_calling_trainer)


def __getattr__(name: str) -> Any:
    # The HF glue imports transformers/accelerate (seconds); load it only when asked for.
    if name in _HF_EXPORTS:
        from . import hf

        return getattr(hf, name)
    if name == "tune":  # trials import transformers and the compare runner: load them only when asked for
        from .tuning.tune import tune

        return tune
    if name in _MOVED:  # ``hf_zenflow.config`` and the other old module paths, as attributes
        return importlib.import_module(f"{__name__}.{name}")
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
