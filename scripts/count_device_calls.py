#!/usr/bin/env python
"""Counts, per optimizer step, the calls that cost a CUDA device launch or a host sync, on `CudaTransport`'s own
code over the CPU double of an asynchronous device (tests/doubles/async_device.py): copies and events the transport
enqueues, and the training thread's host reads of tensors (``.tolist()``, ``.item()``, ``bool()``, ``float()``,
``int()``, ``.cpu()``: each one a device->host sync on CUDA when the tensor lives there; the CPU device cannot tell
which do, so this is an upper bound). Split into ordinary steps and re-selection steps, for `--matrices` square
matrices of `--width`.

    python scripts/count_device_calls.py --matrices 32 --width 64
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_zenflow import ZenFlowAdamW  # noqa: E402
from tests.doubles.async_device import AsyncCopies, CheckedRegistrar  # noqa: E402


READS = ("tolist", "item", "__bool__", "__float__", "__int__", "cpu")


class Counting(AsyncCopies):
    def __init__(self) -> None:
        super().__init__(seed=0, max_delay_s=0.0005)
        self.events = 0

    def event(self):
        self.events += 1
        return super().event()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--matrices", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--accumulate-on", default="host", choices=("host", "device"))
    p.add_argument("--verbose", action="store_true", help="every step's counts")
    args = p.parse_args(argv)
    import hf_zenflow.transport as transport_package
    from hf_zenflow.transport import CudaTransport

    backends: list[Counting] = []

    def make(device: torch.device) -> CudaTransport:
        backends.append(Counting())
        return CudaTransport(streams=backends[-1], registrar=CheckedRegistrar(backends[-1]))

    transport_package.transport_for = make
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.matrices)])
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1, update_interval=4, select_strategy="step",
                       select_interval=8, min_offload_numel=0, accumulate_on=args.accumulate_on, writeback_lag=1,
                       high_lr_rule="off")
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
    for step in range(args.steps):
        x = torch.randn(4, args.width)
        before = opt.stats()
        copies, events = sum(b.copies for b in backends), sum(b.events for b in backends)
        reads.clear()
        for name in READS:
            setattr(torch.Tensor, name, counted(name))
        try:
            # (the backward too: its hooks start the gradients' copies to the host)
            model(x).square().mean().backward()
            opt.step()
        finally:
            for name, real in originals.items():
                setattr(torch.Tensor, name, real)
        opt.zero_grad()
        after = opt.stats()
        kind = ("warm-up" if step < 1 else "re-selection" if after["reselections"] != before["reselections"]
                else "window close" if after["windows"] != before["windows"] else "ordinary")
        rows.append({"step": step, "kind": kind, "wrote_back": after["bytes_to_device"] > 0,
                     "host_reads": sum(reads.values()), "reads": dict(reads),
                     "copies": sum(b.copies for b in backends) - copies,
                     "events": sum(b.events for b in backends) - events})
    opt.close()
    summary = {}
    for kind in ("ordinary", "window close", "re-selection", "write-back"):
        picked = [r for r in rows if (r["wrote_back"] if kind == "write-back" else r["kind"] == kind)]
        if picked:
            summary[kind] = {key: max(r[key] for r in picked) for key in ("host_reads", "copies", "events")}
            summary[kind]["steps"] = len(picked)
    print(json.dumps({"matrices": args.matrices, "width": args.width, "accumulate_on": args.accumulate_on,
                      "max_per_step": summary}))
    if args.verbose:
        for row in rows:
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
