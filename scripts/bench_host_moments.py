"""The host AdamW pass of one window per `host_moment_dtype`, side by side in one process: Gparam/s on N cores.

Every variant runs the engine's own pass (`host_adamw_window`) on a matrix whose window sum has landed (a window of
`--interval` steps summed on the device): fp32 moments through the CPU kernel (the default) and through torch's fused
AdamW (no compiler), bf16 moments through the kernel and through torch (in pieces), and 8-bit moments through the
kernel and through the torch pass, and 8-bit moments with a bf16 window sum (``host_sum_dtype="bfloat16"``) through
the kernel, of every column or of the unselected ones only (``host_sum_columns="unselected"``, every tenth column on
the device: r=0.1). Then the per-step add of a gradient into the window sum (an fp32 gradient) into an fp32 sum, a
bf16 one (`kernels.accumulate`) and a bf16 one of the unselected columns (the engine's gathered add).
The variants take turns, `--repeats` rounds, so that a busy machine slows them alike; the median of each is reported
with its ratio to the fp32 kernel pass. Bytes moved per parameter (read + written): fp32 28, bf16 20, int8 ~16.

    python scripts/bench_host_moments.py --numel 16777216 --threads 1 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hf_zenflow.engine.quantized_moments as quantized_moments
from hf_zenflow.engine.host import HostLayout, HostMatrix, host_adamw_window
from hf_zenflow.transport.cpu_device import kernels


VARIANTS = {  # name: (moment dtype, use the CPU kernel, window sum dtype, a sum of the unselected columns)
    "fp32 kernel": (torch.float32, True, torch.float32, False),
    "fp32 torch": (torch.float32, False, torch.float32, False),
    "bf16 kernel": (torch.bfloat16, True, torch.float32, False),
    "bf16 torch": (torch.bfloat16, False, torch.float32, False),
    "int8 kernel": (torch.int8, True, torch.float32, False),
    "int8 torch": (torch.int8, False, torch.float32, False),
    "int8 kernel, bf16 sum": (torch.int8, True, torch.bfloat16, False),
    "int8 kernel, bf16 sum of the unselected columns": (torch.int8, True, torch.bfloat16, True),
}
#: The device columns of the unselected-columns variants: every tenth (r=0.1).
SELECTED_EVERY = 10


def _unselected(cols: int) -> torch.Tensor:
    return torch.tensor([c for c in range(cols) if c % SELECTED_EVERY], dtype=torch.long)


def _use_kernels(on: bool) -> None:
    """Route the host pass through the CPU kernel or torch's operations (the no-compiler path)."""
    kernels._window_adamw_state = True if on else False
    kernels._window_adamw_bf16_state = True if on else False
    quantized_moments._kernel_state = True if on else False


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert (kernels.library() is not None and kernels.window_adamw_available()
            and kernels.window_adamw_bf16_available() and quantized_moments.kernel_matches()), \
        "this benchmark compares the kernel with the torch pass: it needs the CPU kernels"
    cols = 4096
    rows = args.numel // cols
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=gen) * 0.02
    landed = torch.randn(rows, cols, generator=gen) * 1e-3 * args.interval
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    states = {}
    kept = _unselected(cols)
    for name, (dtype, _, sums, unselected) in VARIANTS.items():
        # (a bf16 sum is the host's: summed on the host; an fp32 one lands from the device, the same pass)
        m = HostMatrix.create(weight, torch.float32, accumulate_on="device" if sums == torch.float32 else "host",
                              moments=HostLayout(moments=dtype, sums=sums, unselected_sums=unselected))
        if unselected:
            m.keep_sum_columns(kept, 1)
        states[name] = m
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}  # this thread's CPU time: what a busy machine
    # takes from the wall clock (the other processes' turns) is not in it
    for r in range(args.repeats + 1):  # (round 0 warms up: pages, scratch buffers)
        for name, (_, kernel, _, unselected) in VARIANTS.items():
            m = states[name]
            m.accum.copy_(landed[:, kept] if unselected else landed)  # (the landed sum: the pass reads it)
            m.accum_count = args.interval
            _use_kernels(kernel)
            t0, c0 = time.perf_counter(), time.thread_time()
            host_adamw_window([(hyper, [m])])
            elapsed, used = time.perf_counter() - t0, time.thread_time() - c0
            if r:
                times[name].append(elapsed)
                cpu[name].append(used)
    _use_kernels(True)
    numel = rows * cols
    base = statistics.median(times["fp32 kernel"])
    base_cpu = statistics.median(cpu["fp32 kernel"])
    figures = {}
    print(f"host AdamW pass, {numel / 1e6:.1f} M parameters, {args.threads} thread(s), window {args.interval}, "
          f"median of {args.repeats} interleaved rounds")
    print("| variant | wall ms (median) | Gparam/s | vs fp32 kernel | CPU ms (median) | Gparam/CPU-s | vs fp32 |"
          "\n|---|---|---|---|---|---|---|")
    for name, ts in times.items():
        ms, cpu_ms = statistics.median(ts) * 1e3, statistics.median(cpu[name]) * 1e3
        figures[name] = {"ms": ms, "gparam_per_s": numel / (ms / 1e3) / 1e9, "ratio": base * 1e3 / ms,
                         "cpu_ms": cpu_ms, "gparam_per_cpu_s": numel / (cpu_ms / 1e3) / 1e9,
                         "cpu_ratio": base_cpu * 1e3 / cpu_ms, "all_ms": [t * 1e3 for t in ts]}
        f = figures[name]
        print(f"| {name} | {ms:.1f} | {f['gparam_per_s']:.3f} | {f['ratio']:.2f}x | {cpu_ms:.1f} | "
              f"{f['gparam_per_cpu_s']:.3f} | {f['cpu_ratio']:.2f}x |")
    adds = _accumulate_rounds(weight.shape, args.repeats, gen)
    print(f"\none step's fp32 gradient added into the window sum (kernels.accumulate), median of {args.repeats} "
          "interleaved rounds\n| window sum | wall ms (median) | Gparam/s | vs fp32 sum | CPU ms (median) | vs fp32 |"
          "\n|---|---|---|---|---|---|")
    base, base_cpu = adds["fp32"]
    for name, (ms, cpu_ms) in adds.items():
        print(f"| {name} | {ms:.1f} | {numel / (ms / 1e3) / 1e9:.3f} | {base / ms:.2f}x | {cpu_ms:.1f} | "
              f"{base_cpu / cpu_ms:.2f}x |")
        figures[f"accumulate {name} sum"] = {"ms": ms, "cpu_ms": cpu_ms, "ratio": base / ms}
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"numel": numel, "threads": args.threads, "interval": args.interval, "variants": figures}, f,
                      indent=1)


