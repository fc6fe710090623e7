"""Which Trainer checkpoint folder a resume may use: a folder is complete when its manifest checks
(`hf_zenflow.hf.checkpoint_manifest`: every file there, of its size and hash) and it has the trainer state, the model
weights and (unless the user resumes without it) the optimizer state. A process killed while saving leaves a partial
newest folder; `resume_from_checkpoint=True` then resumes from the newest complete one instead, and says which
folders it skipped and why. Once loaded, the optimizer state must be the one saved with the Trainer's state
(`check_resumed_optimizer`), whether or not the folder has a manifest."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zipfile
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..atomic import is_temporary
from ..checkpoint.format import CheckpointError, SavedProgress
from .checkpoint_manifest import MANIFEST_NAME, has_manifest, manifest_problems, save_interrupted
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


def _content_problems(folder: str) -> list[str]:
    """Cheap checks that each file of a folder without a manifest is whole: JSON parses, a safetensors file is as
    long as its header says, a torch file is a complete zip archive."""
    problems = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or is_temporary(name):
            continue
        size = os.path.getsize(path)
        if name.endswith(".json"):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (OSError, ValueError) as exc:
                problems.append(f"{name} is not valid JSON ({size} bytes: {type(exc).__name__})")
        elif name.endswith(".safetensors"):
            expected = _safetensors_size(path)
            if expected != size:
                problems.append(f"{name} is cut or damaged ({size} bytes, its header says "
                                f"{expected if expected is not None else 'nothing readable'})")
        elif name.endswith((".pt", ".pth", ".bin")) and not zipfile.is_zipfile(path):
            problems.append(f"{name} is not a complete torch.save archive ({size} bytes)")
    return problems


def _safetensors_size(path: str) -> int | None:
    """The file size a safetensors file's header implies (None when the header cannot be read)."""
    try:
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            if length > 100_000_000:
                return None
            header = json.loads(f.read(length))
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        return 8 + length + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return None


def checkpoint_problems(folder: str, need_optimizer: bool = True, manifest_expected: bool = False) -> list[str]:
    """What `folder` lacks to be resumed from (empty: it is complete). With a manifest
    (`hf_zenflow.hf.checkpoint_manifest`), every file it lists must match it; without one, the folder is incomplete
    when `manifest_expected` (an older checkpoint of the run has one), else each file is checked to be whole."""
    problems = []
    if has_manifest(folder):
        problems += manifest_problems(folder)
    elif manifest_expected or save_interrupted(folder):
        problems.append(f"no {MANIFEST_NAME}: the save did not finish")
    if not os.path.isfile(os.path.join(folder, TRAINER_STATE_NAME)):
        problems.append(f"no {TRAINER_STATE_NAME}")
    weights = _weights_problem(folder)
    if weights:
        problems.append(weights)
    optimizer = _optimizer_problem(folder) if need_optimizer else None
    if optimizer:
        problems.append(optimizer)
    if not problems and not has_manifest(folder):
        problems += _content_problems(folder)
    return problems


def integrity_problems(folder: str) -> list[str]:
    """What is damaged or cut in `folder`'s files: against its manifest when it has one, else each file's own
    checks. (A missing file is left to the loader, whose refusal says what that file holds and what to do.)"""
    return manifest_problems(folder, missing=False) if has_manifest(folder) else _content_problems(folder)


def checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of `output_dir`, newest (largest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = sorted(((int(m.group(1)), name) for name in os.listdir(output_dir)
                    if (m := _CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))),
                   reverse=True)
    return [os.path.join(output_dir, name) for _, name in found]


