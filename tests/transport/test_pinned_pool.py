"""The pinned pool where copies are asynchronous: each step's gradients cross into their landing slots through the
lander's ring (`lander.StagingLander`), a window's device sums into the host accumulator through the receive ring
(`PinnedRing.receive`), the write-back from the master through its write ring, all into or out of ordinary host
memory, over the CPU double of an asynchronous device (`tests/doubles/async_device.py`: a chunk read on the host
before its copy has landed reads NaN; a sum overwritten before the copy out of it has run is a torn read). The runs
give the CPU device's bits, and the page-locked bytes are the rings' whatever the model's size."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_zenflow.transport.cpu_device.transport import CpuDeviceTransport
from hf_zenflow.transport.lander import StagingLander
from hf_zenflow.transport.pinned import PinnedArena
from hf_zenflow.transport.ring import PinnedRing
from tests.conftest import DEVICE
from tests.doubles.async_device import async_transport
from tests.transport.test_writeback_ring import run


if DEVICE.type != "cpu":
    pytest.skip("replaces the CPU device's transport with the double", allow_module_level=True)


def small_ring_transports(monkeypatch, backends, transports, chunk_bytes=256, chunks=2):
    """Every transport made meanwhile is a `CudaTransport` over the double, its two rings of `chunks` x
    `chunk_bytes` (far smaller than one matrix by default, so that every crossing goes round them many times)."""
    seeds = itertools.count(21)

    def make(device):
        transport, backend = async_transport(next(seeds))
        transport.ring = PinnedRing(transport.ring.arena, chunk_bytes=chunk_bytes, chunks=chunks)
        transport.receive_ring = PinnedRing(transport.receive_ring.arena, chunk_bytes=chunk_bytes, chunks=chunks)
        transport.lander = StagingLander(PinnedRing(transport.lander.ring.arena, chunk_bytes=chunk_bytes,
                                                    chunks=chunks))
        backends.append(backend)
        transports.append(transport)
        return transport

    monkeypatch.setattr("hf_zenflow.transport.transport_for", make)


@pytest.mark.parametrize("writeback", ["buffer", "master"])
@pytest.mark.parametrize("accumulate_on", ["host", "device", "device_bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_crossings_through_the_rings_give_the_cpu_device_bits(dtype, accumulate_on, writeback, monkeypatch):
    """Each step's gradients (host sums) or the window's sums (device sums), and the write-back, through rings of
    2 x 256 B."""
    rules = dict(accumulate_on=accumulate_on, host_writeback=writeback)
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CpuDeviceTransport())
    cpu_losses, cpu_weights, _ = run(dtype, **rules)
    backends, transports = [], []
    small_ring_transports(monkeypatch, backends, transports)
    losses, weights, stats = run(dtype, **rules)
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()
    assert stats["windows"] > 0 and sum(b.copies for b in backends) > 0
    assert losses == cpu_losses
    for p, q in zip(weights, cpu_weights):
        assert torch.equal(p, q)


class _Accumulator:
    """A host end that keeps every column of the sums it receives."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.accum = torch.zeros(shape, dtype=dtype)
        self.sum_index, self.sum_axis = None, 1


class _Sums:
    """One offloaded matrix as the link sees it at a window's close: its device sum and host accumulator."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.param = torch.zeros(shape, dtype=dtype)
        self.window_sum = torch.randn(shape).to(dtype)
        self.window_sum_free = None
        self.host = _Accumulator(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_next_windows_first_add_waits_for_the_copies_out_of_the_sums(dtype):
    """No host job has received the sums yet when the training thread starts the next window (a late worker):
    the first add into a sum waits until every copy out of it is enqueued (receiving the sums itself), so the host
    job still gets the closed window's sums, through a ring much smaller than they are."""
    transport, backend = async_transport(5)
    transport.receive_ring = PinnedRing(transport.receive_ring.arena, chunk_bytes=256, chunks=2)
    splits = [_Sums((10, 100), dtype), _Sums((9, 37), dtype)]
    closed = [s.window_sum.clone() for s in splits]
    landed = transport.ship_window_sums(splits)
    for split in splits:
        transport.before_window_add(split)
        split.window_sum.fill_(7.0)  # (the next window's first add)
    landed.wait()  # (the host job, late)
    backend.synchronize(torch.device("cpu"))
    backend.check()
    assert backend.copies >= (1000 + 333) * dtype.itemsize // 256  # (piece by piece)
    for split, expected in zip(splits, closed):
        assert torch.equal(split.host.accum, expected)
    assert transport.pinned_bytes == 2 * PinnedArena.aligned(256)  # (the ring alone)
    transport.close()


class Wide(torch.nn.Module):
    """Two square matrices of `width` columns and a head: four times the parameters at twice the width."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)  # (on the CPU device: the double stands in for the transport)
        self.embed = torch.nn.Embedding(24, width, dtype=dtype)
        self.inner = torch.nn.Linear(width, width, dtype=dtype)
        self.outer = torch.nn.Linear(width, width, dtype=dtype)
        self.head = torch.nn.Linear(width, 24, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.outer(torch.relu(self.inner(self.embed(x))))))


@pytest.mark.parametrize("host_state", ["auto", "lean"])
@pytest.mark.parametrize("accumulate_on", ["host", "device_bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pinned_bytes_are_the_rings_whatever_the_models_size(dtype, accumulate_on, host_state, monkeypatch):
    """The defaults (a write-back buffer in ordinary memory) and the lean host state (the write-back from the
    master), the window summed on the host or the device: the page-locked bytes are two rings' (the write-back's,
    and the gradients' or the sums'), for two models a factor of 4 apart; the host state itself grows with the
    model."""
    pinned, hosted, counted = {}, {}, {}

    def count(opt):  # the master 4, bf16 moments 4, the accumulator the bf16 sums land in 2 over the unselected
        # columns only, and their indices (8 B per kept column, 4 per column and per selected column): no buffer
        splits = [s for s in opt.engine_state.splits.values() if s.host is not None]
        kept_columns = sum(s.columns - s.k for s in splits)
        indices = kept_columns * 8 + sum(s.columns + 1 + s.k for s in splits) * 4
        elements = sum(s.host.master.numel() for s in splits)
        counted[width] = (8 * elements + 2 * sum(s.host.accum.numel() for s in splits) + indices) / elements
        assert all(s.host.accum.numel() == s.host.master.numel() // s.columns * (s.columns - s.k) for s in splits)

    for width in (64, 128):
        backends, transports = [], []
        small_ring_transports(monkeypatch, backends, transports, chunk_bytes=4096, chunks=3)
        *_, stats = run(dtype, steps=8, make=lambda dtype, width=width: Wide(width, dtype), host_state=host_state,
                        accumulate_on=accumulate_on, inspect=count)
        assert stats["windows"] > 0 and transports
        rings = sum(t.fixed_host_bytes(accumulate_on != "host") for t in transports)
        pinned[width], hosted[width] = stats["pinned_host_bytes"], stats["host_state_bytes"]
        assert pinned[width] == rings == 2 * 3 * 4096, width
        if accumulate_on == "device_bf16" and host_state == "auto":
            assert stats["host_bytes_per_param"] == counted[width] < 10.0
    assert hosted[128] > 3 * hosted[64]