def _accumulate_rounds(shape: torch.Size, repeats: int, gen: torch.Generator) -> dict[str, tuple[float, float]]:
    """(median wall ms, median CPU ms) of one non-first add into an fp32 and a bf16 window sum, and into a bf16 sum
    of the unselected columns (`HostMatrix.accumulate`: gathered, then the same kernel)."""
    grad = torch.randn(shape, generator=gen) * 1e-3
    host = HostMatrix.create(torch.zeros(shape), torch.float32, accumulate_on="host",
                             moments=HostLayout(sums=torch.bfloat16, unselected_sums=True))
    host.keep_sum_columns(_unselected(shape[1]), 1)
    sums = {"fp32": torch.zeros(shape), "bf16": torch.zeros(shape, dtype=torch.bfloat16),
            "bf16, unselected columns,": host}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sums}
    for r in range(repeats + 1):
        for name, total in sums.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            if isinstance(total, HostMatrix):
                total.accum_count = 1  # (not the window's first step: an add)
                total.accumulate(grad, 0.5)
            else:
                kernels.accumulate([total], [grad], 0.5, first=False)
            if r:
                times[name].append(((time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3))
    return {name: (statistics.median(t for t, _ in ts), statistics.median(c for _, c in ts))
            for name, ts in times.items()}


if __name__ == "__main__":
    main()
