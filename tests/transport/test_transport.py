"""The transports (`hf_zenflow.transport`): the copying schedule that CUDA uses gives the same bits as the CPU
device's references and swaps, and the pinned arena carves aligned buffers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_zenflow.transport as transport_package
from hf_zenflow.transport import ARENA_ALIGN, CopyTransport, PinnedArena
from hf_zenflow.transport.cpu_device.transport import CpuDeviceTransport
from hf_zenflow.transport.pinned import page_size
from tests.conftest import DEVICE, batches, linear_schedule, make_model, param_groups, train, zenflow_adamw


LR = 1e-2

if DEVICE.type != "cpu":
    pytest.skip("these tests swap the CPU device's transport", allow_module_level=True)


def run(transport_cls, steps, settings, make=make_model):
    """Train with every parameter's transport replaced by `transport_cls`."""
    original = transport_package.transport_for
    transport_package.transport_for = lambda device: transport_cls()
    try:
        model = make()
        opt = zenflow_adamw(param_groups(model), lr=LR, min_offload_numel=0, **settings)
        losses = steps(model, opt)
        transports = opt.host_windows.transports
        assert transports and all(isinstance(t, transport_cls) for t in transports.values())
        opt.flush()
        stats = opt.stats()
        opt.close()
    finally:
        transport_package.transport_for = original
    return model, losses, stats


@pytest.mark.parametrize("settings", [
    dict(topk_ratio=0.1, update_interval=4),
    dict(topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=7),
    dict(topk_ratio=0.1, update_interval="auto", select_strategy="step", select_interval=10),
    dict(topk_ratio=0.1, update_interval=2, full_warm_up_rounds=5, overlap_step=False),
    dict(topk_ratio=0.1, update_interval=4, accumulate_on="device"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copying_transport_gives_the_cpu_device_bits(settings, dtype):
    def steps(model, opt):
        return train(model, opt, batches(26), linear_schedule(opt, 26), clip=1.0)

    def make():
        return make_model(dtype=dtype)

    cpu_model, cpu_losses, cpu_stats = run(CpuDeviceTransport, steps, settings, make)
    copy_model, copy_losses, copy_stats = run(CopyTransport, steps, settings, make)
    assert copy_losses == cpu_losses
    for p, q in zip(copy_model.parameters(), cpu_model.parameters()):
        assert torch.equal(p, q)
    assert copy_stats["windows"] == cpu_stats["windows"] > 0


def test_only_fresh_host_results_cross_the_link_at_the_write_back():
    """Regression (issue 10.9): the CUDA write-back copied every matrix's buffer to the device at every write-back,
    fresh or not (and both branches counted them in `bytes_to_device`); the CPU branch alone checked
    `writeback_fresh`. One logic now: a matrix whose host step did not run since the last write-back (no gradient
    in the window) is not written, and the copying transport (CUDA's logic, run on the CPU) leaves it exactly as the
    CPU device's swap does."""
    moved: list[list[float]] = []

    def steps(model, opt):
        a, b = model
        seen = []
        for t in range(14):
            g = torch.zeros(8, 32)
            g[:, (t // 4) * 3] = 1.0  # the hot column moves at every re-selection (steps 0, 4, 8, 12)
            g[:, 20:] = 0.05
            a.grad = g.clone()
            b.grad = g.clone() if t < 8 else None  # b's last gradient: window 6-7, written back at step 8
            opt.step()
            opt.zero_grad()
            seen.append(opt.stats()["bytes_to_device"])
        moved.append(seen)
        return []

    def make():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(8, 32)), torch.nn.Parameter(torch.randn(8, 32))]

    def groups(params):
        return [{"params": params}]

    settings = dict(topk_ratio=0.1, update_interval=2, select_strategy="step", select_interval=4, writeback_lag=None)
    results = []
    for transport_cls in (CpuDeviceTransport, CopyTransport):
        original = transport_package.transport_for
        transport_package.transport_for = lambda device, cls=transport_cls: cls()
        try:
            params = make()
            opt = zenflow_adamw(groups(params), lr=LR, min_offload_numel=0, **settings)
            steps(params, opt)
            before_flush = [p.detach().clone() for p in params]
            opt.flush()
            results.append((before_flush, [p.detach().clone() for p in params], opt.master_weight(params[1])))
            opt.close()
        finally:
            transport_package.transport_for = original
    (cpu_before, cpu_after, cpu_master), (copy_before, copy_after, copy_master) = results
    for p, q in zip(copy_before + copy_after, cpu_before + cpu_after):
        assert torch.equal(p, q)
    assert torch.equal(copy_after[1], copy_master)  # b's weights are its masters
    one_matrix = 8 * 32 * 4
    for seen in moved:
        assert seen[8] == 2 * one_matrix  # both fresh (window 6-7, applied at the re-selection)
        assert [seen[11], seen[12]] == [one_matrix, one_matrix]  # later write-backs (step 12: re-selection): only a


def test_pinned_arena_carves_aligned_buffers_from_one_block():
    arena = PinnedArena(pin=False)
    shapes = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 2), torch.float64)]
    arena.reserve(sum(PinnedArena.aligned(torch.Size(s).numel() * torch.empty((), dtype=d).element_size())
                      for s, d in shapes))
    buffers = [arena.take(s, d) for s, d in shapes]
    assert len(arena._blocks) == 1  # one allocation for all of them
    for buf, (shape, dtype) in zip(buffers, shapes):
        assert buf.shape == torch.Size(shape) and buf.dtype == dtype
        assert buf.data_ptr() % ARENA_ALIGN == arena._blocks[0].data_ptr() % ARENA_ALIGN
    for i, buf in enumerate(buffers):  # disjoint
        buf.fill_(i + 1)
    assert [int(b.float().mean()) for b in buffers] == [1, 2, 3]
    arena.take((1000,), torch.float32)  # beyond the reservation: a new block of exactly its size
    assert len(arena._blocks) == 2 and arena._blocks[1].numel() == PinnedArena.aligned(4000)


