"""Memory and speed of `min_offload_numel` settings on `hf-zenflow compare`'s default task, side by side, one process.

Same model, data, core split, layouts and optimizer settings as the compare runner (`CompareConfig()` defaults,
`make_optimizer`, `column_major_` for the offloading runs). One ZenFlow run per `--thresholds` value with free device
memory (compare's default: "auto" sums the windows on the device where memory allows), one per `--limited` value
under `--limit` bytes (`device_memory_limit_bytes`, compare's `--device-memory-limit-bytes`: the run's threshold is
what the limit chooses), and the two references (`adamw_torch`, `sync_offload`). Each trains its own copy; after
`--warm` untimed steps each, the runs take turns in blocks of `--block` steps for `--rounds` rounds (the order
rotates every round), so a busy machine disturbs all of them alike. A block's time includes waiting for ZenFlow's
host worker at its end, so host work that did not overlap the block is charged to it.

Per run: the median whole step (forward, backward, clip, optimizer.step, zero_grad), the training thread's CPU time
per step (`time.thread_time`, the comparable figure on a busy machine), `optimizer.step`'s wall and CPU time, the
host worker's time per step (ZenFlow: the last window's host AdamW over its steps plus the last accumulation; it
overlaps the device's next steps), the block times, the peak device bytes
(`DeviceMemoryMeter`, as compare counts them: weights, gradients, optimizer device state), the run's
`min_offload_numel`, where windows are summed and the share of the parameters offloaded.

Usage: python scripts/bench_min_offload_numel.py [--thresholds 0,65536,262144,1048576] [--limited 262144]
       [--limit 181711888] [--block 4] [--rounds 3] [--warm 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from hf_zenflow.compare.compare_config import CompareConfig
from hf_zenflow.compare.data import prepare_task
from hf_zenflow.compare.training_run import make_optimizer, torch_adamw_state_bytes
from hf_zenflow.engine.device_memory import DeviceMemoryMeter
from hf_zenflow.engine.layout import column_major_


def one_step(run: dict[str, Any], batches: list[Any], max_grad_norm: float, record: bool) -> None:
    model, opt = run["model"], run["opt"]
    batch = batches[run["i"] % len(batches)]
    run["i"] += 1
    c0, t0 = time.thread_time(), time.perf_counter()
    model(**batch.inputs).loss.backward()
    if run["kind"] == "adamw_torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    else:
        opt.clip_grad_norm_(max_grad_norm)
    c1, t1 = time.thread_time(), time.perf_counter()
    opt.step()
    c2, t2 = time.thread_time(), time.perf_counter()
    if run["meter"] is not None:
        run["meter"].finish_step()  # (before zero_grad: the step's gradients and its state, as compare counts)
    opt.zero_grad(set_to_none=True)
    if record:
        run["step_ms"].append((time.perf_counter() - t0) * 1e3)
        run["cpu_ms"].append((time.thread_time() - c0) * 1e3)
        run["opt_ms"].append((t2 - t1) * 1e3)
        run["opt_cpu_ms"].append((c2 - c1) * 1e3)
        if run["kind"] == "zenflow":
            # the host worker's work per step: the last window's host AdamW over its steps, the last accumulation
            stats = opt.stats()
            run["host_ms"].append(stats["host_step_ms"] / max(1.0, stats["update_interval"]) + stats["accumulate_ms"])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--thresholds", default="0,65536,262144,1048576", help="min_offload_numel, free device memory")
    ap.add_argument("--limited", default="262144", help="min_offload_numel under --limit (empty: none)")
    ap.add_argument("--limit", type=int, default=181711888, help="device_memory_limit_bytes (default: sync "
                    "offload's peak on this task, BENCHMARKS.md)")
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=6)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    base = CompareConfig(steps=60, device_memory_limit_bytes="free")  # the unlimited variants: the free memory
    split = base.core_split()
    split.apply_device()  # as `train_one`: D intra-op threads (and the device's allocator model) before any forward
    task = prepare_task(model=base.model, task=base.task, steps=base.steps, train_size=base.train_size, eval_size=50,
                        batch_size=base.batch_size, max_length=base.max_length, seed=base.seed,
                        eval_batch_size=base.eval_batch_size, data=base.data_spec(), metric=base.metric)
    batches = list(task.train_batches)
    variants: list[tuple[str, str, CompareConfig]] = [("adamw_torch", "adamw_torch", base),
                                                      ("sync_offload", "sync_offload", base)]
    for n in filter(None, args.thresholds.split(",")):
        variants.append((f"zenflow min_offload_numel={n}", "zenflow",
                         dataclasses.replace(base, min_offload_numel=int(n))))
    for n in filter(None, args.limited.split(",")):
        variants.append((f"zenflow min_offload_numel={n} limit={args.limit}", "zenflow",
                         dataclasses.replace(base, min_offload_numel=int(n), device_memory_limit_bytes=args.limit)))
    runs: dict[str, dict[str, Any]] = {}
    for label, kind, cfg in variants:
        torch.manual_seed(cfg.seed)
        model = copy.deepcopy(task.base_model)
        if kind != "adamw_torch":
            column_major_(model)
        model.train()
        opt = make_optimizer(kind, model, cfg)
        meter = None if kind == "zenflow" else DeviceMemoryMeter(
            model.parameters(), (lambda o=opt: torch_adamw_state_bytes(o)) if kind == "adamw_torch"
            else (lambda o=opt: int(o.stats()["device_state_bytes"])), watch=True)
        runs[label] = {"kind": kind, "model": model, "opt": opt, "meter": meter, "i": 0, "step_ms": [],
                       "cpu_ms": [], "block_ms": [], "opt_ms": [], "opt_cpu_ms": [], "host_ms": []}
    for run in runs.values():  # untimed: state allocation, first selection, the worker's start
        for _ in range(args.warm):
            one_step(run, batches, base.max_grad_norm, record=False)
        if hasattr(run["opt"], "synchronize"):
            run["opt"].synchronize()
    names = list(runs)
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            run = runs[name]
            start = time.perf_counter()
            for _ in range(args.block):
                one_step(run, batches, base.max_grad_norm, record=True)
            if hasattr(run["opt"], "synchronize"):
                run["opt"].synchronize()  # (timed: host work that did not overlap the block is the block's)
            run["block_ms"].append((time.perf_counter() - start) * 1e3 / args.block)

    params = sum(p.numel() for p in task.base_model.parameters())
    reference = statistics.median(runs["adamw_torch"]["block_ms"])
    sync_peak = runs["sync_offload"]["meter"].peak_bytes
    print(f"core split {split.to_dict()}; {params} parameters; blocks of {args.block} steps x {args.rounds} rounds")
    print("| run | min_offload_numel used | accumulate_on | offloaded | peak device bytes | B/param | x sync peak | "
          "step ms median | thread CPU ms median | optimizer.step ms / CPU ms median | host worker ms/step mean | "
          "block ms/step median | x adamw_torch | block ms/step by round |")
    print("|---" * 14 + "|")
    results = {}
    for name, run in runs.items():
        opt = run["opt"]
        stats = opt.stats() if run["kind"] == "zenflow" else {}
        peak = run["meter"].peak_bytes if run["meter"] is not None else int(stats["peak_device_bytes"])
        block = statistics.median(run["block_ms"])
        row = {"min_offload_numel": stats.get("min_offload_numel"), "accumulate_on": stats.get("accumulate_on"),
               "offloaded_params_fraction": stats.get("offloaded_params_fraction"), "peak_device_bytes": peak,
               "step_ms_median": statistics.median(run["step_ms"]), "cpu_ms_median": statistics.median(run["cpu_ms"]),
               "opt_ms_median": statistics.median(run["opt_ms"]),
               "opt_cpu_ms_median": statistics.median(run["opt_cpu_ms"]),
               "host_ms_mean": statistics.fmean(run["host_ms"]) if run["host_ms"] else None,
               "block_ms": run["block_ms"], "block_ms_median": block}
        results[name] = row
        used = "" if row["min_offload_numel"] is None else f"{row['min_offload_numel']:.0f}"
        offloaded = "" if row["offloaded_params_fraction"] is None else f"{row['offloaded_params_fraction']:.0%}"
        print(f"| {name} | {used} | {row['accumulate_on'] or ''} | {offloaded} | {peak} | {peak / params:.2f} | "
              f"{peak / sync_peak:.2f} | {row['step_ms_median']:.0f} | {row['cpu_ms_median']:.0f} | "
              f"{row['opt_ms_median']:.1f} / {row['opt_cpu_ms_median']:.1f} | "
              + ("" if row["host_ms_mean"] is None else f"{row['host_ms_mean']:.1f}") + f" | {block:.0f} | "
              f"{block / reference:.2f} | " + " ".join(f"{v:.0f}" for v in run["block_ms"]) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    for run in runs.values():
        if run["meter"] is not None:
            run["meter"].remove()
        if hasattr(run["opt"], "close"):
            run["opt"].close()


if __name__ == "__main__":
    main()
