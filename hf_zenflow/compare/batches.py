"""Every batch the runs of one comparison see, built from a `data_source.Source`.

Tokenising is `Dataset.map(batched=True)`; padding is transformers' collators. Which rows train and which are held
out, and the batch order, are fixed by seeds, so that every optimizer (and every earlier run of the built-in corpus)
sees the same batches:

* rows: drawn with `DATA_SPLIT_SEED` whatever ``--seed`` is, so different seeds are measured on the same held-out
  examples; without a held-out split, the first rows of that permutation are held out (classification);
* causal LM: the token stream of the texts (documents joined by the EOS token) is cut into blocks of ``max_length``;
  without a held-out split, the last 10 % of the stream is held out (contiguous: no held-out block was trained on);
* the training order: reshuffled every epoch from ``--seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from hf_zenflow.compare.data_source import DataError, Source


#: The rows' permutation seed (independent of --seed: the held-out examples stay the same across seeds).
DATA_SPLIT_SEED = 1234
#: Causal LM without a held-out split: this share of the token stream, at its end, is held out.
LM_HELD_OUT_SHARE = 0.1
#: Classification without a held-out split, when train + eval sizes exceed the rows: the most that is held out.
CARVE_MAX_SHARE = 0.2


@dataclass
class Batch:
    """One batch as model keyword arguments, plus how many labels it scores."""

    inputs: dict[str, torch.Tensor]
    n_items: int

    def to(self, device: torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.inputs.items()}, self.n_items)


@dataclass
class Batches:
    train: list[Batch]
    eval: list[Batch]
    train_examples: int
    eval_examples: int
    label_names: list[str] | None = None  # class names of string labels (id = position); None for class ids
    num_labels: int | None = None  # classification only


def _permutation(n: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(DATA_SPLIT_SEED)).tolist()


def training_order(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Row indices of `steps` batches: reshuffled each epoch by `seed`, identical for every optimizer."""
    gen = torch.Generator().manual_seed(seed)
    batches: list[list[int]] = []
    perm: list[int] = []
    while len(batches) < steps:
        if len(perm) < batch_size:
            perm += torch.randperm(n, generator=gen).tolist()
        batches.append(perm[:batch_size])
        perm = perm[batch_size:]
    return batches


def _rows(source: Source, train_size: int, eval_size: int) -> tuple[Any, Any]:
    """(train rows, held-out rows) as Datasets, drawn with `DATA_SPLIT_SEED`."""
    if source.eval is not None:
        return (source.train.select(_permutation(len(source.train))[:train_size]),
                source.eval.select(_permutation(len(source.eval))[:eval_size]))
    n = len(source.train)
    n_eval = eval_size if train_size + eval_size <= n else min(eval_size, int(n * CARVE_MAX_SHARE))
    perm = _permutation(n)
    if n_eval < 1 or n - n_eval < 1:
        raise DataError(f"{source.description}: {n} rows are too few to carve a held-out part; give a held-out split "
                        "(--eval-split) or more rows.")
    return source.train.select(perm[n_eval:n_eval + train_size]), source.train.select(perm[:n_eval])


def _labels(source: Source, *splits: Any) -> tuple[list[list[int]], list[str] | None, int]:
    """Class ids of each split, the class names when the labels are strings, and the number of classes."""
    column = source.label_column
    feature = splits[0].features[column]
    values = [ds[column] for ds in splits]
    if any(v is None for v in chain.from_iterable(values)):
        raise DataError(f"label column {column!r} has empty values.")
    names = getattr(feature, "names", None)  # a ClassLabel: ids already, with names
    if names is not None:
        return values, list(names), len(names)
    kinds = {type(v) for v in chain.from_iterable(values)}
    if kinds <= {int, bool}:
        ids = [[int(v) for v in vs] for vs in values]
        low, high = min(chain.from_iterable(ids)), max(chain.from_iterable(ids))
        if low < 0:
            raise DataError(f"label column {column!r} holds {low}: class ids must be >= 0.")
        return ids, None, max(2, high + 1)
    if kinds <= {str}:
        names = sorted(set(chain.from_iterable(values)))
        index = {name: i for i, name in enumerate(names)}
        return [[index[v] for v in vs] for vs in values], names, max(2, len(names))
    raise DataError(f"label column {column!r} holds {sorted(k.__name__ for k in kinds)}: compare classifies, so "
                    "labels must be class ids (integers) or class names (strings).")


