"""The host AdamW pass with stochastically rounded moments against a git ref's pass (rounded to nearest), side by side
in one process on one core: bf16 and 8-bit moments, through the CPU kernel and through the torch pass (no
compiler), with fp32 moments (no rounding: the same code in both) as the control.

The ref's `kernels.py` and `csrc/zenflow_cpu.c` are read with ``git show`` and built beside this tree's (each
compiles its own library, keyed by its source); its torch passes are its own `_adamw_narrow_moments` (engine/host.py)
and `quantized_moments.adamw_pass`. Every round runs each pair in alternating order on the same state sizes (a
window's landed sum of `--interval` steps), so that a busy machine slows both alike; each round gives a ratio per
pair (new Gparam/s over the ref's, wall and this thread's CPU time), reported as the median with the range.

    python scripts/bench_host_rounding.py --ref main --numel 8388608 --rounds 15
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hf_zenflow.engine.quantized_moments as quantized_moments
from hf_zenflow.engine import host as host_module
from hf_zenflow.engine.host import HostLayout, HostMatrix
from hf_zenflow.transport.cpu_device import kernels
from hf_zenflow.transport.cpu_device.rounding import RandomStream, matrix_key


def _ref_module(ref: str, path: str, name: str, into: Path) -> object:
    """`path` (a module of the package) as it is at `ref`, loaded as `name` beside this tree's modules (its relative
    imports resolve in this tree's package)."""
    target = into / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(subprocess.run(["git", "show", f"{ref}:{path}"], check=True, capture_output=True).stdout)
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--ref", default="main", help="the git ref whose pass is the baseline")
    parser.add_argument("--numel", type=int, default=1 << 23)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--kernels-only", action="store_true", help="leave out the torch passes (no compiler)")
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    into = Path(tempfile.mkdtemp(prefix="hf_zenflow_ref_"))
    (into / "hf_zenflow/transport/cpu_device/csrc").mkdir(parents=True)
    (into / "hf_zenflow/transport/cpu_device/csrc/zenflow_cpu.c").write_bytes(subprocess.run(
        ["git", "show", f"{args.ref}:hf_zenflow/transport/cpu_device/csrc/zenflow_cpu.c"], check=True,
        capture_output=True).stdout)
    old_kernels = _ref_module(args.ref, "hf_zenflow/transport/cpu_device/kernels.py",
                              "hf_zenflow.transport.cpu_device._ref_kernels", into)
    old_host = _ref_module(args.ref, "hf_zenflow/engine/host.py", "hf_zenflow.engine._ref_host", into)
    old_quantized = _ref_module(args.ref, "hf_zenflow/engine/quantized_moments.py",
                                "hf_zenflow.engine._ref_quantized_moments", into)
    assert old_kernels.library() is not None and kernels.library() is not None, "needs the CPU kernels"

    cols = 4096
    rows = args.numel // cols
    numel = rows * cols
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=gen) * 0.02
    landed = torch.randn(rows, cols, generator=gen) * 1e-3 * args.interval
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    stream = RandomStream(matrix_key(0, 0))

    def state(moments: torch.dtype) -> HostMatrix:
        m = HostMatrix.create(weight, torch.float32, accumulate_on="device", moments=HostLayout(moments=moments),
                              stream=stream)
        m.exp_avg.copy_(landed * 0.1)
        m.exp_avg_sq.copy_(landed.square() * 1e-3)
        return m

    def kernel_pass(module: object, new: bool) -> object:
        def run(m: HostMatrix) -> None:
            common = ([m.master], [m.accum], [None], [False], [args.interval])
            extra = {"streams": [m.stream]} if new else {}
            if m.quantized:
                module.window_adamw_quantized(*common, [m.exp_avg.codes], [m.exp_avg.scales], [m.exp_avg_sq.codes],
                                              [m.exp_avg_sq.scales], [m.step], hyper, None, **extra)
            elif m.exp_avg.dtype == torch.bfloat16:
                module.window_adamw_bf16(*common, [m.exp_avg], [m.exp_avg_sq], [m.step], hyper, None, **extra)
            else:
                module.window_adamw(*common, [m.exp_avg], [m.exp_avg_sq], [m.step], hyper, None)
        return run

    def torch_pass(new: bool) -> object:
        def run(m: HostMatrix) -> None:
            m.accum.div_(args.interval)  # (the plain pass's mean, in place, as `_plain_adamw`)
            if m.quantized:
                if new:
                    quantized_moments.adamw_pass(m.master, m.accum, m.exp_avg, m.exp_avg_sq, m.step, hyper,
                                                 m.stream)
                else:
                    old_quantized.adamw_pass(m.master, m.accum, m.exp_avg, m.exp_avg_sq, m.step, hyper)
            else:
                (host_module if new else old_host)._adamw_narrow_moments(m, hyper)
        return run

    pairs = {  # name: (moments, (ref's pass, this tree's pass))
        "fp32 moments, kernel (control)": (torch.float32, (kernel_pass(old_kernels, False),
                                                           kernel_pass(kernels, True))),
        "bf16 moments, kernel": (torch.bfloat16, (kernel_pass(old_kernels, False), kernel_pass(kernels, True))),
        "int8 moments, kernel": (torch.int8, (kernel_pass(old_kernels, False), kernel_pass(kernels, True))),
        "bf16 moments, torch pass": (torch.bfloat16, (torch_pass(False), torch_pass(True))),
        "int8 moments, torch pass": (torch.int8, (torch_pass(False), torch_pass(True))),
    }
    if args.kernels_only:
        pairs = {name: pair for name, pair in pairs.items() if "kernel" in name}
    states = {name: (state(moments), state(moments)) for name, (moments, _) in pairs.items()}
    samples: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in pairs}
    with torch.no_grad():
        for r in range(args.rounds + 1):  # (round 0 warms up: pages, scratch buffers, the builds)
            for name, (_, runs) in pairs.items():
                timed = [0.0, 0.0, 0.0, 0.0]  # ref wall, ref CPU, new wall, new CPU
                order = (0, 1) if r % 2 else (1, 0)
                for which in order:
                    m = states[name][which]
                    m.accum.copy_(landed)
                    m.accum_count = args.interval
                    t0, c0 = time.perf_counter(), time.thread_time()
                    runs[which](m)
                    timed[2 * which], timed[2 * which + 1] = time.perf_counter() - t0, time.thread_time() - c0
                if r:
                    samples[name].append(tuple(timed))
    figures = {}
    print(f"host AdamW pass, {numel / 1e6:.1f} M parameters, 1 thread, window {args.interval}: {args.ref} (rounded to "
          f"nearest) and this tree (stochastic rounding), {args.rounds} interleaved rounds\n"
          "| pass | ref Gparam/s | new Gparam/s | new / ref, wall: median (min-max) | new / ref, CPU time: median "
          "(min-max) |\n|---|---|---|---|---|")
    for name, rounds in samples.items():
        wall = [ref / new for ref, _, new, _ in rounds]
        cpu = [ref / new for _, ref, _, new in rounds]
        ref_rate = numel / statistics.median(t for t, _, _, _ in rounds) / 1e9
        new_rate = numel / statistics.median(t for _, _, t, _ in rounds) / 1e9
        figures[name] = {"ref_gparam_per_s": ref_rate, "new_gparam_per_s": new_rate, "wall_ratios": wall,
                         "cpu_ratios": cpu}
        print(f"| {name} | {ref_rate:.3f} | {new_rate:.3f} | {statistics.median(wall):.3f} ({min(wall):.3f}-"
              f"{max(wall):.3f}) | {statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"ref": args.ref, "numel": numel, "interval": args.interval, "figures": figures}, f, indent=1)


if __name__ == "__main__":
    main()
