"""Quality study: what ZenFlow's settings cost in held-out quality, measured by paired runs against adamw_torch.

For every seed, every run (adamw_torch and each ZenFlow setting) starts from the same weights (the same seed
initialises the classification head / LoRA factors) and sees the same batches in the same order; only the optimizer
differs. The difference ZenFlow minus adamw_torch is taken per seed, and its mean is reported with a t-based 95 %
interval over seeds. The training loop is the `hf-zenflow compare` runner's plain PyTorch loop (`train_one`), with the
library defaults (`ZenFlowConfig()`) for every setting not in the grid.

Tasks (sizes chosen so that the whole study runs in about an hour on a 2-core CPU):

* ``minilm``: all-MiniLM-L6-v2 on Rotten Tomatoes sentences, 2 000 training sentences, one epoch of 63 steps at batch
  32, lr 5e-5 (a user's first fine-tune), 3 000 held-out sentences; metric: held-out accuracy (points) and loss;
* ``minilm-epoch``: the same model, data and held-out sentences, a fine-tune that runs its course: one epoch over
  6 000 training sentences, 188 steps at batch 32 (the ``minilm`` task's 63 steps end while the run is still
  leaving the plateau it starts on, where a few steps' delay shows as a few per cent of held-out loss);
* ``smollm2``: SmolLM2-135M-Instruct (all 30 layers), full fine-tune on Hamlet with short blocks so that a run fits
  a 2-core CPU: 60 blocks of 32 tokens, one epoch of 30 steps at batch 2, lr 5e-5; held-out = 96 blocks (3 072
  tokens) from the last 10 % of the play; metric: held-out loss (a 6-layer cut of the model was tried first and
  dropped: its held-out loss, ~12.8, is worse than a uniform guess, so it measures repair, not fine-tuning);
* ``smollm2-lora``: the same model and data with LoRA (peft, r=8 on q/k/v/o/gate/up/down), lr 5e-4.

Usage (results are appended to a JSONL file, so an interrupted study resumes where it stopped):

    python scripts/quality_study.py run --task minilm --seeds 0 1 2 3 4 --grid minilm --out runs/quality/study.jsonl
    python scripts/quality_study.py summary runs/quality/study.jsonl > runs/quality/study.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from hf_zenflow.compare.runner import CompareConfig, machine_info
from hf_zenflow.settings.rules import split_rules
from hf_zenflow.tuning.tune import (
    TrialSetting,
    default_grid,
    library_default_setting,
    paired_interval,
    parse_settings,
    run_trial,
)


TASKS: dict[str, dict[str, Any]] = {
    "minilm": {"model": None, "steps": 63, "train_size": 2000, "eval_size": 3000, "batch_size": 32, "lr": 5e-5,
               "eval_batch_size": 128, "max_length": 64},
    "minilm-epoch": {"model": None, "steps": 188, "train_size": 6000, "eval_size": 3000, "batch_size": 32,
                     "lr": 2e-4, "eval_batch_size": 128, "max_length": 64},
    "smollm2": {"model": "smollm2", "steps": 30, "train_size": 60, "eval_size": 96, "batch_size": 2, "lr": 5e-5,
                "eval_batch_size": 32, "max_length": 32},
    "smollm2-lora": {"model": "smollm2", "steps": 30, "train_size": 60, "eval_size": 96, "batch_size": 2,
                     "lr": 5e-4, "eval_batch_size": 32, "max_length": 32, "lora": True},
}

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def grid(name: str) -> list[TrialSetting]:
    """Named subsets of the tuning grid (topk_ratio x update_interval x host_step). A rule of the host step on its
    own (``host_lr_scale=interval``, say) is a study of ``--grid default --zenflow host_lr_scale=interval``."""
    full = default_grid()
    if name == "full":
        return full
    if name == "minilm":  # every interval x scale at r=0.1, the other ratios at the library default interval
        d = library_default_setting()
        return [s for s in full if s.topk_ratio == 0.1 or (s.update_interval == d.update_interval)]
    if name == "lm":  # the interval sweep at r=0.1 with both host steps
        return [s for s in full if s.topk_ratio == 0.1]
    if name == "lm-small":  # U=1, the default U with both host steps, auto
        d = library_default_setting()
        return [s for s in full if s.topk_ratio == 0.1 and s.update_interval in (1, d.update_interval, "auto")]
    if name == "lm3":  # the library default, the same with ZenFlow's host step, Zen-auto
        d = library_default_setting()
        return [d, dataclasses.replace(d, host_step="zenflow"), dataclasses.replace(d, update_interval="auto")]
    if name == "lm2":  # the library default and the same with ZenFlow's host step
        d = library_default_setting()
        return [d, dataclasses.replace(d, host_step="zenflow")]
    if name == "default":
        return [library_default_setting()]
    raise ValueError(f"unknown grid {name!r}: allowed are full, minilm, lm, lm-small, lm3, lm2, default.")


def prepare(task_name: str, seed: int, lr: float | None = None) -> tuple[Any, CompareConfig]:
    from hf_zenflow.compare.data import prepare_task

    spec = dict(TASKS[task_name], **({"lr": lr} if lr is not None else {}))
    lora = spec.pop("lora", False)
    layers = spec.pop("layers", None)
    cfg = CompareConfig(seed=seed, quiet=True, log_every=0, device_memory_limit_bytes="free", **spec)
    task = prepare_task(model=cfg.model, steps=cfg.steps, train_size=cfg.train_size, eval_size=cfg.eval_size,
                        batch_size=cfg.batch_size, max_length=cfg.max_length, seed=seed,
                        eval_batch_size=cfg.eval_batch_size,
                        metric="accuracy")  # eval_accuracy: classification, or a causal LM's next-token accuracy
    if layers:
        # a run must fit a 2-core CPU: keep the first `layers` decoder layers (real weights; the model is degraded,
        # and fine-tuning recovers part of it, which is what the held-out loss measures)
        inner = task.base_model.model
        inner.layers = inner.layers[:layers]
        task.base_model.config.num_hidden_layers = layers
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)  # the LoRA A factors are drawn from the seed; B starts at zero
        task.base_model = get_peft_model(task.base_model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                                     target_modules=LORA_TARGETS))
    return task, cfg


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["task"], r["seed"], r["label"]))
    overrides = parse_settings(" ".join(args.zenflow))
    # a field the grid's settings carry (topk_ratio, update_interval, host_step) is set in the setting itself, whose
    # own value would otherwise win in `run_trial`; its label then says it
    varied = {k: overrides.pop(k) for k in [f.name for f in dataclasses.fields(TrialSetting)] if k in overrides}
    # engine rules (`EngineRules`: host_lr_scale=interval, say) reach the ZenFlow run through CompareConfig.rules
    fields, rules = split_rules(overrides)
    trial_overrides = {**fields, **({"rules": rules} if rules else {})}
    settings = [dataclasses.replace(s, **varied) for s in grid(args.grid)]
    suffix = "".join(f" {k}={v}" for k, v in sorted(overrides.items()))

    def label(s: TrialSetting | None) -> str:
        return s.label + suffix if s else "adamw_torch"

    for seed in args.seeds:
        runs = [*([] if args.no_reference else [None]), *settings]
        todo = [s for s in runs if (args.task, seed, label(s)) not in done]
        if not todo:
            continue
        task, cfg = prepare(args.task, seed, args.lr)
        device = cfg.resolved_device()
        for setting in todo:
            t0 = time.perf_counter()
            rec = run_trial("zenflow" if setting else "adamw_torch", task, cfg, device, setting,
                            **(trial_overrides if setting else {}))
            rec.update(task=args.task, seed=seed, label=label(setting), zenflow_overrides=overrides, lr=cfg.lr,
                       utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                       zenflow_defaults=dataclasses.asdict(library_default_setting()))
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"[study] {args.task} seed {seed} {rec['label']:<24s} loss {rec['eval_loss']:.4f} "
                  f"acc {rec['eval_accuracy']:.4f} {rec['steps_per_s']:.2f} steps/s "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del task
    return 0


def summarize(records: list[dict[str, Any]], reference: str = "adamw_torch", decimals: int = 2) -> str:
    """Markdown: per task, per setting, the paired differences (setting minus the `reference` run of the same seed)
    with their 95 % interval and the per-seed values. `reference` is a run label: "adamw_torch", or a ZenFlow
    setting's (a setting against another); `decimals`: of the mean differences and their intervals."""
    by_task: dict[str, dict[int, dict[str, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        by_task[r["task"]][r["seed"]][r["label"]] = r
    lines: list[str] = []
    for task_name, seeds in by_task.items():
        labels: list[str] = []
        for per_seed in seeds.values():
            labels += [k for k in per_seed if k != reference and k not in labels]
        ref_acc = [s[reference]["eval_accuracy"] for s in seeds.values() if reference in s]
        ref_loss = [s[reference]["eval_loss"] for s in seeds.values() if reference in s]
        lines += [f"### {task_name}", "",
                  f"{reference}: held-out accuracy mean {statistics.fmean(ref_acc):.4f}, loss mean "
                  f"{statistics.fmean(ref_loss):.4f} over {len(ref_acc)} seeds.", "",
                  "| setting | seeds | accuracy diff, points (mean ± 95 % CI) | held-out loss diff, % (mean ± 95 % "
                  "CI) | per-seed accuracy diff | per-seed loss diff % | steps/s (mean) | critical path ms (mean) | "
                  "mean window | device columns' gradient share |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for label in labels:
            pairs = [(s[label], s[reference]) for s in seeds.values() if label in s and reference in s]
            if not pairs:
                continue
            acc = [100 * (z["eval_accuracy"] - a["eval_accuracy"]) for z, a in pairs]
            loss = [100 * (z["eval_loss"] / a["eval_loss"] - 1) for z, a in pairs]
            am, ah = paired_interval(acc)
            lm, lh = paired_interval(loss)
            windows = [z["mean_window"] for z, _ in pairs if z.get("mean_window")]
            shares = [z["selected_grad_share"] for z, _ in pairs if z.get("selected_grad_share") is not None]
            lines.append(
                f"| {label} | {len(pairs)} | {_pm(am, ah, decimals)} | {_pm(lm, lh, decimals)} | "
                f"{' / '.join(f'{v:+.1f}' for v in acc)} | {' / '.join(f'{v:+.{max(decimals, 3)}f}' for v in loss)} | "
                f"{statistics.fmean(z['steps_per_s'] for z, _ in pairs):.2f} | "
                f"{statistics.fmean(z['critical_path_ms'] for z, _ in pairs):.1f} | "
                f"{statistics.fmean(windows) if windows else float('nan'):.1f} | "
                f"{f'{statistics.fmean(shares):.2f}' if shares else '-'} |")
        ref = [s[reference] for s in seeds.values() if reference in s]
        lines += ["", f"{reference}: {statistics.fmean(r['steps_per_s'] for r in ref):.2f} steps/s, critical path "
                      f"{statistics.fmean(r['critical_path_ms'] for r in ref):.1f} ms (mean). Wall time of the task: "
                      f"{sum(r['seconds'] for s in seeds.values() for r in s.values()) / 60:.1f} min.", ""]
    return "\n".join(lines)


def _pm(mean: float, half: float | None, decimals: int = 2) -> str:
    return f"{mean:+.{decimals}f}" if half is None else f"{mean:+.{decimals}f} ± {half:.{decimals}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", allow_abbrev=False)
    p.add_argument("--task", choices=sorted(TASKS), required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--grid", default="minilm")
    p.add_argument("--lr", type=float, default=None, help="the peak learning rate (default: the task's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--zenflow", nargs="*", default=[],
                   help="compare-runner ZenFlow fields KEY=VALUE for every ZenFlow run (e.g. min_offload_numel=0)")
    p.add_argument("--no-reference", action="store_true",
                   help="ZenFlow runs only (no adamw_torch run); pair them with `summary --reference LABEL`")
    p.add_argument("--out", required=True)
    s = sub.add_parser("summary", allow_abbrev=False)
    s.add_argument("files", nargs="+")
    s.add_argument("--reference", default="adamw_torch",
                   help="the run label the others are paired with (default adamw_torch)")
    s.add_argument("--decimals", type=int, default=2, help="decimals of the mean differences and intervals")
    args = parser.parse_args(argv)
    if args.command == "run":
        torch.set_num_threads(args.threads)
        print(f"[study] {json.dumps(machine_info(torch.device('cpu')))}", flush=True)
        return run(args)
    records = [json.loads(line) for f in args.files for line in Path(f).read_text().splitlines() if line.strip()]
    print(summarize(records, args.reference, args.decimals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