def _texts(ds: Any, column: str) -> Any:
    if any(v is None for v in ds[column]):
        raise DataError(f"text column {column!r} has empty values.")
    return ds


def classification_batches(source: Source, tokenizer: Any, steps: int, train_size: int, eval_size: int,
                           batch_size: int, max_length: int, seed: int, eval_batch_size: int) -> Batches:
    """Padded per batch (not to `max_length`): most review sentences are ~26 tokens, so this halves the
    forward/backward cost on a CPU without changing what the model sees. Held-out rows are sorted by length (little
    padding when evaluating)."""
    from transformers import DataCollatorWithPadding

    train, held_out = _rows(source, train_size, eval_size)
    (train_y, eval_y), names, num_labels = _labels(source, train, held_out)

    def encode(ds: Any, ys: list[int]) -> list[dict[str, Any]]:
        enc = _texts(ds, source.text_column).map(
            lambda b: tokenizer(b[source.text_column], truncation=True, max_length=max_length), batched=True,
            remove_columns=ds.column_names, keep_in_memory=True)
        return [{"input_ids": ids, "attention_mask": mask, "labels": y}
                for ids, mask, y in zip(enc["input_ids"], enc["attention_mask"], ys)]

    collate = DataCollatorWithPadding(tokenizer, return_tensors="pt")

    def make(rows: list[dict[str, Any]]) -> Batch:
        return Batch(dict(collate(rows)), len(rows))

    train_rows, eval_rows = encode(train, train_y), encode(held_out, eval_y)
    train_batches = [make([train_rows[i] for i in b]) for b in training_order(len(train_rows), steps, batch_size,
                                                                              seed)]
    eval_rows.sort(key=lambda r: len(r["input_ids"]))  # stable: ties keep the drawn order
    eval_batches = [make(eval_rows[s:s + eval_batch_size]) for s in range(0, len(eval_rows), eval_batch_size)]
    return Batches(train_batches, eval_batches, len(train_rows), len(eval_rows), names, num_labels)


def _token_stream(ds: Any, column: str, tokenizer: Any) -> list[int]:
    """The texts' tokens, documents joined by the EOS token (none after the last, none for a single document)."""
    enc = _texts(ds, column).map(lambda b: tokenizer(b[column], add_special_tokens=False), batched=True,
                                 remove_columns=ds.column_names, keep_in_memory=True)
    docs = enc["input_ids"]
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return list(chain.from_iterable(doc + sep if i < len(docs) - 1 else doc for i, doc in enumerate(docs)))


def _blocks(ids: list[int], length: int) -> list[list[int]]:
    return [ids[s:s + length] for s in range(0, len(ids) - length + 1, length)]


def causal_lm_batches(source: Source, tokenizer: Any, steps: int, train_size: int, eval_size: int, batch_size: int,
                      max_length: int, seed: int, eval_batch_size: int) -> Batches:
    """Fixed-length blocks; sizes count blocks of `max_length` tokens (asking for more than the text holds takes
    all of it)."""
    from transformers import default_data_collator

    ids = _token_stream(source.train, source.text_column, tokenizer)
    if source.eval is None:
        cut = int(len(ids) * (1 - LM_HELD_OUT_SHARE))
        train_blocks, eval_blocks = _blocks(ids[:cut], max_length), _blocks(ids[cut:], max_length)
    else:
        train_blocks = _blocks(ids, max_length)
        eval_blocks = _blocks(_token_stream(source.eval, source.text_column, tokenizer), max_length)
    if not train_blocks or not eval_blocks:
        raise DataError(f"{source.description}: too little text for one training and one held-out block of "
                        f"--max-length {max_length} tokens.")
    train_blocks = train_blocks[:max(1, train_size)]
    eval_blocks = eval_blocks[:max(1, eval_size)]

    def make(rows: list[list[int]]) -> Batch:
        inputs = dict(default_data_collator([{"input_ids": r, "attention_mask": [1] * len(r), "labels": r}
                                             for r in rows]))
        return Batch(inputs, len(rows) * (max_length - 1))

    train_batches = [make([train_blocks[i] for i in b])
                     for b in training_order(len(train_blocks), steps, batch_size, seed)]
    eval_batches = [make(eval_blocks[s:s + eval_batch_size]) for s in range(0, len(eval_blocks), eval_batch_size)]
    return Batches(train_batches, eval_batches, len(train_blocks), len(eval_blocks))
