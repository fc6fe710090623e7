"""The critical path with a real forward/backward between steps: SyncOffloadAdamW and ZenFlowAdamW (and torch's
AdamW, no offload) training identical copies of an MLP, side by side in one process.

    python scripts/bench_critical_path.py                      # ~50M parameters, column-major, r=0.1, U=4
    python scripts/bench_critical_path.py --width 1024 --layers 4 --steps 8      # a quick look

Each round runs one training step per optimizer (order rotated every round, so drifts in machine load hit all
alike): forward, backward, `optimizer.step()`, `zero_grad()`, each timed on the training thread. "step" is the time
inside `optimizer.step()` (what the device waits for on a GPU); "backward" includes ZenFlow's gradient hooks, which
read each gradient's norm as backward produces it (on a CPU device that work runs inside backward on the same cores,
so the end-to-end column is the honest total); "step+fwd+bwd" is the whole training step. The ZenFlow host worker
runs in the background with `--worker-threads` threads while the training thread keeps `--threads`.

Prints per optimizer the median and mean of each phase, and ZenFlow / sync offload ratios.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from hf_zenflow import SyncOffloadAdamW, ZenFlowAdamW, column_major_


def mlp(width: int, layers: int, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks[:-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048, help="width of every Linear layer (default 2048)")
    ap.add_argument("--layers", type=int, default=12, help="Linear layers (default 12: ~50M parameters)")
    ap.add_argument("--batch", type=int, default=64, help="rows per batch (default 64)")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per optimizer (default 24)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed rounds first (default 8: two windows)")
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="training thread's torch threads (default 1)")
    ap.add_argument("--worker-threads", type=int, default=1, help="ZenFlow host worker threads (default 1)")
    ap.add_argument("--sync-threads", type=int, default=None,
                    help="SyncOffloadAdamW host threads (default: every core; it runs on the critical path)")
    ap.add_argument("--no-adamw", dest="adamw", action="store_false", help="leave out torch's AdamW")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    base = mlp(args.width, args.layers)
    column_major_(base)  # the offloading runs' layout on a CPU device; AdamW gets the same model (same FLOPs)
    params = sum(p.numel() for p in base.parameters())
    runs: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    if args.adamw:
        model = copy.deepcopy(base)
        runs["adamw_torch"] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    model = copy.deepcopy(base)
    runs["sync_offload"] = (model, SyncOffloadAdamW(model.parameters(), lr=1e-4, cpu_threads=args.sync_threads))
    model = copy.deepcopy(base)
    runs["zenflow"] = (model, ZenFlowAdamW(model.parameters(), lr=1e-4, topk_ratio=args.topk_ratio,
                                           update_interval=args.update_interval, cpu_threads=args.worker_threads,
                                           select_strategy="step", select_interval=1000))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, args.width, generator=gen))
               for _ in range(4)]
    timings: dict[str, dict[str, list[float]]] = {name: {"forward": [], "backward": [], "step": [], "total": []}
                                                  for name in runs}
    names = list(runs)
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.1f}M parameters, batch "
          f"{args.batch}, column-major; training threads {args.threads}, ZenFlow worker threads "
          f"{args.worker_threads}; r={args.topk_ratio}, U={args.update_interval}", flush=True)
    for rnd in range(args.warmup + args.steps):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            model, opt = runs[name]
            x, y = batches[rnd % len(batches)]
            t0 = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            if rnd >= args.warmup:
                for key, value in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2),
                                   ("total", t3 - t0)):
                    timings[name][key].append(value * 1e3)
        if rnd == args.warmup - 1:
            print(f"warm-up done ({args.warmup} rounds); timing {args.steps} rounds", flush=True)
    zen = runs["zenflow"][1]
    zen.flush()
    stats = zen.stats()
    zen.close()

    def med(name: str, key: str) -> float:
        return statistics.median(timings[name][key])

    def mean(name: str, key: str) -> float:
        return statistics.fmean(timings[name][key])

    print()
    print("| optimizer | step ms median | step ms mean | backward ms median | forward ms median | "
          "step+fwd+bwd ms median | step+fwd+bwd ms mean |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        print(f"| {name} | {med(name, 'step'):.1f} | {mean(name, 'step'):.1f} | {med(name, 'backward'):.1f} | "
              f"{med(name, 'forward'):.1f} | {med(name, 'total'):.1f} | {mean(name, 'total'):.1f} |")
    print()
    for key, label in (("step", "critical path (optimizer.step)"), ("backward", "backward"),
                       ("total", "whole training step")):
        print(f"ZenFlow / sync offload, {label}: {med('zenflow', key) / med('sync_offload', key):.3f}x median, "
              f"{mean('zenflow', key) / mean('sync_offload', key):.3f}x mean")
    print(f"ZenFlow windows {int(stats['windows'])}, selected fraction {stats['selected_fraction']:.3f}, last host "
          f"AdamW {stats['host_step_ms']:.1f} ms, last accumulation {stats['accumulate_ms']:.1f} ms (on the worker)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
