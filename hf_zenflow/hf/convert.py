"""Move a Trainer checkpoint folder from ZenFlowAdamW to `torch.optim.AdamW` (`hf-zenflow convert-checkpoint`).

The other direction needs no conversion: `ZenFlowAdamW.load_state_dict` continues a `torch.optim.AdamW` state dict
(moments and step counts), so ``ZenFlowTrainer.train(resume_from_checkpoint=...)`` resumes a plain Trainer's folder.

A ZenFlow checkpoint keeps fp32 master weights that the saved model may not have caught up with yet (a host result
waiting for its window boundary, the open window's gradients), so the conversion rewrites both files: `optimizer.pt`
becomes an AdamW state dict and the weights in the model's safetensors files become the masters (rounded to their
dtype), matched by the parameter names that `ZenFlowTrainer` records in the checkpoint. The original optimizer file
is kept as ``optimizer.zenflow.pt``.

Example::

    hf-zenflow convert-checkpoint out/checkpoint-500          # then: Trainer(..., optim="adamw_torch")
                                                               #       .train(resume_from_checkpoint=...)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.convert import is_torch_adamw_state, to_torch_adamw
from ..checkpoint.format import CheckpointError, load_file


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


def convert_checkpoint(folder: str | Path, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Rewrite the checkpoint `folder` (or a copy in `output_dir`) for `torch.optim.AdamW`; returns a summary.

    Raises `CheckpointError` when the folder has no ZenFlow optimizer state, or when weights that differ from their
    masters cannot be matched to a parameter name (checkpoints written by ZenFlowTrainer carry the names).
    """
    folder = Path(folder)
    if output_dir is not None:
        output_dir = Path(output_dir)
        if output_dir.exists():
            raise CheckpointError(f"{output_dir} exists: choose a new folder for the converted checkpoint.")
        shutil.copytree(folder, output_dir)
        folder = output_dir
    path = folder / OPTIMIZER_FILE
    state = load_file(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not an optimizer state dict.")
    if is_torch_adamw_state(state):
        raise CheckpointError(f"{path} is already a torch.optim.AdamW state dict: nothing to convert (ZenFlowTrainer "
                              "resumes it as it is).")
    if state.get("zenflow") is None:
        raise CheckpointError(f"{path} holds no ZenFlowAdamW state (never stepped?): nothing to convert.")
    try:
        adamw, masters = to_torch_adamw(state)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
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
            save_weights(weights, str(file), metadata={"format": "pt"})
    if remaining:
        unnamed = sorted(i for i in remaining if not names.get(i))
        raise CheckpointError(
            f"{path}: {len(remaining)} parameter(s) could not be matched to a weight in {[f.name for f in files]}"
            + (f" (parameters {unnamed[:8]} have no recorded name: the checkpoint was not written by ZenFlowTrainer;"
               " convert it in Python with hf_zenflow.to_torch_adamw and set the weights yourself)" if unnamed else "")
            + "."
        )
    shutil.copy2(path, folder / BACKUP_FILE)
    torch.save(adamw, path)
    return {"folder": str(folder), "parameters": len(adamw["state"]), "weights_rewritten": rewritten,
            "backup": str(folder / BACKUP_FILE)}
