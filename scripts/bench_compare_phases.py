"""Per-phase cost of `hf-zenflow compare`'s default training step, the three optimizers side by side in one process.

Same model, data, core split (D device cores, H host cores), layouts and optimizer settings as the compare runner
(`CompareConfig()` defaults, `make_optimizer`, `column_major_` for the offloading runs). Each optimizer trains its
own copy; after `--warm` untimed steps each, the optimizers take turns in blocks of `--block` steps for `--rounds`
rounds (the order rotates every round), so a busy machine disturbs all three alike. ZenFlow's worker is waited for
(untimed) at the end of each block, so its host work does not spill into another optimizer's block.

Per step and phase (forward, backward with ZenFlow's gradient hooks, clip, optimizer.step, zero_grad): wall time,
the training thread's own CPU time (`time.thread_time`: user + system, not the time it waits for a core, the GIL or
the host step) and its minor page faults (`RUSAGE_THREAD`). On a machine shared with other work the CPU times are
the comparable figures; wall times are not quiet-machine figures.

Usage: python scripts/bench_compare_phases.py [--block 6] [--rounds 2] [--warm 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import time
from typing import Any

import torch

from hf_zenflow.compare.compare_config import CompareConfig
from hf_zenflow.compare.data import prepare_task
from hf_zenflow.compare.training_run import make_optimizer
from hf_zenflow.engine.layout import column_major_


PHASES = ("fwd", "bwd", "clip", "step", "zero")
CPU = ("cpu_fwd", "cpu_bwd", "cpu_rest", "cpu_total")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def one_step(run: dict[str, Any], name: str, batches: list[Any], max_grad_norm: float, record: bool) -> None:
    model, opt = run["model"], run["opt"]
    batch = batches[run["i"] % len(batches)]
    run["i"] += 1
    f0, c0, t0 = _faults(), time.thread_time(), time.perf_counter()
    loss = model(**batch.inputs).loss
    t1, c1 = time.perf_counter(), time.thread_time()
    loss.backward()
    t2, c2, f2 = time.perf_counter(), time.thread_time(), _faults()
    if name == "adamw_torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    else:
        opt.clip_grad_norm_(max_grad_norm)
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    t5, c5, f5 = time.perf_counter(), time.thread_time(), _faults()
    if not record:
        run["first"].append({"wall": (t5 - t0) * 1e3, "step": (t4 - t3) * 1e3, "cpu_after_backward": (c5 - c2) * 1e3})
        return
    rec = run["rec"]
    for key, value in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
        rec[key].append(value * 1e3)
    rec["total"].append((t5 - t0) * 1e3)
    for key, value in zip(CPU, (c1 - c0, c2 - c1, c5 - c2, c5 - c0)):
        rec[key].append(value * 1e3)
    rec["faults_fwd_bwd"].append(f2 - f0)
    rec["faults_rest"].append(f5 - f2)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--block", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", type=int, default=6)
    ap.add_argument("--optimizers", default="adamw_torch,sync_offload,zenflow")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    cfg = CompareConfig(steps=60)
    split = cfg.core_split()
    split.apply_device()  # as `train_one`: D intra-op threads (and the device's allocator model) before any forward
    task = prepare_task(
        model=cfg.model,
        task=cfg.task,
        steps=cfg.steps,
        train_size=cfg.train_size,
        eval_size=50,
        batch_size=cfg.batch_size,
        max_length=cfg.max_length,
        seed=cfg.seed,
        eval_batch_size=cfg.eval_batch_size,
        data=cfg.data_spec(),
        metric=cfg.metric,
    )
    batches = list(task.train_batches)
    names = args.optimizers.split(",")
    keys = (*PHASES, "total", *CPU, "faults_fwd_bwd", "faults_rest")
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        torch.manual_seed(cfg.seed)
        model = copy.deepcopy(task.base_model)
        if name != "adamw_torch":
            column_major_(model)
        model.train()
        runs[name] = {
            "model": model,
            "opt": make_optimizer(name, model, cfg),
            "i": 0,
            "first": [],
            "block_ms": [],
            "rec": {k: [] for k in keys},
        }
    for name in names:  # untimed: state allocation, first selection, the worker's start
        for _ in range(args.warm):
            one_step(runs[name], name, batches, cfg.max_grad_norm, record=False)
        if hasattr(runs[name]["opt"], "synchronize"):
            runs[name]["opt"].synchronize()
    print(f"core split {split.to_dict()}; training thread's intra-op threads {torch.get_num_threads()}")
    for rnd in range(args.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            run = runs[name]
            start = time.perf_counter()
            for _ in range(args.block):
                one_step(run, name, batches, cfg.max_grad_norm, record=True)
            run["block_ms"].append((time.perf_counter() - start) * 1e3 / args.block)
            if hasattr(run["opt"], "synchronize"):
                run["opt"].synchronize()

    print("| optimizer | " + " | ".join(keys) + " | block ms/step by round |")
    print("|---" * (len(keys) + 2) + "|")
    for name in names:
        rec = runs[name]["rec"]
        cells = [
            f"{statistics.median(rec[k]):.0f}" if not k.startswith("faults") else f"{statistics.fmean(rec[k]):.0f}"
            for k in keys
        ]
        print(f"| {name} | " + " | ".join(cells) + " | " + " ".join(f"{v:.0f}" for v in runs[name]["block_ms"]) + " |")
    print("(ms, medians over the timed steps; page faults: mean per step)")
    for name in names:
        print(name, "untimed first steps:", [{k: round(v) for k, v in s.items()} for s in runs[name]["first"]])
    if "zenflow" in runs and "sync_offload" in runs:
        z, s = runs["zenflow"], runs["sync_offload"]
        print(
            "ZenFlow / sync offload: training-thread CPU per step (median) "
            f"{statistics.median(z['rec']['cpu_total']) / statistics.median(s['rec']['cpu_total']):.3f}; "
            "wall per block " + " ".join(f"{a / b:.3f}" for a, b in zip(z["block_ms"], s["block_ms"]))
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({n: {**r["rec"], "block_ms": r["block_ms"], "first": r["first"]} for n, r in runs.items()}, fh)
    for run in runs.values():
        if hasattr(run["opt"], "close"):
            run["opt"].close()


if __name__ == "__main__":
    main()
