"""Where a `hf-zenflow compare` run writes: a new folder per run, never over an earlier run's results.

* no ``--output-dir``: a new folder ``zenflow_compare/<UTC time>_<model>/`` (``-2``, ``-3``... appended when two runs
  start in the same second);
* ``--output-dir DIR``: exactly DIR; refused before anything is trained when DIR already holds a compare run's
  files, unless ``--overwrite`` (which first removes those files, so no stale artefact of the earlier run remains).

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> first, second = new_run_dir(root, "minilm"), new_run_dir(root, "minilm")
    >>> first != second and first.parent == root and first.name.endswith("_minilm")
    True
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path


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


def prepare_output_dir(output_dir: str | None, model: str | None, overwrite: bool) -> Path:
    """The folder this run writes into (created); see the module docstring for the rules."""
    if output_dir is None:
        return new_run_dir(Path(DEFAULT_PARENT), model)
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"--output-dir {path} is a file, not a folder: name a folder (new or a previous "
                                "compare run's, with --overwrite).")
    taken = [name for name in OUTPUT_NAMES if (path / name).exists()]
    if taken and not overwrite:
        raise OutputExistsError(
            f"--output-dir {path} already holds a compare run ({', '.join(taken)}): pass --overwrite to replace it, "
            f"another --output-dir, or no --output-dir for a new folder under {DEFAULT_PARENT}/."
        )
    for name in taken:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path
