"""The write-back where copies are asynchronous, from its buffer or from the fp32 master (``host_writeback="master"``):
piece by piece through `PinnedRing`'s pinned chunks, over the CPU double of an asynchronous device
(`tests/doubles/async_device.py`, whose host->device copies read their source only when they run: a chunk refilled
before its copy has run poisons the weight). It gives the CPU device's bits; the master's holds no write-back buffer,
and either pins the ring's bytes alone whatever the model."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_zenflow.transport.cpu_device.transport import CpuDeviceTransport
from hf_zenflow.transport.ring import PinnedRing
from tests.conftest import DEVICE, batches, linear_schedule, make_model, param_groups, train, zenflow_adamw
from tests.doubles.async_device import async_transport


if DEVICE.type != "cpu":
    pytest.skip("replaces the CPU device's transport with the double", allow_module_level=True)

LR = 1e-2
SETTINGS = dict(topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=5, min_offload_numel=0)
#: A ring far smaller than one matrix, so that every write-back goes round it many times.
SMALL_CHUNK, SMALL_CHUNKS = 256, 2


def small_ring_transports(monkeypatch, backends, chunk_bytes=SMALL_CHUNK, chunks=SMALL_CHUNKS):
    seeds = itertools.count(11)

    def make(device):
        transport, backend = async_transport(next(seeds))
        transport.ring = PinnedRing(transport.ring.arena, chunk_bytes=chunk_bytes, chunks=chunks)
        backends.append(backend)
        return transport

    monkeypatch.setattr("hf_zenflow.transport.transport_for", make)


def run(dtype, steps=20, make=make_model, inspect=None, **rules):
    """(losses, weights, stats) of a short run; `inspect` sees the optimizer before it closes."""
    model = make(dtype=dtype)
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, **rules)
    losses = train(model, opt, batches(steps), linear_schedule(opt, steps), clip=1.0)
    opt.flush()
    stats = opt.stats()
    if inspect is not None:
        inspect(opt)
    opt.close()
    return losses, [p.detach().clone() for p in model.parameters()], stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_master_written_back_through_the_ring_gives_the_cpu_device_bits(dtype, monkeypatch):
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CpuDeviceTransport())
    cpu_losses, cpu_weights, _ = run(dtype, host_writeback="buffer")
    backends = []
    small_ring_transports(monkeypatch, backends)
    losses, weights, stats = run(dtype, host_writeback="master")
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()
    assert sum(b.copies for b in backends) > 0 and stats["windows"] > 0
    assert losses == cpu_losses
    for p, q in zip(weights, cpu_weights):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_master_write_back_holds_no_buffer_and_both_pin_the_ring_alone(dtype, monkeypatch):
    """Against the write-back buffer: the weight's bytes per host element less (4 fp32, 2 bf16); the same pinned
    bytes (the buffer is ordinary memory: both cross through the ring)."""
    results = {}
    for writeback in ("buffer", "master"):
        backends = []
        small_ring_transports(monkeypatch, backends, chunk_bytes=4096, chunks=3)
        *_, stats = run(dtype, steps=8, host_writeback=writeback)
        results[writeback] = stats
    buffer, master = results["buffer"], results["master"]
    assert buffer["host_bytes_per_param"] - master["host_bytes_per_param"] == pytest.approx(dtype.itemsize)
    assert master["pinned_host_bytes"] == buffer["pinned_host_bytes"] > 0


@pytest.mark.parametrize("writeback", ["buffer", "master"])
def test_a_chunk_is_refilled_only_after_its_copy_has_run(writeback, monkeypatch):
    """The ring's wait is what keeps the weights right: without it the double's late copies read refilled chunks
    and the weights differ from the CPU device's (or are poisoned)."""
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CpuDeviceTransport())
    _, cpu_weights, _ = run(torch.float32, steps=8, host_writeback="buffer")

    class NoWait:
        def __init__(self, event):
            self.event = event

        def synchronize(self):
            pass

    original = PinnedRing.copy

    def copy_without_waits(self, dst, src, send, event_after):
        original(self, dst, src, send, lambda: NoWait(event_after()))

    monkeypatch.setattr(PinnedRing, "copy", copy_without_waits)
    backends = []
    small_ring_transports(monkeypatch, backends)
    try:
        _, weights, _ = run(torch.float32, steps=8, host_writeback=writeback)
        wrong = any(not torch.equal(p, q) for p, q in zip(weights, cpu_weights))
    except RuntimeError:  # (a late copy rewrote a weight that autograd had saved for backward)
        wrong = True
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
    assert wrong


class _CountedEvent:
    """An event that says how often a host thread waited for it."""

    waits = 0

    def synchronize(self):
        _CountedEvent.waits += 1


def test_small_pieces_are_packed_into_one_chunk_and_a_chunk_is_waited_for_only_when_the_ring_comes_round():
    """Ten matrices of 64 B through two chunks of 1 KiB: before, each took a chunk of its own, so the third waited
    for the first one's copy (eight waits within one write-back); packed, they fill one chunk and nothing waits. Three
    more KiB go round the ring: a chunk is then waited for each time it is taken again."""
    from hf_zenflow.transport.pinned import PinnedArena

    ring = PinnedRing(PinnedArena(pin=False), chunk_bytes=1024, chunks=2)
    sources = [torch.randn(4, 4) for _ in range(10)]
    targets = [torch.empty(4, 4, dtype=torch.bfloat16) for _ in sources]
    _CountedEvent.waits = 0
    for dst, src in zip(targets, sources):
        ring.copy(dst, src, lambda d, s: d.copy_(s), _CountedEvent)
    assert _CountedEvent.waits == 0
    assert all(torch.equal(dst, src.to(torch.bfloat16)) for dst, src in zip(targets, sources))
    big = torch.randn(3 * 512)  # (3 KiB of bf16 pieces: the rest of the first chunk, the second, the first again)
    out = torch.empty(3 * 512, dtype=torch.bfloat16)
    ring.copy(out, big, lambda d, s: d.copy_(s), _CountedEvent)
    assert torch.equal(out, big.to(torch.bfloat16))
    assert _CountedEvent.waits == 2  # (the first chunk taken again, then the second)
