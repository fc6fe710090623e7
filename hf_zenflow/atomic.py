"""Atomic writes: a file or folder appears under its real name only once it is complete.

Every file hf_zenflow writes goes through here. A file is written under a temporary name in the same folder
(``.NAME.tmp-PID-XXXX``), flushed and fsynced, renamed over the real name (`os.replace`, atomic on POSIX file systems)
and the folder is fsynced, so that the rename itself survives a power loss. A process killed at any moment leaves
either the old file or the new one under the real name, never a cut one; the temporary name left behind by a kill
starts with a dot and is never read.

A folder is built the same way: under a temporary sibling name (`staged_folder`), renamed to its real name at the end.
`replace_folder` swaps a finished folder in for an existing one, which is removed only once the new one is in place.

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> write_text(folder / "a.txt", "complete")
    >>> (folder / "a.txt").read_text(), sorted(p.name for p in folder.iterdir())
    ('complete', ['a.txt'])
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


def temporary_sibling(path: str | os.PathLike[str], kind: str = "tmp") -> Path:
    """A free name beside `path`, hidden (leading dot), unique to this process: ``.NAME.KIND-PID-XXXXXXXX``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def is_temporary(name: str) -> bool:
    """A name made by `temporary_sibling` (any kind): a leftover of an interrupted write, never a result."""
    return name.startswith(".") and any(f".{kind}-" in name for kind in ("tmp", "staging", "replaced"))


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make the entries of `folder` (a rename, a new file) durable. A no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # (Windows, or a file system that refuses it: nothing more can be done)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path` for a writer that wants a path (safetensors, ``save_pretrained`` of a
    single file); on success it is fsynced and renamed to `path`, on failure removed."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_folder(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb", **kwargs: Any) -> Iterator[IO[Any]]:
    """`open(path, mode)` for writing, atomically: see the module docstring."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f
        f.flush()


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding=encoding, newline="") as f:
        f.write(text)


def write_json(path: str | os.PathLike[str], obj: Any, **dumps: Any) -> None:
    write_text(path, json.dumps(obj, **dumps))


def torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """`torch.save(obj, path)`, atomically."""
    import torch

    with atomic_open(path, "wb") as f:
        torch.save(obj, f)


def save_figure(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """A matplotlib figure's ``savefig``, atomically (the format from `path`'s suffix)."""
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=Path(path).suffix.lstrip(".") or "png", **kwargs)


@contextlib.contextmanager
def staged_folder(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a new, empty temporary sibling folder of `final`, to be filled and then published with `publish_folder`
    or `replace_folder`; it is removed when the block fails."""
    staging = temporary_sibling(final, "staging")
    staging.mkdir(parents=False)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def sync_tree(folder: str | os.PathLike[str]) -> None:
    """fsync every file and folder under `folder` (before it is renamed into place)."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError), open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_folder(root)


def replace_folder(staging: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Put the finished folder `staging` under the name `final`. An existing `final` is first renamed aside and
    removed only after the new one is in place: a process killed in between leaves it beside `final` as
    ``.NAME.replaced-PID-XXXX`` (and `final` itself, or nothing under that name if killed between the two renames:
    the aside copy is then the only one, and complete)."""
    staging, final = Path(staging), Path(final)
    sync_tree(staging)
    aside = None
    if final.exists():
        aside = temporary_sibling(final, "replaced")
        os.replace(final, aside)
    os.replace(staging, final)
    fsync_folder(final.parent)
    if aside is not None:
        shutil.rmtree(aside) if aside.is_dir() and not aside.is_symlink() else aside.unlink()


def check_writable_folder(path: str | os.PathLike[str], what: str) -> None:
    """Raise a `ValueError` naming `what` when a folder could not be created at `path` (or written into, when it
    exists): its nearest existing ancestor must be a writable folder. Checked before any work starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a folder.")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{what} {path}: {probe} is a file, not a folder.")
    try:  # (os.access says yes to root on a read-only file system: try it)
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".probe.tmp-"))
    except OSError as exc:
        raise ValueError(f"{what} {path}: {probe} is not writable ({exc.strerror or exc}).") from None


__all__ = ["atomic_open", "atomic_path", "check_writable_folder", "fsync_folder", "is_temporary",
           "replace_folder", "save_figure", "staged_folder", "sync_tree", "temporary_sibling", "torch_save",
           "write_bytes", "write_json", "write_text"]