#: A child made by fork reads a pinned arena's block (`PinnedArena` with a registrar that accepts it) or an
#: unpinned one's, and exits 0; a page it does not get kills it.
_FORK_READ = """
import os, signal, sys
import torch
from hf_zenflow.transport import PinnedArena

class Accepts:
    def register(self, ptr, nbytes): return True
    def unregister(self, ptr): return True

arena = PinnedArena(pin=sys.argv[1] == "pinned", registrar=Accepts())
buf = arena.take((3 << 20,), torch.float32).fill_(7.0)
pid = os.fork()
if pid == 0:
    os._exit(0 if float(buf[-1]) == 7.0 else 3)
_, status = os.waitpid(pid, 0)
print("signal" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}", float(buf.sum()) == 7.0 * (3 << 20))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")
def test_a_forked_child_does_not_get_the_pinned_blocks():
    """A DataLoader worker forked after the first step must not make the kernel copy (or share copy-on-write) the
    page-locked buffers: a pinned block's pages are marked MADV_DONTFORK, so a child reading one dies (it never
    does: the optimizer's buffers are the parent's), while an unpinned block is the child's as ever; the parent
    reads both whole after the fork."""
    def child(kind: str) -> str:
        out = subprocess.run([sys.executable, "-c", _FORK_READ, kind], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[2])
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert child("pinned") == ["signal", "True"]
    assert child("pageable") == ["exit", "0", "True"]


def test_pinned_blocks_start_on_a_page_and_own_their_pages():
    class Accepts:
        def register(self, ptr, nbytes):
            return True

        def unregister(self, ptr):
            return True

    arena = PinnedArena(pin=True, registrar=Accepts())
    for nbytes in (1000, 5 * page_size() + 3):
        arena.reserve(nbytes)
        block = arena._blocks[-1]
        assert block.numel() == nbytes and block.data_ptr() % page_size() == 0
        base = block._base if block._base is not None else block
        end = block.data_ptr() + (nbytes + page_size() - 1) // page_size() * page_size()
        assert end <= base.data_ptr() + base.numel()  # (the marked pages are the block's own)
    assert arena.pinned_bytes == 1000 + 5 * page_size() + 3


def test_cuda_events_are_waited_for_by_sleeping_not_spinning(monkeypatch):
    """Issue 20, defect 6: `torch.cuda.Event()` defaults to a busy-wait `synchronize()`, so the worker thread waiting
    for a gradient to land spun a core the host AdamW needs. Every event `CudaTransport` waits on comes from
    `CudaStreams.event`, which asks for a blocking one (cudaEventBlockingSync). (Checked on the call: no GPU here.)"""
    from hf_zenflow.transport import CudaStreams

    made: list[dict] = []

    class RecordedEvent:
        def __init__(self, **kwargs) -> None:
            made.append(kwargs)

    monkeypatch.setattr(torch.cuda, "Event", RecordedEvent)
    CudaStreams().event()
    assert made == [{"blocking": True}]
