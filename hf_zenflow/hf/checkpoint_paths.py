"""What `hf-zenflow convert-checkpoint` and `reshard-checkpoint` check on a checkpoint folder before torch is
imported (a refusal in well under a second, where importing torch alone takes seconds): that the folder is there, and
that the number of ranks a re-shard asks for is one the checkpoint can be split into.

How many ranks a checkpoint can be split into: each rank's part of a parameter's optimizer state is a range of one of
its dimensions (DDP: a share of the host rows or columns; FSDP2: a block of rows), so beyond the longest dimension of
any parameter the extra ranks would hold nothing of anything. The weights' shapes are read from the headers of the
checkpoint's safetensors files (a few KB each), not from the tensors.

Example:
    >>> import tempfile
    >>> missing_folder_message(Path(tempfile.gettempdir()) / "no-such-checkpoint").endswith("no such checkpoint "
    ...                                                                                    "folder.")
    True
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


#: A safetensors header larger than this is not read (a damaged or foreign file): the bound is then left to the
#: optimizer state's own shapes (`hf_zenflow.checkpoint.reshard.reshard_states`).
MAX_HEADER_BYTES = 100 << 20


def missing_folder_message(folder: Path) -> str | None:
    """None when `folder` is a folder, else the one line that says so (and, when an interrupted conversion left the
    original aside, where it is)."""
    if folder.is_dir():
        return None
    aside = f".{folder.name}.replaced-*"
    leftovers = sorted(p.name for p in folder.parent.glob(aside)) if folder.parent.is_dir() else []
    hint = (f" A conversion was interrupted between two renames: the original is {folder.parent / leftovers[0]}; "
            f"rename it back to {folder.name}." if leftovers else "")
    return f"{folder}: no such checkpoint folder.{hint}"


def safetensors_shapes(path: Path) -> dict[str, list[int]] | None:
    """Each tensor's shape in the safetensors file `path`, from its header (an 8-byte little-endian length, then
    that many bytes of JSON); None when the file has no readable header."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(length))
        return {name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def longest_weight_dimension(folder: Path) -> tuple[int, str] | None:
    """The longest dimension of any tensor in the checkpoint's safetensors files and the tensor's name; None when the
    folder has no readable safetensors file (a checkpoint of optimizer files only)."""
    longest: tuple[int, str] | None = None
    for path in sorted(folder.glob("*.safetensors")):
        for name, shape in (safetensors_shapes(path) or {}).items():
            if shape and (longest is None or max(shape) > longest[0]):
                longest = (max(shape), name)
    return longest


def world_size_problem(folder: Path, world_size: int) -> str | None:
    """None when the checkpoint in `folder` can be split into `world_size` ranks (or its weights say nothing), else
    the one line that says how many it can be split into."""
    longest = longest_weight_dimension(folder)
    if longest is None or world_size <= longest[0]:
        return None
    return (f"--world-size {world_size} is invalid for {folder}: allowed is at most {longest[0]}, the longest "
            f"dimension of any of its weights ({longest[1]}); beyond it a rank would hold no part of any parameter. "
            "(A one-process optimizer.pt loads on any number of ranks as it is.)")


__all__ = ["longest_weight_dimension", "missing_folder_message", "safetensors_shapes", "world_size_problem"]
