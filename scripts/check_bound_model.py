"""Check the bound model's host side against the real engine on this machine (a developer check, not a benchmark).

`hf-zenflow estimate` models each host pass as the longer of its core work (host AdamWs at the measured per-core
rate; ZenFlow's window pass, accumulation and write-back rounding cost a number of AdamWs that
`host_rates.measure_host_rates` times on one thread over 32M elements) and its memory traffic (bytes over the
measured bandwidth). This script runs the real host code on this machine, one process, side by side:

* synchronous offload: `SyncOffloadAdamW`'s host AdamW per step (``cp_host_update_ms``);
* ZenFlow, window summed on the host: the worker's accumulation job per step (``accumulate_ms``) and its window AdamW
  per window (``host_step_ms``, the rounding into the write-back buffer included);

on a bf16 model of ``--params`` parameters in square matrices, every matrix offloaded, with ``--threads`` host
threads, and prints each measured median beside the model's figure for the same pass on this machine as the host
(`host_rates.measure_host_rates`: its fused AdamW rate on those threads, its passes in AdamWs and its memory
bandwidth), with the ratio. What it checks: that one window's jobs in the engine (the worker, several matrices, the
threads) cost what the per-pass model composes from those measurements.
Exit status 1 when a ratio is outside ``1 +- --tolerance``.

    python scripts/check_bound_model.py --params 16e6 --threads 1 --windows 6

Run it on a quiet machine: the measured times and the measured host rates both move with the machine's load, and
not by the same factor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import torch

from hf_zenflow.estimate.hardware import zenflow_host_passes
from hf_zenflow.estimate.host_rates import host_profile, measure_host_rates
from hf_zenflow.estimate.profiles import HOST_ADAMW_BYTES_PER_PARAM, PROFILES
from hf_zenflow.optimizer import SyncOffloadAdamW, ZenFlowAdamW
from hf_zenflow.settings import ZenFlowConfig


def model(params: float, side: int = 2048, seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """bf16 matrices of `side` x `side` totalling about `params`, and one fixed bf16 gradient each."""
    gen = torch.Generator().manual_seed(seed)
    count = max(1, round(params / side**2))
    weights = [torch.nn.Parameter((torch.randn(side, side, generator=gen) * 0.02).to(torch.bfloat16))
               for _ in range(count)]
    grads = [(torch.randn(side, side, generator=gen) * 1e-3).to(torch.bfloat16) for _ in range(count)]
    return weights, grads


def set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def measure_sync(params: list[torch.nn.Parameter], grads: list[torch.Tensor], threads: int, steps: int) -> float:
    opt = SyncOffloadAdamW(params, lr=1e-5, cpu_threads=threads)
    samples = []
    try:
        for _ in range(steps + 1):
            set_grads(params, grads)
            opt.step()
            samples.append(opt.stats()["cp_host_update_ms"])
    finally:
        opt.close()
    return statistics.median(samples[1:])  # the first step pages the state in


def measure_zenflow(params: list[torch.nn.Parameter], grads: list[torch.Tensor], threads: int, interval: int,
                    windows: int) -> tuple[float, float]:
    """(median accumulation ms per step, median window AdamW ms) of the worker's own job timers."""
    opt = ZenFlowAdamW(params, lr=1e-5, topk_ratio=0.1, update_interval=interval, overlap_step=False,
                       cpu_threads=threads, accumulate_on="host", min_offload_numel=0, select_strategy="step",
                       select_interval=10**6, config=ZenFlowConfig().with_rules(writeback_lag=None))
    accumulate, adamw = [], []
    try:
        for _ in range((windows + 1) * interval):
            set_grads(params, grads)
            opt.step()
            st = opt.stats()
            if st.get("accumulate_ms") and (not accumulate or st["accumulate_ms"] != accumulate[-1]):
                accumulate.append(st["accumulate_ms"])
            if st.get("host_step_ms") and (not adamw or st["host_step_ms"] != adamw[-1]):
                adamw.append(st["host_step_ms"])
        selected = float(opt.stats().get("selected_fraction") or 0.0)
    finally:
        opt.close()
    if len(accumulate) < 2 or len(adamw) < 2:
        raise SystemExit(f"too few host jobs timed ({len(accumulate)} accumulations, {len(adamw)} AdamWs): raise "
                         "--windows")
    print(f"ZenFlow: selected fraction {selected:.3f} (the device share; the host passes cover every element)")
    return statistics.median(accumulate[1:]), statistics.median(adamw[1:])


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=16e6, help="bf16 parameters of the model (default: 16e6)")
    parser.add_argument("--threads", type=int, default=1, help="host threads (default: 1)")
    parser.add_argument("--interval", type=int, default=4, help="ZenFlow's update_interval (default: 4)")
    parser.add_argument("--windows", type=int, default=6, help="ZenFlow windows timed (default: 6)")
    parser.add_argument("--tolerance", type=float, default=0.25, help="allowed |ratio - 1| (default: 0.25)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the training thread's; the host jobs run on their own threads
    rates = measure_host_rates()
    print(rates.describe(args.threads))
    host = host_profile(PROFILES["h100-80gb-pcie5"], rates, host_cores=args.threads)
    host = replace(host, host_mem_gbps=rates.effective_mem_gbps())
    params, grads = model(args.params)
    n = float(sum(p.numel() for p in params))
    print(f"model: {len(params)} bf16 matrices, {n / 1e6:.1f}M parameters; this machine as the host: "
          f"{host.host_cores} thread(s) x {host.host_adamw_per_core / 1e9:.3f} Gparam/s, "
          f"{host.host_mem_gbps:.1f} GB/s")

    def pass_ms(adamws: float, nbytes: float) -> float:
        core = adamws * n / host.host_core_params_per_s() * 1e3
        memory = nbytes * n / (host.host_mem_gbps * 1e9) * 1e3
        return max(core, memory)

    passes = {name: (adamws, nbytes) for name, _, adamws, nbytes in zenflow_host_passes(
        args.interval, False, window_adamws=host.host_window_adamws, accumulate_adamws=host.host_accumulate_adamws,
        rounding_adamws=host.host_rounding_adamws)}
    modelled = {
        "sync offload: host AdamW per step": pass_ms(1.0, HOST_ADAMW_BYTES_PER_PARAM),
        "ZenFlow: accumulation per step": pass_ms(*passes["accumulation"]),
        "ZenFlow: window AdamW + rounding": pass_ms(*passes["window AdamW"]) + pass_ms(*passes["write-back rounding"]),
    }
    sync = measure_sync(params, grads, args.threads, steps=2 * args.windows)
    accumulate, adamw = measure_zenflow(params, grads, args.threads, args.interval, args.windows)
    measured = dict(zip(modelled, (sync, accumulate, adamw)))
    print("\n| host pass | measured ms (median) | modelled ms | measured / modelled |\n|---|---|---|---|")
    worst = 0.0
    for name, value in measured.items():
        ratio = value / modelled[name]
        worst = max(worst, abs(ratio - 1))
        print(f"| {name} | {value:.2f} | {modelled[name]:.2f} | {ratio:.2f} |")
    ok = worst <= args.tolerance
    print(f"\nlargest deviation {worst:.0%}: {'within' if ok else 'OUTSIDE'} the {args.tolerance:.0%} tolerance")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
