"""Host milliseconds per window, the window's last step folded into the host AdamW pass or not, side by side.

One process, the two schedules alternating window by window on the same state sizes:

* ``two passes``: every step of the window adds its gradient into the fp32 accumulator (the worker's accumulate
  job), then the close divides by the window's length and runs torch's fused AdamW (the schedule before the fold);
* ``one pass``: the first U-1 steps add as before; the last step's gradient goes into the close, which sums, divides
  and updates in one pass over the state (`kernels.window_adamw`).

Prints the median host ms of the close and of the whole window (U accumulations + close) for each, and the ratio.

    python scripts/bench_window_pass.py --numel 16777216 --interval 4 --grad-dtype bf16 --windows 9 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_zenflow.engine import host as host_module
from hf_zenflow.engine.host import HostMatrix, host_adamw_window
from hf_zenflow.transport.cpu_device import kernels


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--grad-dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--windows", type=int, default=9, help="windows per schedule (alternating)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.window_adamw_available():
        raise SystemExit(f"the one-pass kernel is not available here ({kernels.status()})")
    dtype = torch.bfloat16 if args.grad_dtype == "bf16" else torch.float32
    rows = 4096
    param = torch.randn(rows, args.numel // rows)
    grads = [torch.randn_like(param).to(dtype) for _ in range(args.interval)]
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    states = {name: HostMatrix.create(param, dtype) for name in ("two passes", "one pass")}
    close_ms: dict[str, list[float]] = {name: [] for name in states}
    window_ms: dict[str, list[float]] = {name: [] for name in states}
    available = kernels.window_adamw_available
    for window in range(args.windows + 1):  # the first round warms up (page faults, caches)
        for name, m in states.items():
            start = time.perf_counter()
            for g in grads[:-1]:
                HostMatrix.accumulate_all([(m, g)], 0.5)
            before_close = time.perf_counter()
            if name == "two passes":
                HostMatrix.accumulate_all([(m, grads[-1])], 0.5)
                host_module.kernels.window_adamw_available = lambda: False  # torch's div_ + fused AdamW
                try:
                    host_adamw_window([(hyper, [m])])
                finally:
                    host_module.kernels.window_adamw_available = available
            else:
                host_adamw_window([(hyper, [m])], [(m, grads[-1])], 0.5)
            end = time.perf_counter()
            if window:
                close_ms[name].append((end - before_close) * 1e3)
                window_ms[name].append((end - start) * 1e3)
    print(f"numel {args.numel}, U={args.interval}, grad {args.grad_dtype}, {args.threads} thread(s), "
          f"{args.windows} windows each (alternating), medians:")
    print("| schedule | close (last step + AdamW) ms | whole window ms |")
    print("|---|---|---|")
    for name in states:
        print(f"| {name} | {statistics.median(close_ms[name]):.1f} | {statistics.median(window_ms[name]):.1f} |")
    ratio_close = statistics.median(close_ms["one pass"]) / statistics.median(close_ms["two passes"])
    ratio_window = statistics.median(window_ms["one pass"]) / statistics.median(window_ms["two passes"])
    print(f"| one pass / two passes | {ratio_close:.2f} | {ratio_window:.2f} |")


if __name__ == "__main__":
    main()