def newest_complete_checkpoint(output_dir: str, need_optimizer: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` folder of `output_dir` (None when there is none), with a warning
    naming each newer folder skipped and what is wrong with it.

    A folder with a manifest is complete when the manifest checks; one without is complete when no older folder of
    the run has a manifest (a checkpoint of a plain Trainer, or of an older hf_zenflow) and its files are whole."""
    folders = checkpoint_folders(output_dir)
    manifests = [has_manifest(f) for f in folders]
    skipped = []
    for i, folder in enumerate(folders):
        problems = checkpoint_problems(folder, need_optimizer, manifest_expected=any(manifests[i + 1:]))
        if not problems:
            if skipped:
                logger.warning("ZenFlowTrainer: resume_from_checkpoint=True: skipped incomplete checkpoint(s) %s "
                               "(a save interrupted, or a file damaged or partly copied); resuming from %s.",
                               "; ".join(skipped), folder)
            return folder
        skipped.append(f"{folder} ({', '.join(problems)})")
    if skipped:
        logger.warning("ZenFlowTrainer: resume_from_checkpoint=True: no complete checkpoint in %s: %s.", output_dir,
                       "; ".join(skipped))
    return None


def checked_resume(resume_from_checkpoint: Any, output_dir: str, need_optimizer: bool = True) -> Any:
    """What the Trainer should resume from for the `resume_from_checkpoint` a user passed: for True the newest
    complete checkpoint of `output_dir` (a `CheckpointError` when there is none: no ``checkpoint-N`` folder, or none
    complete); a folder named explicitly after checking its files (a damaged one is refused by name, not met as a
    bare decoding error halfway through loading)."""
    if resume_from_checkpoint is True:
        found = newest_complete_checkpoint(output_dir, need_optimizer)
        if found is None and checkpoint_folders(output_dir):
            raise CheckpointError(
                f"resume_from_checkpoint=True: no complete checkpoint in {output_dir} (each folder's problems are in "
                "the warning above). Start without resume_from_checkpoint, or restore a checkpoint from a copy.")
        if found is None:
            where = "has no checkpoint-N folder" if os.path.isdir(output_dir) else "does not exist"
            raise CheckpointError(
                f"resume_from_checkpoint=True: {output_dir} {where}: there is nothing to resume. Start without "
                "resume_from_checkpoint, or pass the output_dir (or the checkpoint folder) of the run to resume.")
        return found
    if isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(resume_from_checkpoint):
        problems = integrity_problems(os.fspath(resume_from_checkpoint))
        if problems:
            raise CheckpointError(f"{resume_from_checkpoint}: the checkpoint is incomplete or damaged: "
                                  f"{', '.join(problems)}. Resume from another checkpoint (or pass "
                                  "resume_from_checkpoint=True: the newest complete one).")
    return resume_from_checkpoint


def check_resumed_optimizer(loaded: SavedProgress | None, global_step: int, where: str,
                            max_grad_norm: float | None = None) -> None:
    """The optimizer state just loaded for a resume (`ZenFlowAdamW.loaded_progress`) against the Trainer's state
    loaded beside it: a `CheckpointError` when its step count is not `global_step` (``trainer_state.json``), naming
    both (a `torch.optim.AdamW` state, which leaves out the steps a GradScaler skipped, only when it has more); a
    warning when it was clipped at another `max_grad_norm` than the Trainer's (None: the Trainer does not clip
    through the optimizer), which takes effect. `where`: the file, for the messages. A manifest vouches for the
    files being whole, not for their coming from the same save: an optimizer file copied from another checkpoint
    (and the manifest rewritten) is whole too."""
    if loaded is None:
        return
    if loaded.steps != global_step and (loaded.exact or loaded.steps > global_step):
        raise CheckpointError(
            f"{where}: the optimizer state has taken {loaded.steps} optimizer step(s), but the checkpoint's "
            f"{TRAINER_STATE_NAME} says global_step={global_step}: the file was saved at another step or by another "
            "run (copied in by hand?), and resuming would continue another point of training. Resume from a "
            "checkpoint whose files were saved together.")
    if max_grad_norm is not None and loaded.max_grad_norm is not None and loaded.max_grad_norm != max_grad_norm:
        logger.warning("ZenFlowTrainer: %s was saved by a run that clipped at max_grad_norm=%g; this run clips at %g, "
                       "which takes effect. If max_grad_norm was not changed for this resume, the optimizer file "
                       "comes from another run: resume from a checkpoint whose files were saved together.", where,
                       loaded.max_grad_norm, max_grad_norm)


__all__ = ["check_resumed_optimizer", "checked_resume", "checkpoint_folders", "checkpoint_problems",
           "integrity_problems", "newest_complete_checkpoint"]
