"""Where a `hf-zenflow compare` run writes: a new folder per run, never over an earlier run's results, and nothing in
its final place before the run has succeeded.

* no ``--output-dir``: a new folder ``zenflow_compare/<UTC time>_<model>/`` (``-2``, ``-3``... appended when two runs
  start in the same second), reserved empty at the start and removed when the run fails;
* ``--output-dir DIR``: exactly DIR; refused before anything is trained when DIR already holds a compare run's
  files, unless ``--overwrite``.

Either way the run writes into a hidden sibling folder (`hf_zenflow.atomic.staged_folder`) and only a run that has
written everything is moved into place (`RunOutput.publish`): with ``--overwrite`` the earlier run's files are set
aside, the new ones moved in, and only then the old ones removed. A run that fails (bad data, Ctrl-C, a full disk)
leaves DIR as it was and nothing else behind.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> first, second = new_run_dir(root, "minilm"), new_run_dir(root, "minilm")
    >>> first != second and first.parent == root and first.name.endswith("_minilm")
    True
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from hf_zenflow.atomic import fsync_folder, sync_tree, temporary_sibling


#: Parent of the per-run folders when no --output-dir is given.
DEFAULT_PARENT = "zenflow_compare"
#: What a run writes (and what earlier versions wrote: model_card.md); any of them marks a folder as taken.
OUTPUT_NAMES = ("results.json", "results.md", "loss_curves.png", "time_breakdown.png", "timeline.png",
                "zenflow_model", "model_card.md")


class OutputExistsError(FileExistsError):
    """--output-dir already holds a compare run's results and --overwrite was not given."""


def model_slug(model: str | None) -> str:
    """A folder-name-safe short name of `--model` ("minilm", "smollm2", or a local folder's name)."""
    name = Path(model).expanduser().name if model else "minilm"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def new_run_dir(parent: Path, model: str | None) -> Path:
    """Create and return a folder no other run uses: ``parent/<UTC time>_<model>[-N]``."""
    parent.mkdir(parents=True, exist_ok=True)
    stem = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}_{model_slug(model)}"
    for n in range(1, 1000):
        path = parent / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir()  # atomic: two runs starting in the same second get different folders
            return path
        except FileExistsError:
            continue
    raise OutputExistsError(f"{parent}: 999 runs named {stem} already exist.")


def taken_names(path: Path) -> list[str]:
    """The compare outputs already in `path`."""
    return [name for name in OUTPUT_NAMES if (path / name).exists() or (path / name).is_symlink()]


def check_output_dir(output_dir: str | None, overwrite: bool) -> None:
    """Refuse an --output-dir that names a file, or holds a compare run without --overwrite (before any work)."""
    if output_dir is None:
        return
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"--output-dir {path} is a file, not a folder: name a folder (new or a previous "
                                "compare run's, with --overwrite).")
    taken = taken_names(path) if path.is_dir() else []
    if taken and not overwrite:
        raise OutputExistsError(
            f"--output-dir {path} already holds a compare run ({', '.join(taken)}): pass --overwrite to replace it, "
            f"another --output-dir, or no --output-dir for a new folder under {DEFAULT_PARENT}/."
        )


class RunOutput:
    """A run's output: `staging` is where it writes, `final` where its files appear once `publish` is called."""

    def __init__(self, final: Path, reserved: bool, created: list[Path]) -> None:
        self.final = final
        self._reserved = reserved  # final is an empty folder made for this run (no --output-dir)
        self._created = created  # folders above final made for this run, innermost first
        self.staging = temporary_sibling(final, "staging")
        self.staging.mkdir()

    @classmethod
    def prepare(cls, output_dir: str | None, model: str | None, overwrite: bool) -> RunOutput:
        """The output of a run: see the module docstring for the rules."""
        check_output_dir(output_dir, overwrite)
        if output_dir is None:
            parent = Path(DEFAULT_PARENT)
            created = [] if parent.exists() else [parent]
            return cls(new_run_dir(parent, model), reserved=True, created=created)
        final = Path(output_dir)
        created = []
        probe = final.parent
        while not probe.exists() and probe != probe.parent:
            created.append(probe)
            probe = probe.parent
        final.parent.mkdir(parents=True, exist_ok=True)
        return cls(final, reserved=False, created=created)

    def publish(self) -> None:
        """Move the finished run into `final`; an earlier run's outputs there are removed only once the new ones
        are in place (a process killed in between leaves them in a hidden ``.NAME.replaced-...`` folder beside)."""
        sync_tree(self.staging)
        if self._reserved or not self.final.exists():
            os.replace(self.staging, self.final)  # (onto the empty reserved folder: POSIX replaces it)
            fsync_folder(self.final.parent)
            return
        aside = temporary_sibling(self.final, "replaced")
        aside.mkdir()
        for name in taken_names(self.final):
            os.replace(self.final / name, aside / name)
        for item in sorted(self.staging.iterdir()):
            os.replace(item, self.final / item.name)
        fsync_folder(self.final)
        shutil.rmtree(aside)
        self.staging.rmdir()

    def discard(self) -> None:
        """A failed run: remove what it wrote and the folders made for it; an earlier run's files stay."""
        shutil.rmtree(self.staging, ignore_errors=True)
        for folder in ([self.final] if self._reserved else []) + self._created:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break


__all__ = ["DEFAULT_PARENT", "OUTPUT_NAMES", "OutputExistsError", "RunOutput", "check_output_dir", "model_slug",
           "new_run_dir", "taken_names"]
