"""Every input of a `hf-zenflow compare` run checked before any work: the optimizers, the device, the ZenFlow
settings, the core split, the hardware profiles of the projection, the model and data paths and the output folder.
A bad one raises a `ValueError` (`OutputExistsError` for a taken output folder) whose one line names the flag, the
value and what is allowed; nothing is created before they all pass.

`hf-zenflow tune` checks its own inputs with the same pieces (`check_device`, `check_model`, `check_dataset`,
`check_profiles`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hf_zenflow.atomic import check_writable_folder
from hf_zenflow.compare.compare_config import OPTIMIZERS
from hf_zenflow.compare.data_source import names_a_missing_path
from hf_zenflow.compare.output import DEFAULT_PARENT, check_output_dir
from hf_zenflow.settings.config import ZenFlowConfig


if TYPE_CHECKING:
    from hf_zenflow.compare.compare_config import CompareConfig

#: What a machine with a GPU torch can use has (NVIDIA's driver, in a container too; WSL's; ROCm's): without any of
#: them `torch.cuda` finds no device, and a `--device cuda` is refused before torch is imported.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
#: The models `--model` names without a path.
NAMED_MODELS = ("minilm", "smollm2")


def check_device(device: str) -> None:
    """'auto', 'cpu', or 'cuda[:N]' naming a GPU this process sees."""
    if device in ("auto", "cpu"):
        return
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise ValueError(f"--device {device!r} is invalid: allowed are 'auto', 'cpu' and 'cuda[:N]'.")
    if not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):  # answered without importing torch (seconds)
        raise ValueError(f"--device {device}: this machine has no GPU driver (none of {', '.join(GPU_DRIVER_PATHS)}), "
                         "so no CUDA device; use --device cpu.")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {device}: this machine has no CUDA device that torch can use (torch "
                         f"{torch.__version__}); use --device cpu.")
    if match.group(1) is not None and int(match.group(1)) >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}).")


def check_model(model: str | None) -> None:
    """A named model, or a local Hugging Face model folder (its config.json there)."""
    if model is None or model in NAMED_MODELS:
        return
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is neither {' nor '.join(map(repr, NAMED_MODELS))} nor a local Hugging "
                         "Face model folder with a config.json (nothing is downloaded).")


def check_dataset(dataset: str | None) -> None:
    """A --dataset that names a file must exist and not be empty (a name that is no path is looked up when the data
    loads)."""
    if dataset is None:
        return
    if names_a_missing_path(dataset):
        raise ValueError(f"--dataset {dataset!r}: no such file or folder.")
    path = Path(dataset).expanduser()
    if path.is_file() and path.stat().st_size == 0:
        raise ValueError(f"--dataset {dataset}: the file is empty.")
    if path.is_dir() and not any(path.iterdir()):
        raise ValueError(f"--dataset {dataset}: the folder is empty.")


def check_profiles(names: tuple[str, ...] | list[str], flag: str = "--project-hardware") -> None:
    """Each a preset or a JSON file of a hardware profile (`hf_zenflow.estimate.profiles.load_profile`)."""
    from hf_zenflow.estimate.profiles import load_profile

    if not names:
        raise ValueError(f"{flag} is empty: name at least one hardware profile.")
    for name in names:
        try:
            load_profile(name)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            message = str(exc).replace("--hardware", flag)
            raise ValueError(message if flag in message else f"{flag} {name!r}: {message}") from None


def zenflow_config(cfg: CompareConfig) -> ZenFlowConfig:
    """The run's ZenFlow settings, as the ZenFlow run builds them (without its model's figures)."""
    return ZenFlowConfig(
        topk_ratio=cfg.topk_ratio, update_interval=cfg.update_interval, overlap_step=cfg.overlap_step,
        select_strategy=cfg.select_strategy, select_interval=cfg.select_interval,
        full_warm_up_rounds=cfg.full_warm_up_rounds, host_step=cfg.host_step,
        min_offload_numel=cfg.min_offload_numel).with_rules(**cfg.rules)


def check_compare_inputs(cfg: CompareConfig) -> None:
    """Raise on the first bad input of `cfg` (see the module docstring)."""
    unknown = [o for o in cfg.optimizers if o not in OPTIMIZERS]
    if unknown or not cfg.optimizers:
        raise ValueError(f"--optimizers {','.join(cfg.optimizers)!r}: unknown optimizer(s) {unknown}: allowed are "
                         f"{', '.join(OPTIMIZERS)} (comma-separated, at least one).")
    # the device, files and paths first: answered before torch is imported (seconds)
    check_device(cfg.device)
    check_profiles(cfg.project_hardware)
    check_model(cfg.model)
    check_dataset(cfg.dataset)
    check_output_dir(cfg.output_dir, cfg.overwrite)
    check_writable_folder(cfg.output_dir if cfg.output_dir is not None else DEFAULT_PARENT, "--output-dir")
    if "zenflow" in cfg.optimizers:
        zenflow_config(cfg)
    # what "auto" resolves to depends on the device torch finds
    cfg.resolved_layout()
    cfg.resolved_embedding_select()
    cfg.core_split()


__all__ = ["GPU_DRIVER_PATHS", "NAMED_MODELS", "check_compare_inputs", "check_dataset", "check_device", "check_model",
           "check_profiles", "zenflow_config"]
