"""One optimizer file per rank in a checkpoint, for ZenFlow under several processes (DDP).

The Trainer writes ``optimizer.pt``, and accelerate's ``save_state`` ``optimizer.bin``, from the main process only.
Under several ranks a ZenFlow optimizer's state dict holds that rank's share of the host state (or, before the host
state is sharded, a full copy), and taking it may involve collectives, so every rank saves its own
``zenflow_optimizer_rank{r}_of_{N}.pt`` next to where that file would be, with the world size recorded in the name
and in the file, and loads its own file on resume. Only the public ``state_dict()`` / ``load_state_dict()`` of the
optimizer are used.

What loads where:

- the same world size: each rank its own file;
- a one-process checkpoint (``optimizer.pt``; ``optimizer.bin`` for accelerate) under N ranks: every rank loads it
  (the optimizer takes its share);
- rank files of N ranks under another world size (one process included): refused with `CheckpointError`, naming
  both world sizes and the command that re-shards them (`reshard_checkpoint`: ``hf-zenflow reshard-checkpoint
  CHECKPOINT --world-size M``, offline, so that each new rank reads only its own file).

accelerate writes its ``optimizer.bin`` whatever the optimizer's state dict is, so under several ranks it gets a
*pointer* instead (`rank_files_pointer`): a few bytes saying which rank files hold the state, so that the file neither
repeats rank 0's share nor passes for a one-process checkpoint.

Example:
    >>> rank_file_name(1, 2)
    'zenflow_optimizer_rank1_of_2.pt'
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..atomic import fsync_folder, is_temporary, temporary_sibling, torch_save
from ..checkpoint.format import CheckpointError, load_file
from .checkpoint_manifest import remove_manifest, write_manifest


#: The Trainer's one-process optimizer file (transformers.trainer.OPTIMIZER_NAME).
OPTIMIZER_NAME = "optimizer.pt"
#: accelerate's optimizer file of `Accelerator.save_state` (accelerate.utils.OPTIMIZER_NAME + ".bin").
ACCELERATE_OPTIMIZER_NAME = "optimizer.bin"
_POINTER_KEY = "zenflow_rank_files"
_RANK_FILE = re.compile(r"zenflow_optimizer_rank(\d+)_of_(\d+)\.pt")
#: The format of a rank file: ``{"format": 1, "rank": r, "world_size": N, "optimizer": state_dict}``.
RANK_FILE_FORMAT = 1


def rank_file_name(rank: int, world_size: int) -> str:
    return f"zenflow_optimizer_rank{rank}_of_{world_size}.pt"


def saved_world_sizes(checkpoint: str) -> set[int]:
    """The world sizes of the rank files in `checkpoint` (empty when there are none)."""
    if not os.path.isdir(checkpoint):
        return set()
    matches = (_RANK_FILE.fullmatch(name) for name in os.listdir(checkpoint))
    return {int(m.group(2)) for m in matches if m is not None}


def save_rank_state(optimizer: Any, output_dir: str, rank: int, world_size: int) -> str:
    """Write this rank's `optimizer.state_dict()` to its rank file in `output_dir`; returns the path.

    Every rank must call it (the state dict may need collectives). Written to a temporary name and renamed, so that
    a process killed while saving leaves no half-written rank file under the real name.
    """
    os.makedirs(output_dir, exist_ok=True)  # a rank may get here before the main process has saved the model
    path = os.path.join(output_dir, rank_file_name(rank, world_size))
    torch_save(_rank_payload(optimizer.state_dict(), rank, world_size), path)
    return path


def _rank_payload(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    return {"format": RANK_FILE_FORMAT, "rank": rank, "world_size": world_size, "optimizer": state}


def rank_files_pointer(world_size: int) -> dict[str, Any]:
    """What stands in a one-process optimizer file of a checkpoint whose state is in the rank files of
    `world_size` ranks."""
    return {_POINTER_KEY: {"format": RANK_FILE_FORMAT, "world_size": world_size}}


def is_rank_files_pointer(state: Any) -> bool:
    return isinstance(state, dict) and _POINTER_KEY in state


def _world_size_error(checkpoint: str, saved: str, world_size: int) -> CheckpointError:
    return CheckpointError(
        f"{checkpoint}: the ZenFlow optimizer state was saved by {saved}, and this run has world size {world_size}. "
        f"Resume with the world size of the checkpoint, or re-shard the optimizer files first: "
        f"hf-zenflow reshard-checkpoint {checkpoint} --world-size {world_size}"
    )


def _describe(sizes: set[int]) -> str:
    listed = " and ".join(str(s) for s in sorted(sizes))
    return f"{listed} processes (world size {listed})"


def check_one_process_resume(checkpoint: str) -> None:
    """Under one process: refuse a checkpoint that has only rank files (the stock Trainer would silently start
    with a fresh optimizer)."""
    sizes = saved_world_sizes(checkpoint) - {1}
    if sizes and not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
        raise _world_size_error(checkpoint, _describe(sizes), 1)


def load_rank_state(checkpoint: str, rank: int, world_size: int,
                    one_process_name: str = OPTIMIZER_NAME) -> dict[str, Any] | None:
    """This rank's optimizer state dict from `checkpoint` (on the host: ``map_location="cpu"``; the optimizer's
    loader places device parts), the one-process file `one_process_name` when there are no rank files, or None when
    the checkpoint has no optimizer state at all."""
    path = os.path.join(checkpoint, rank_file_name(rank, world_size))
    if os.path.isfile(path):
        payload = load_file(path, map_location="cpu")
        if (payload.get("rank"), payload.get("world_size")) != (rank, world_size):
            raise CheckpointError(
                f"{path}: the file holds rank {payload.get('rank')} of world size {payload.get('world_size')}, not "
                f"rank {rank} of {world_size} as its name says: it was renamed or copied over. Restore the original."
            )
        return payload["optimizer"]
    sizes = saved_world_sizes(checkpoint)
    if sizes - {world_size}:
        raise _world_size_error(checkpoint, _describe(sizes), world_size)
    if sizes:
        raise CheckpointError(f"{path}: no such file, but other ranks of world size {world_size} have theirs: the "
                              "checkpoint is incomplete (a rank died while saving). Resume from an earlier one.")
    one_process = os.path.join(checkpoint, one_process_name)
    if not os.path.isfile(one_process):
        return None
    state = load_file(one_process, map_location="cpu")
    if is_rank_files_pointer(state):
        raise CheckpointError(f"{one_process}: the optimizer state was saved in rank files of world size "
                              f"{state[_POINTER_KEY]['world_size']}, and {checkpoint} has none: they were not copied "
                              "with the checkpoint. Copy them, or resume without the optimizer state.")
    return state


def reshard_checkpoint(checkpoint: str, world_size: int, parallel: str | None = None,
                       log: Any = print) -> list[str]:
    """Rewrite the ZenFlow optimizer files of `checkpoint` for `world_size` ranks (`hf-zenflow
    reshard-checkpoint`): the rank files of the N ranks that saved it (or the one-process file) are merged and cut
    again (`hf_zenflow.checkpoint.reshard.reshard_states`), so that each new rank reads only its own file. One rank:
    ``optimizer.pt`` (a Trainer checkpoint; ``optimizer.bin`` when the folder is accelerate's); several: one rank file
    each (``optimizer.bin``, when present, becomes a pointer to them). The files it replaces are kept with the suffix
    ``.before_reshard`` (``.before_reshard.2``, ... when an earlier run's backups are there). `parallel`:
    ``"ddp"`` or ``"fsdp2"`` for the new ranks (default: as saved). Returns the files written.

    The new files are written under temporary names first, and the old ones renamed to their backups only then: a
    run killed before that leaves the checkpoint as it was; killed in between, the backups (which a re-run names)
    are the complete original. A checkpoint manifest (`checkpoint_manifest`) is written anew."""
    from ..checkpoint.convert import is_torch_adamw_state
    from ..checkpoint.reshard import reshard_states

    if not os.path.isdir(checkpoint):
        raise CheckpointError(f"{checkpoint}: no such checkpoint folder.")
    sizes = saved_world_sizes(checkpoint)
    if len(sizes) > 1:
        raise CheckpointError(f"{checkpoint}: rank files of several world sizes ({_describe(sizes)}): keep one set.")
    accelerate = os.path.isfile(os.path.join(checkpoint, ACCELERATE_OPTIMIZER_NAME))
    one_name = ACCELERATE_OPTIMIZER_NAME if accelerate else OPTIMIZER_NAME
    if sizes:
        (saved,) = sizes
        old = [os.path.join(checkpoint, rank_file_name(r, saved)) for r in range(saved)]
        missing = [p for p in old if not os.path.isfile(p)]
        if missing:
            raise CheckpointError(f"{missing[0]}: no such file: the checkpoint of world size {saved} is incomplete.")
        log(f"reading {saved} rank files of {checkpoint}")
        states = [load_rank_state(checkpoint, r, saved, one_name) for r in range(saved)]
    else:
        path = os.path.join(checkpoint, one_name)
        if not os.path.isfile(path):
            backups = sorted(n for n in os.listdir(checkpoint) if ".before_reshard" in n and not is_temporary(n))
            if backups:
                restore = "; ".join(f"mv {os.path.join(checkpoint, b)} {os.path.join(checkpoint, _original(b))}"
                                    for b in backups[:4])
                raise CheckpointError(
                    f"{checkpoint}: no ZenFlow optimizer file to re-shard, but an earlier re-shard's backups are here "
                    f"({', '.join(backups[:4])}{', ...' if len(backups) > 4 else ''}): it was interrupted after "
                    f"setting the originals aside. Restore them ({restore}), then run it again.")
            raise CheckpointError(f"{checkpoint}: no ZenFlow optimizer file ({OPTIMIZER_NAME}, "
                                  f"{ACCELERATE_OPTIMIZER_NAME} or rank files) to re-shard.")
        log(f"reading {path}")
        old, states = [path], [load_file(path, map_location="cpu")]
        if is_torch_adamw_state(states[0]):
            raise CheckpointError(
                f"{path} is a torch.optim.AdamW state dict (what hf-zenflow convert-checkpoint writes), not a ZenFlow "
                "one: it is not split by rank, so there is nothing to re-shard; every rank of a plain Trainer run "
                "loads it as it is. To resume with ZenFlow on another number of ranks, re-shard the ZenFlow "
                "checkpoint before converting it.")
    new_states = reshard_states(states, world_size, parallel)
    if world_size == 1:
        new = {os.path.join(checkpoint, one_name): new_states[0]}
    else:
        new = {os.path.join(checkpoint, rank_file_name(r, world_size)): _rank_payload(state, r, world_size)
               for r, state in enumerate(new_states)}
        if accelerate:
            new[os.path.join(checkpoint, ACCELERATE_OPTIMIZER_NAME)] = rank_files_pointer(world_size)
    remove_manifest(checkpoint)  # (the folder no longer passes for complete while its files change)
    staged = {}
    try:
        for path, payload in new.items():  # every new file whole on disk before any old one moves
            staged[path] = temporary_sibling(path)
            torch_save(payload, staged[path])
    except BaseException:
        for tmp in staged.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    replaced = old + ([os.path.join(checkpoint, one_name)] if sizes and accelerate else [])
    suffix = _free_backup_suffix(replaced)
    for path in replaced:
        os.replace(path, path + suffix)
    for path, tmp in staged.items():
        os.replace(tmp, path)
    fsync_folder(checkpoint)
    if os.path.isfile(os.path.join(checkpoint, "trainer_state.json")):
        write_manifest(checkpoint)  # a Trainer checkpoint: vouched for again, with its new files
    for path in new:
        log(f"wrote {path}")
    return list(new)


def _original(backup: str) -> str:
    """The file name a ``.before_reshard[.N]`` backup was made from."""
    return re.sub(r"\.before_reshard(\.\d+)?$", "", backup)


def _free_backup_suffix(paths: list[str]) -> str:
    """``.before_reshard``, or ``.before_reshard.N`` with the smallest N >= 2 that none of `paths` has used: an
    earlier run's backups (perhaps the only original files left) are never overwritten."""
    n = 1
    while True:
        suffix = ".before_reshard" if n == 1 else f".before_reshard.{n}"
        if not any(os.path.exists(path + suffix) for path in paths):
            return suffix
        n += 1


__all__ = ["ACCELERATE_OPTIMIZER_NAME", "OPTIMIZER_NAME", "RANK_FILE_FORMAT", "check_one_process_resume",
           "is_rank_files_pointer", "load_rank_state", "rank_file_name", "rank_files_pointer", "reshard_checkpoint",
           "save_rank_state",
           "saved_world_sizes"]
