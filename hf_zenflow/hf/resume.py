"""Which Trainer checkpoint folder a resume may use: a folder is complete when it has the trainer state, the model
weights and (unless the user resumes without it) the optimizer state. A process killed while saving leaves a partial
newest folder; `resume_from_checkpoint=True` then resumes from the newest complete one instead, and says so."""

from __future__ import annotations

import json
import logging
import os
import re

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .rank_checkpoint import ACCELERATE_OPTIMIZER_NAME, OPTIMIZER_NAME, rank_file_name, saved_world_sizes


logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
#: Model weight files a Trainer checkpoint holds (whole, sharded with an index, PEFT adapters).
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def _weights_problem(folder: str) -> str | None:
    names = set(os.listdir(folder))
    if names & set(_WEIGHT_FILES) or any(n.startswith("pytorch_model_fsdp") for n in names):
        return None
    for index in _WEIGHT_INDEXES:
        if index in names:
            try:
                with open(os.path.join(folder, index)) as f:
                    shards = set(json.load(f)["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return f"{index} is unreadable"
            missing = sorted(shards - names)
            return f"model weight shard(s) {missing[:3]} missing" if missing else None
    return f"no model weights ({' or '.join(_WEIGHT_FILES[:2])})"


def _optimizer_problem(folder: str) -> str | None:
    for size in saved_world_sizes(folder):
        missing = [rank_file_name(r, size) for r in range(size)
                   if not os.path.isfile(os.path.join(folder, rank_file_name(r, size)))]
        if missing:
            return f"rank file(s) {missing[:3]} missing"
    if saved_world_sizes(folder):
        return None
    if any(os.path.isfile(os.path.join(folder, n)) for n in (OPTIMIZER_NAME, ACCELERATE_OPTIMIZER_NAME)):
        return None
    return f"no optimizer state ({OPTIMIZER_NAME})"


def checkpoint_problems(folder: str, need_optimizer: bool = True) -> list[str]:
    """What `folder` lacks to be resumed from (empty: it is complete)."""
    problems = []
    if not os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)):
        problems.append(f"no {TRAINER_STATE_NAME}")
    weights = _weights_problem(folder)
    if weights:
        problems.append(weights)
    optimizer = _optimizer_problem(folder) if need_optimizer else None
    if optimizer:
        problems.append(optimizer)
    return problems


def newest_complete_checkpoint(output_dir: str, need_optimizer: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` folder of `output_dir` (None when there is none), with a warning
    naming each newer folder skipped and what it lacks."""
    if not os.path.isdir(output_dir):
        return None
    found = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                    if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))),
                   reverse=True)
    skipped = []
    for _, name in found:
        folder = os.path.join(output_dir, name)
        problems = checkpoint_problems(folder, need_optimizer)
        if not problems:
            if skipped:
                logger.warning("ZenFlowTrainer: resume_from_checkpoint=True: skipped incomplete checkpoint(s) %s "
                               "(a save interrupted, or a partial copy); resuming from %s.", "; ".join(skipped),
                               folder)
            return folder
        skipped.append(f"{folder} ({', '.join(problems)})")
    if skipped:
        logger.warning("ZenFlowTrainer: resume_from_checkpoint=True: no complete checkpoint in %s: %s.", output_dir,
                       "; ".join(skipped))
    return None


__all__ = ["checkpoint_problems", "newest_complete_checkpoint"]
