"""The manifest that marks a Trainer checkpoint folder complete: ``zenflow_manifest.json``, written last.

`ZenFlowTrainer` writes it (atomically) once every file of the checkpoint is on disk, every rank's included; it lists
each file under the folder with its size and hash (`file_digest`: SHA-256 over the file's 16 MiB pieces, hashed in
parallel). A folder whose manifest is missing, or names a file that is
missing, of another size or another hash, is not complete: a save was interrupted (a process killed, a full disk)
or a file was damaged later. `hf_zenflow.hf.resume` resumes only from a folder whose manifest checks.

Files added after the manifest (a copied README, say) are not checked; a tool that rewrites a checkpoint's files
(`hf-zenflow convert-checkpoint`, `reshard-checkpoint`) writes the manifest anew.

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "trainer_state.json").write_text("{}")
    >>> _ = write_manifest(folder); manifest_problems(folder)
    []
    >>> _ = (folder / "trainer_state.json").write_text("")
    >>> manifest_problems(folder)
    ['trainer_state.json has 0 bytes, the manifest says 2']
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..atomic import fsync_folder, is_temporary, write_json


MANIFEST_NAME = "zenflow_manifest.json"
#: Written first when a save starts and removed once the manifest is written: a folder that has it and no manifest
#: is a save that did not finish, even when each file it holds is whole (another rank's may be missing).
SAVING_MARKER = "zenflow_save_in_progress"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 24


def file_digest(path: str | os.PathLike[str], threads: int | None = None) -> str:
    """``sha256:`` the SHA-256 of the SHA-256 of each 16 MiB piece of the file, in order: the pieces are hashed by
    `threads` threads at once (hashlib releases the GIL; default: up to 8, one per core), so that the manifest of a
    checkpoint of many GB costs a fraction of writing it."""
    size = os.path.getsize(path)
    pieces = max(1, -(-size // _CHUNK))
    fd = os.open(path, os.O_RDONLY)
    try:
        def piece(i: int) -> bytes:
            return hashlib.sha256(os.pread(fd, _CHUNK, i * _CHUNK)).digest()

        workers = min(pieces, threads or min(8, os.cpu_count() or 1))
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                digests = list(pool.map(piece, range(pieces)))
        else:
            digests = [piece(i) for i in range(pieces)]
    finally:
        os.close(fd)
    return "sha256:" + hashlib.sha256(b"".join(digests)).hexdigest()


def checkpoint_files(folder: str | os.PathLike[str]) -> list[str]:
    """The files under `folder`, as sorted relative POSIX paths, without the manifest and temporary names."""
    folder = Path(folder)
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not is_temporary(d)]
        for name in files:
            if name in (MANIFEST_NAME, SAVING_MARKER) or is_temporary(name):
                continue
            found.append(Path(root, name).relative_to(folder).as_posix())
    return sorted(found)


def write_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Write `folder`'s manifest (every file's size and `file_digest`), atomically, after fsyncing those files; returns
    it. Call it once the folder is complete."""
    folder = Path(folder)
    files = {}
    for rel in checkpoint_files(folder):
        path = folder / rel
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # the files before the manifest that vouches for them
        files[rel] = {"size": path.stat().st_size, "digest": file_digest(path)}
    for root, _dirs, _files in os.walk(folder):
        fsync_folder(root)
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    write_json(folder / MANIFEST_NAME, manifest, indent=1, sort_keys=True)
    return manifest


def remove_manifest(folder: str | os.PathLike[str]) -> None:
    """Unmark `folder` complete (before its files are rewritten)."""
    path = Path(folder) / MANIFEST_NAME
    if path.exists():
        path.unlink()
        fsync_folder(folder)


def mark_saving(folder: str | os.PathLike[str]) -> None:
    """Mark `folder` as a save in progress (creating it), unmarking it complete: the first thing a save does."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    remove_manifest(folder)
    write_json(Path(folder) / SAVING_MARKER, {})


def finish_saving(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Write `folder`'s manifest, then drop the in-progress mark: the last thing a save does."""
    manifest = write_manifest(folder)
    marker = Path(folder) / SAVING_MARKER
    if marker.exists():
        marker.unlink()
        fsync_folder(folder)
    return manifest


def save_interrupted(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` is a save that started and never wrote its manifest."""
    return (Path(folder) / SAVING_MARKER).exists() and not has_manifest(folder)


def has_manifest(folder: str | os.PathLike[str]) -> bool:
    return (Path(folder) / MANIFEST_NAME).is_file()


def manifest_problems(folder: str | os.PathLike[str], hashes: bool = True, missing: bool = True) -> list[str]:
    """What is wrong with `folder` against its manifest (empty: complete). `hashes=False` checks sizes only;
    `missing=False` leaves out the files that are not there (for a caller that names those itself)."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return [f"no {MANIFEST_NAME} (the save did not finish)"]
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
        entries = {str(rel): (int(e["size"]), str(e["digest"])) for rel, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"{MANIFEST_NAME} is unreadable ({type(exc).__name__}: {exc})"]
    problems = []
    for rel, (size, digest) in sorted(entries.items()):
        target = folder / rel
        if not target.is_file():
            if missing:
                problems.append(f"{rel} is missing")
        elif target.stat().st_size != size:
            problems.append(f"{rel} has {target.stat().st_size} bytes, the manifest says {size}")
        elif hashes and file_digest(target) != digest:
            problems.append(f"{rel} differs from the manifest (same size, another hash: damaged)")
    return problems


__all__ = ["MANIFEST_NAME", "SAVING_MARKER", "checkpoint_files", "file_digest", "finish_saving", "has_manifest",
           "manifest_problems", "mark_saving", "remove_manifest", "save_interrupted", "write_manifest"]
