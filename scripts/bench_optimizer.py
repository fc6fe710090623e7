"""Optimizer-step benchmark: the caller's time per `step()` for AdamW (no offload), SyncOffloadAdamW and ZenFlowAdamW,
measured side by side in one process on a ~100M-parameter transformer-shaped set of tensors.

    python scripts/bench_optimizer.py                      # defaults: 100M params, r=0.1, U=4, overlap
    python scripts/bench_optimizer.py --params 20e6 --steps 12 --compute-ms 50

What is measured: only `optimizer.step()` wall time on the training thread (the critical path the device waits for).
Between steps the script sleeps `--compute-ms` to stand for the device's forward/backward: like a GPU kernel, the
sleep occupies no host core, so the ZenFlow host worker can run then. After each ZenFlow step the script (untimed)
lets the worker finish, as a device compute phase long enough to hide it would, so that the worker never competes
with a timed step of any optimizer on this 2-core machine; the worker's own time per step is printed, which is the
device compute a real run needs to hide it (`--no-drain` keeps the worker running into the next steps instead).
Gradients are pre-generated random tensors
(two sets, alternated); the optimizers are stepped round-robin, rotating the order every round, so drifts in machine
load hit all of them alike. The device is this machine's CPU, so "device" updates and "host" updates share the same
memory system: the strided gather/scatter of the selected columns is real work here, and nothing is copied over a
link. Prints medians and the ratio ZenFlow / sync offload, with the breakdown of ZenFlow's critical path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hf_zenflow import SyncOffloadAdamW, ZenFlowAdamW


def transformer_shapes(params: float) -> list[tuple[int, ...]]:
    """Llama-like layer shapes (q,k,v,o, gate, up, down + two norms) for roughly `params` elements."""
    width = 1024
    per_layer = 4 * width * width + 3 * width * (8 * width // 3) + 2 * width
    layers = max(1, round(params / per_layer))
    shapes: list[tuple[int, ...]] = []
    hidden = 8 * width // 3
    for _ in range(layers):
        shapes += [(width, width)] * 4 + [(hidden, width), (hidden, width), (width, hidden), (width,), (width,)]
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="approximate parameter count (default 1e8)")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per optimizer (default 16)")
    ap.add_argument("--warmup", type=int, default=8,
                    help="untimed steps first (default 8: two windows, so first-touch page faults of the host "
                         "buffers stay out of the timed steps)")
    ap.add_argument("--compute-ms", type=float, default=100.0,
                    help="emulated device forward/backward between steps, a sleep (default 100)")
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None,
                    help="training thread's torch threads, set explicitly (default: what torch and hf_zenflow's "
                         "thread rule give, docs/threads.md: lowered when an offloading ZenFlow is built)")
    ap.add_argument("--worker-threads", type=int, default=None,
                    help="ZenFlow host worker threads (default: half the cores)")
    ap.add_argument("--layout", choices=("column", "row"), default="column",
                    help="weight layout of every optimizer's parameters (default column: `column_major_`, "
                         "DeepSpeed's transposed layout, which makes each input column contiguous on a CPU device)")
    ap.add_argument("--no-drain", dest="drain", action="store_false",
                    help="do not wait (untimed) for the ZenFlow worker after each step")
    ap.add_argument("--floor", action="store_true",
                    help="also time the memory passes any column-split step must make on a CPU device with row-major "
                         "weights (one read of every gradient, AdamW on the selected columns, writing them into the "
                         "weights) with the same kernels, and print their sum against sync offload")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # an explicit choice: the thread rule leaves it alone

    shapes = transformer_shapes(args.params)
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"# {n / 1e6:.1f}M parameters in {len(shapes)} tensors, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; emulated device compute {args.compute_ms:.0f} ms/step; "
          f"{args.layout}-major weights", flush=True)
    g = torch.Generator().manual_seed(0)
    grad_sets = [[torch.randn(s, generator=g) * 1e-3 for s in shapes] for _ in range(2)]

    def laid_out(t: torch.Tensor) -> torch.Tensor:
        """`t` in the chosen layout (what `column_major_` does to a Linear weight; autograd's gradients follow)."""
        return t.t().contiguous().t() if args.layout == "column" and t.ndim == 2 else t

    row_grad_sets, grad_sets = grad_sets, [[laid_out(g) for g in grads] for grads in grad_sets]

    def make_params(layout: str = args.layout) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(laid_out(torch.randn(s, generator=gen) * 0.02) if layout == args.layout
                                   else torch.randn(s, generator=gen) * 0.02) for s in shapes]

    runs = {
        # the no-offload reference keeps row-major weights: torch's fused AdamW is ~4x slower on strided tensors
        "adamw_fused": (ps := make_params("row"), torch.optim.AdamW(ps, lr=1e-4, fused=True)),
        "sync_offload": (ps := make_params(), SyncOffloadAdamW(ps, lr=1e-4)),
        "zenflow": (ps := make_params(), ZenFlowAdamW(
            ps, lr=1e-4, topk_ratio=args.topk_ratio, update_interval=args.update_interval, overlap_step=True,
            cpu_threads=args.worker_threads, select_strategy="step", select_interval=10_000)),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    phases: dict[str, list[float]] = {}
    order = list(runs)
    total = args.warmup + args.steps
    for step in range(total):
        order = order[1:] + order[:1]
        for name in order:
            params, opt = runs[name]
            for p, grad in zip(params, (row_grad_sets if name == "adamw_fused" else grad_sets)[step % 2]):
                p.grad = grad
            time.sleep(args.compute_ms / 1e3)
            t0 = time.perf_counter()
            opt.step()
            dt = (time.perf_counter() - t0) * 1e3
            for p in params:
                p.grad = None
            if name == "zenflow" and args.drain:
                opt.synchronize()  # untimed: the host work hidden behind device compute
            if step >= args.warmup:
                times[name].append(dt)
                if name == "zenflow":
                    for key, value in opt.stats().items():
                        if key.startswith("cp_") or key in ("host_step_ms", "accumulate_ms"):
                            phases.setdefault(key, []).append(value)
        print(f"  step {step + 1}/{total}: " + ", ".join(f"{k} {times[k][-1]:.1f} ms" if times[k] else k
                                                          for k in runs), flush=True)
    runs["zenflow"][1].close()

    med = {k: statistics.median(v) for k, v in times.items()}
    print("\n| optimizer | median step() ms | mean ms | min ms | max ms | vs sync offload |")
    print("|---|---|---|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {med[k]:.1f} | {statistics.mean(v):.1f} | {min(v):.1f} | {max(v):.1f} | "
              f"{med[k] / med['sync_offload']:.3f} |")
    print(f"\nZenFlow / sync offload (median caller time per step): {med['zenflow'] / med['sync_offload']:.3f}")
    host = statistics.mean(phases["accumulate_ms"]) + statistics.mean(phases["host_step_ms"]) / args.update_interval
    print(f"\nZenFlow host worker time per step (accumulate + host AdamW / U), to hide behind device compute: "
          f"{host:.1f} ms")
    if args.floor:
        print_floor(shapes, row_grad_sets[0], args, med["sync_offload"])
    print("\nZenFlow critical path, mean ms per step (host work is off the critical path):")
    print("| phase | mean ms |")
    print("|---|---|")
    for key, values in phases.items():
        print(f"| {key} | {statistics.mean(values):.2f} |")
    return 0


def print_floor(shapes: list[tuple[int, ...]], grads: list[torch.Tensor], args: argparse.Namespace,
                sync_ms: float) -> None:
    """Median time of each unavoidable pass, measured here, and their sum as a fraction of sync offload's step."""
    from hf_zenflow._base import fused_adamw_
    from hf_zenflow.engine.selection import num_selected
    from hf_zenflow.transport.cpu_device import kernels as _native

    if _native.library() is None:
        print(f"\n(floor not measured: CPU kernels {_native.status()})")
        return
    gen = torch.Generator().manual_seed(2)
    mats = [(g, s) for g, s in zip(grads, shapes) if len(s) == 2]
    index = [torch.randperm(s[1], generator=gen)[: num_selected(args.topk_ratio, s[1])].sort().values for _, s in mats]
    params = [torch.randn(s, generator=gen) for _, s in mats]
    cols = [torch.randn(s[0], i.numel(), generator=gen) for (_, s), i in zip(mats, index)]
    state = [[torch.zeros_like(c) for c in cols] for _ in range(3)]
    steps = [torch.zeros(()) for _ in cols]
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    passes = {
        "read every gradient once (sum of squares)": lambda: _native.norms_and_gather(grads, [None] * len(grads),
                                                                                     [None] * len(grads)),
        "AdamW on the selected columns (contiguous [out, k])": lambda: fused_adamw_(
            state[0], cols, state[1], state[2], steps, hyper),
        "write the selected columns into the weights (every step: the write-back swaps in the worker's buffer, "
        "then writes them)": lambda: _native.scatter(params, cols, index),
    }
    print("\nFloor on this CPU device with row-major weights: the passes a column-split step cannot avoid, timed "
          "alone (median of 7):")
    print("| pass | ms |")
    print("|---|---|")
    total = 0.0
    for name, fn in passes.items():
        fn()
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(samples)
        total += ms
        print(f"| {name} | {ms:.1f} |")
    print(f"| **sum** | **{total:.1f}** |")
    print(f"\nFloor / sync offload (median step): {total / sync_ms:.3f}")


if __name__ == "__main__":
    sys.exit(main())
