"""Move a Trainer checkpoint folder from ZenFlowAdamW to `torch.optim.AdamW` (`hf-zenflow convert-checkpoint`).

The other direction needs no conversion: `ZenFlowAdamW.load_state_dict` continues a `torch.optim.AdamW` state dict
(moments and step counts), so ``ZenFlowTrainer.train(resume_from_checkpoint=...)`` resumes a plain Trainer's folder.

A ZenFlow checkpoint keeps fp32 master weights that the saved model may not have caught up with yet (a host result
waiting for its window boundary, the open window's gradients), so the conversion rewrites both files: `optimizer.pt`
becomes an AdamW state dict and the weights in the model's safetensors files become the masters (rounded to their
dtype), matched by the parameter names that `ZenFlowTrainer` records in the checkpoint. The original optimizer file
is kept as ``optimizer.zenflow.pt``. The converted folder is built as a hidden sibling and swapped in only when
complete (`hf_zenflow.atomic.replace_folder`): an interrupted conversion leaves the original folder whole.

Example::

    hf-zenflow convert-checkpoint out/checkpoint-500          # then: Trainer(..., optim="adamw_torch")
                                                               #       .train(resume_from_checkpoint=...)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_path, check_writable_folder, is_temporary, replace_folder, staged_folder, torch_save
from ..checkpoint.convert import is_torch_adamw_state, to_torch_adamw
from ..checkpoint.format import CheckpointError, load_file
from .checkpoint_manifest import has_manifest, write_manifest
from .checkpoint_paths import missing_folder_message
from .rank_checkpoint import saved_world_sizes


OPTIMIZER_FILE = "optimizer.pt"
BACKUP_FILE = "optimizer.zenflow.pt"


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    return [f for f in (folder / "model.safetensors", folder / "adapter_model.safetensors") if f.is_file()]


def _key_candidates(name: str) -> list[str]:
    """The keys a parameter name may have in the saved weights: itself, and peft's form without the adapter name
    (``...lora_A.default.weight`` is saved as ``...lora_A.weight``)."""
    parts = name.split(".")
    return [name] + [".".join(parts[: i + 1] + parts[i + 2:])
                     for i, part in enumerate(parts[:-2]) if part.startswith("lora_")]


def saved_weights(folder: str | Path, state: dict[str, Any]) -> dict[int, torch.Tensor]:
    """The weights in `folder` of the parameters whose fp32 master `state` leaves to them (saved with the model, not
    twice), by parameter index and recorded name: what `to_torch_adamw`'s ``weights`` takes."""
    from safetensors.torch import load_file as load_weights

    wanted = {int(i): e.get("name") for i, e in state["state"].items() if isinstance(e, dict)
              and (e.get("host_master", 0) is None or e.get("device_master", 0) is None)}
    found: dict[int, torch.Tensor] = {}
    for file in _weight_files(Path(folder)) if wanted else []:
        weights = load_weights(str(file))
        for i, name in wanted.items():
            key = next((k for k in _key_candidates(name) if k in weights), None) if name else None
            if key is not None:
                found[i] = weights[key]
    return found


def _stage_copy(source: Path, staging: Path, link: bool) -> None:
    """Fill `staging` with `source`'s files: hard links when `link` (the source folder is replaced at the end; every
    file rewritten here gets a new inode, see `atomic_path`, so the source's files are never written), else
    copies."""
    for root, dirs, files in os.walk(source):
        rel = Path(root).relative_to(source)
        dirs[:] = [d for d in dirs if not is_temporary(d)]
        for d in dirs:
            (staging / rel / d).mkdir()
        for name in files:
            if is_temporary(name):
                continue
            src, dst = Path(root) / name, staging / rel / name
            if link:
                try:
                    os.link(src, dst)
                    continue
                except OSError:  # (a file system without hard links: copy)
                    pass
            shutil.copy2(src, dst)


