#!/usr/bin/env python
"""Counts, per optimizer step, the device work and host syncs of `ZenFlowAdamW` on a CUDA device, on the CPU double
of an asynchronous device (tests/doubles/async_device.py, `CudaTransport`'s own code over it):

- ``launches``: the operators the optimizer runs on the training thread (its backward hooks and `step()`), seen at
  torch's dispatcher, with the CUDA device's paths where the engine has CPU-only ones, plus the copies, event
  records and stream waits the transport enqueues (tests/doubles/launches.py says what counts); ``allocations``
  apart; ``launches_per_matrix``: launches / offloaded matrices;
- ``host_reads``: the training thread's host reads of tensors (``.tolist()``, ``.item()``, ``bool()``,
  ``float()``, ``int()``, ``.cpu()``: each one a device->host sync on CUDA when the tensor lives there; the CPU
  device cannot tell which do, so this is an upper bound);
- ``copies``, ``events``: the transport's copies and events.

Split into the kinds of step: ordinary (no window closes, no re-selection, nothing written back), window close,
write-back, re-selection. The model: `--shape square` (`--matrices` matrices of `--width`), or `--shape llama-7b`
(`--layers` decoder layers of Llama-2-7B's matrices: 4096 x 4096 attention, 4096 x 11008 MLP, two 1-D norms), its
widths divided by `--shrink`.

`--device cuda` counts the same on a CUDA device (`CudaTransport` itself): every operator is a launch there; the
copies are operators too, event records and stream waits are not counted. `--check` holds an ordinary step to
`ORDINARY_PER_MATRIX` launches per offloaded matrix (one more with gradients freed in backward; with bf16 device
sums `BF16_SUM_PER_PIECE` per piece of a sum beyond the first) plus `ORDINARY_FIXED`, and a re-selection to
`RESELECTION_READS_PER_MATRIX` host reads per matrix plus `RESELECTION_READS_FIXED` (exit status 1 when a bound
is exceeded; tests/engine/test_launches.py holds CI to them).

    python scripts/count_device_calls.py --shape llama-7b --layers 1 --dtype bfloat16
    python scripts/count_device_calls.py --matrices 32 --width 64
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig  # noqa: E402
from tests.doubles.launches import CUDA_LIKE, DeviceCalls, counted_hooks, counting_transport  # noqa: E402


READS = ("tolist", "item", "__bool__", "__float__", "__int__", "cpu")
KINDS = ("ordinary", "window close", "write-back", "re-selection")
#: Launches of an ordinary step, per offloaded matrix: with gradients kept until the step, the copy to the host in
#: its hook (a stream wait, the copy, an event record), the gather of the selected columns and their scatter in
#: the step; gradients freed in backward add the hook's norm (`FREED_EXTRA`). The gradient norms, the widening
#: and rounding of narrow gathers and the AdamW are batched ...
ORDINARY_PER_MATRIX = 5
FREED_EXTRA = 1
#: ... and for the whole step (the norms' total, the non-finite check, one batched AdamW per run of matrices).
ORDINARY_FIXED = 32
#: With ``accumulate_on="device_bf16"`` the add into the bf16 window sum takes three launches per piece of it
#: (`host.bf16_sum_piece_elems` on a CUDA device) instead of the copy to the host: on top, per piece beyond each
#: matrix's first.
BF16_SUM_PER_PIECE = 3
#: Host reads of a re-selection: the outgoing columns' state, per matrix; the rest once for all matrices.
RESELECTION_READS_PER_MATRIX = 2
RESELECTION_READS_FIXED = 8


def bounds(matrices: int, free: str, accumulate_on: str = "host", bf16_sum_pieces: int = 0) -> dict[str, int]:
    """The bounds `--check` holds a run of `matrices` offloaded matrices to (`bf16_sum_pieces`: the pieces of all
    their bf16 window sums, with ``accumulate_on="device_bf16"``)."""
    per_matrix = ORDINARY_PER_MATRIX + (FREED_EXTRA if free == "on" else 0)
    pieces = BF16_SUM_PER_PIECE * max(0, bf16_sum_pieces - matrices) if accumulate_on == "device_bf16" else 0
    return {"ordinary_launches": per_matrix * matrices + ORDINARY_FIXED + pieces,
            "reselection_host_reads": RESELECTION_READS_PER_MATRIX * matrices + RESELECTION_READS_FIXED}


def bf16_sum_pieces(model: torch.nn.Module) -> int:
    """The pieces a CUDA device adds the bf16 window sums of `model`'s matrices in (`_accumulate_bf16`)."""
    from hf_zenflow.engine.host import bf16_sum_piece_elems

    per_piece = bf16_sum_piece_elems(torch.device("cuda"))
    pieces = 0
    for p in model.parameters():
        if p.ndim == 2:
            rows = max(1, per_piece // p.shape[1])
            pieces += -(-p.shape[0] // rows)
    return pieces


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Whether `result` (of `count`) keeps the bounds, with the figures compared."""
    limit = bounds(result["matrices"], result["free_gradients_in_backward"], result["accumulate_on"],
                   result["bf16_sum_pieces"])
    steps = result["max_per_step"]
    launches = steps.get("ordinary", {}).get("launches")
    reads = steps.get("re-selection", {}).get("host_reads")
    ok = launches is not None and launches <= limit["ordinary_launches"] and \
        (reads is None or reads <= limit["reselection_host_reads"])
    return {"ok": ok, "ordinary_launches": launches, "reselection_host_reads": reads, "bounds": limit}


class DecoderLayer(torch.nn.Module):
    """A Llama decoder layer's parameters and a forward that gives each of them a gradient (no attention: the count
    is of the optimizer's work, which sees only the matrices' shapes)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False, dtype=dtype)  # noqa: E731
        self.q, self.k, self.v, self.o = (linear(hidden, hidden) for _ in range(4))
        self.gate, self.up, self.down = linear(hidden, intermediate), linear(hidden, intermediate), \
            linear(intermediate, hidden)
        self.norm1 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.norm2 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.norm1
        x = x + self.o(torch.tanh(self.q(h)) * self.k(h) + self.v(h))
        h = x * self.norm2
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, int, int]:
    """(model, input width, offloaded matrices), on `args.device`."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.shape == "square":
        model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False, dtype=dtype)
                                      for _ in range(args.matrices)])
        return model.to(args.device), args.width, args.matrices
    hidden, intermediate = 4096 // args.shrink, 11008 // args.shrink
    model = torch.nn.Sequential(*[DecoderLayer(hidden, intermediate, dtype) for _ in range(args.layers)])
    return model.to(args.device), hidden, 7 * args.layers


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return dict(lr=1e-3, topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8,
                min_offload_numel=0, accumulate_on=args.accumulate_on, free_gradients_in_backward=args.free)


#: The engine rules of the counted runs: a write-back one step into the next window, the configured windows.
RULES = ZenFlowConfig().with_rules(writeback_lag=1, high_lr_rule="off")


def count(args: argparse.Namespace) -> dict[str, Any]:
    """Train `args.steps` steps, counting each (the module docstring); the rows and the most per kind of step."""
    calls = DeviceCalls()
    import hf_zenflow.transport as transport_package

    backends: list = []
    double = args.device == "cpu"
    real_transport_for = transport_package.transport_for
    if double:
        transport_package.transport_for = counting_transport(calls, backends)
    model, width, matrices = build_model(args)
    dtype = getattr(torch, args.dtype)
    caller = threading.current_thread()
    reads: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str):
        real = originals[name]

        def read(self, *a, **k):
            if threading.current_thread() is caller:
                reads[name] += 1
            return real(self, *a, **k)
        return read

    rows = []
    try:
        with CUDA_LIKE() if double else contextlib.nullcontext(), counted_hooks(calls):
            opt = ZenFlowAdamW(model.parameters(), config=RULES, **settings(args))
            for step in range(args.steps):
                x = torch.randn(args.tokens, width, dtype=dtype, device=args.device)
                before = opt.stats()
                launches, allocations, ops = calls.snapshot()
                copies, events = sum(b.copies for b in backends), sum(b.events for b in backends)
                reads.clear()
                for name in READS:
                    setattr(torch.Tensor, name, counted(name))
                try:
                    # (the backward too: its hooks read the gradients and start their copies to the host)
                    model(x).float().square().mean().backward()
                    with calls.active():
                        opt.step()
                finally:
                    for name, real in originals.items():
                        setattr(torch.Tensor, name, real)
                opt.zero_grad()
                after = opt.stats()
                kind = ("warm-up" if step < 1 else "re-selection" if after["reselections"] != before["reselections"]
                        else "window close" if after["windows"] != before["windows"]
                        else "write-back" if after["bytes_to_device"] > 0 else "ordinary")
                rows.append({"step": step, "kind": kind, "launches": calls.launches - launches,
                             "allocations": calls.allocations - allocations,
                             "ops": dict(calls.by_op - ops),
                             "host_reads": sum(reads.values()), "reads": dict(reads),
                             "copies": sum(b.copies for b in backends) - copies,
                             "events": sum(b.events for b in backends) - events})
            accumulate_on = opt.stats().get("accumulate_on", args.accumulate_on)
            opt.close()
    finally:
        transport_package.transport_for = real_transport_for
    for backend in backends:
        backend.check()
    summary = {}
    for kind in KINDS:
        picked = [r for r in rows if r["kind"] == kind]
        if picked:
            summary[kind] = {key: max(r[key] for r in picked)
                             for key in ("launches", "allocations", "host_reads", "copies", "events")}
            summary[kind]["launches_per_matrix"] = round(summary[kind]["launches"] / matrices, 2)
            summary[kind]["steps"] = len(picked)
    return {"shape": args.shape, "device": args.device, "matrices": matrices, "dtype": args.dtype,
            "accumulate_on": accumulate_on, "free_gradients_in_backward": args.free,
            "bf16_sum_pieces": bf16_sum_pieces(model), "max_per_step": summary, "rows": rows}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="square", choices=("square", "llama-7b"))
    p.add_argument("--matrices", type=int, default=32, help="--shape square: the number of matrices")
    p.add_argument("--width", type=int, default=64, help="--shape square: their width")
    p.add_argument("--layers", type=int, default=1, help="--shape llama-7b: decoder layers")
    p.add_argument("--shrink", type=int, default=1, help="--shape llama-7b: divide the widths by this")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--accumulate-on", default="host", choices=("host", "device", "device_bf16"))
    p.add_argument("--free", default="off", choices=("on", "off"), help="free_gradients_in_backward")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: the asynchronous double with CUDA's dispatch; cuda: a CUDA device itself")
    p.add_argument("--check", action="store_true", help="exit 1 when a bound of the module docstring is exceeded")
    p.add_argument("--out", default=None, help="also write the result (JSON) to this file")
    p.add_argument("--verbose", action="store_true", help="every step's counts, by operator")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = count(args)
    rows = result.pop("rows")
    if args.check:
        result["check"] = verdict(result)
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "rows": rows}, indent=1))
    if args.verbose:
        for row in rows:
            print(json.dumps(row))
    return 0 if not args.check or result["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
