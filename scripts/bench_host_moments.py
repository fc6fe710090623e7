"""The host AdamW pass of one window per `host_moment_dtype`, side by side in one process: Gparam/s on N cores.

Every variant runs the engine's own pass (`host_adamw_window`) on a matrix whose window sum has landed (a window of
`--interval` steps summed on the device): fp32 moments through the CPU kernel (the default) and through torch's fused
AdamW (no compiler), bf16 moments through the kernel and through torch (in pieces), and 8-bit moments through the
kernel and through the torch pass.
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
from hf_zenflow.engine.host import HostMatrix, host_adamw_window
from hf_zenflow.transport.cpu_device import kernels


VARIANTS = {  # name: (moment dtype, use the CPU kernel)
    "fp32 kernel": (torch.float32, True),
    "fp32 torch": (torch.float32, False),
    "bf16 kernel": (torch.bfloat16, True),
    "bf16 torch": (torch.bfloat16, False),
    "int8 kernel": (torch.int8, True),
    "int8 torch": (torch.int8, False),
}


def _use_kernels(on: bool) -> None:
    """Route the host pass through the CPU kernel or torch's operations (the no-compiler path)."""
    kernels._window_adamw_state = True if on else False
    kernels._window_adamw_bf16_state = True if on else False
    quantized_moments._kernel_state = True if on else False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    for name, (dtype, _) in VARIANTS.items():
        m = HostMatrix.create(weight, torch.float32, accumulate_on="device", moments=dtype)
        states[name] = m
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}  # this thread's CPU time: what a busy machine
    # takes from the wall clock (the other processes' turns) is not in it
    for r in range(args.repeats + 1):  # (round 0 warms up: pages, scratch buffers)
        for name, (_, kernel) in VARIANTS.items():
            m = states[name]
            m.accum.copy_(landed)  # (the landed sum: the pass reads it)
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
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"numel": numel, "threads": args.threads, "interval": args.interval, "variants": figures}, f,
                      indent=1)


if __name__ == "__main__":
    main()