def check_convert_inputs(folder: Path, output_dir: Path | None) -> None:
    """Refuse what `convert_checkpoint` cannot do, before it does anything (`CheckpointError`, one line)."""
    missing = missing_folder_message(folder)
    if missing is not None:
        raise CheckpointError(missing)
    path = folder / OPTIMIZER_FILE
    sizes = saved_world_sizes(str(folder))
    if not path.is_file() and sizes:
        raise CheckpointError(
            f"{folder}: the ZenFlow optimizer state is in rank files of world size {max(sizes)} (no "
            f"{OPTIMIZER_FILE}): merge them first with hf-zenflow reshard-checkpoint {folder} --world-size 1, "
            "then convert.")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such optimizer checkpoint file: {folder} has no ZenFlow optimizer state "
                              "to convert.")
    if output_dir is not None:
        source = folder.resolve()
        if source == output_dir.resolve() or source in output_dir.resolve().parents:
            # (the copy would be written into the folder it is copied from, and be part of that checkpoint from then
            # on: a later conversion or resume of it would carry the copy along)
            raise CheckpointError(f"--output-dir {output_dir} is inside the checkpoint {folder}: choose a folder "
                                  f"outside it for the converted copy (or leave --output-dir out to convert "
                                  f"{folder} in place).")
        if output_dir.exists():
            raise CheckpointError(f"--output-dir {output_dir} exists: choose a new folder for the converted "
                                  "checkpoint.")
        where = output_dir.parent
    else:
        where = folder.parent  # the converted folder is built beside the original, then swapped in
    try:
        check_writable_folder(where, "the converted checkpoint's folder")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def convert_checkpoint(folder: str | Path, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Rewrite the checkpoint `folder` (or a copy in `output_dir`) for `torch.optim.AdamW`; returns a summary.

    The converted folder is built beside its destination and swapped in only once complete: a conversion that fails
    or is killed leaves `folder` as it was. Raises `CheckpointError` when the folder has no ZenFlow optimizer state,
    or when weights that differ from their masters cannot be matched to a parameter name (checkpoints written by
    ZenFlowTrainer carry the names).
    """
    folder = Path(folder)
    output_dir = Path(output_dir) if output_dir is not None else None
    check_convert_inputs(folder, output_dir)
    target = output_dir if output_dir is not None else folder
    if output_dir is not None:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(target) as staging:
        _stage_copy(folder, staging, link=output_dir is None)
        summary = _convert_in(staging, display=target / OPTIMIZER_FILE)
        if has_manifest(folder):
            write_manifest(staging)  # the files changed: the checkpoint is vouched for anew
        replace_folder(staging, target)
    return {**summary, "folder": str(target), "backup": str(target / BACKUP_FILE)}


def _convert_in(folder: Path, display: Path) -> dict[str, Any]:
    """Convert the checkpoint in `folder` (a staging copy; errors name the file as `display`)."""
    path = folder / OPTIMIZER_FILE
    try:
        state = load_file(path)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace(str(path), str(display))) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{display} holds a {type(state).__name__}, not an optimizer state dict.")
    if is_torch_adamw_state(state):
        raise CheckpointError(f"{display} is already a torch.optim.AdamW state dict: nothing to convert "
                              "(ZenFlowTrainer resumes it as it is).")
    if state.get("zenflow") is None:
        raise CheckpointError(f"{display} holds no ZenFlowAdamW state (never stepped?): nothing to convert.")
    try:
        adamw, masters = to_torch_adamw(state, weights=saved_weights(folder, state))
    except CheckpointError as exc:
        raise CheckpointError(f"{display}: {exc}") from exc
    names = {int(i): e.get("name") for i, e in state["state"].items()}
    from safetensors.torch import load_file as load_weights
    from safetensors.torch import save_file as save_weights

    files = _weight_files(folder)
    remaining = {i for i in masters}
    rewritten = 0
    for file in files:
        weights = load_weights(str(file))
        changed = False
        for i in sorted(remaining):
            name = names.get(i)
            key = next((k for k in _key_candidates(name) if k in weights), None) if name else None
            if key is None:
                continue
            weights[key] = masters[i].to(weights[key].dtype).reshape(weights[key].shape).contiguous()
            remaining.discard(i)
            changed = True
            rewritten += 1
        if changed:
            with atomic_path(file) as tmp:  # a new file: a hard-linked original is never written
                save_weights(weights, str(tmp), metadata={"format": "pt"})
    if remaining:
        unnamed = sorted(i for i in remaining if not names.get(i))
        raise CheckpointError(
            f"{display}: {len(remaining)} parameter(s) could not be matched to a weight in {[f.name for f in files]}"
            + (f" (parameters {unnamed[:8]} have no recorded name: the checkpoint was not written by ZenFlowTrainer;"
               " convert it in Python with hf_zenflow.to_torch_adamw and set the weights yourself)" if unnamed else "")
            + "."
        )
    backup = folder / BACKUP_FILE
    if backup.exists():
        backup.unlink()
    try:
        os.link(path, backup)
    except OSError:  # (a file system without hard links)
        shutil.copy2(path, backup)
    torch_save(adamw, path)  # a new file: the backup keeps the original's bytes
    return {"parameters": len(adamw["state"]), "weights_rewritten": rewritten}

