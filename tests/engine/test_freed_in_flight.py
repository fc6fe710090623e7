"""Gradients freed in backward stay allocated until their copy to the host has read them (CUDA: ``record_stream``).
On the asynchronous double with copies behind backward (`tests/doubles/async_device.py`: lazy, or at a bandwidth), the
device's own allocator view of the gradients (`GradientBlocks`) is the reference: the limit's estimate
(`device_budget.estimate_peak`) and the meter (`DeviceMemoryMeter`, ``stats()["peak_device_bytes"]``) must agree with
it, and at most `FREED_IN_FLIGHT` freed gradients are in flight while the next one is made."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine.device_budget import estimate_peak
from hf_zenflow.engine.in_flight import FREED_IN_FLIGHT
from hf_zenflow.engine.telemetry import device_state_bytes
from tests.conftest import DEVICE, max_rel_diff, zenflow_adamw
from tests.doubles.async_device import AsyncCopies, GradientBlocks, async_transports, lazy_transports


if DEVICE.type != "cpu":
    pytest.skip("replaces the CPU device's transport with the double", allow_module_level=True)

LAYERS, WIDTH = 6, 128
#: Bytes per second of the double's copies to the host: one 64 KiB gradient takes 8 ms, far longer than the backward
#: of one layer of this model, so the copies lag backward.
SLOW_LINK = 8e6
SETTINGS = dict(lr=1e-3, topk_ratio=0.1, update_interval=2, min_offload_numel=0, accumulate_on="host",
                free_gradients_in_backward="on", overlap_step=False, select_strategy="step", select_interval=100)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH, bias=False), torch.nn.Tanh())
                                 for _ in range(LAYERS)])


def _train(model: torch.nn.Module, opt: ZenFlowAdamW, steps: int = 4) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, WIDTH)).square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


@pytest.fixture
def slow_link(monkeypatch) -> list[AsyncCopies]:
    with async_transports(monkeypatch, bandwidth=SLOW_LINK) as backends:
        yield backends


@pytest.fixture
def lagging_link(monkeypatch) -> list[AsyncCopies]:
    """Copies that run only when something waits for them (the lazy double): as far behind backward as CUDA may
    let them fall, whatever this machine's load (a bandwidth's lag depends on how fast backward runs here)."""
    backends = lazy_transports(monkeypatch)
    yield backends
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()


def test_the_estimate_and_the_meter_agree_with_the_allocator_when_copies_lag_backward(lagging_link):
    model = _model()
    blocks = GradientBlocks(list(model.parameters()))  # (its hooks run before the optimizer's)
    opt = zenflow_adamw(model.parameters(), **SETTINGS)
    try:
        _train(model, opt)
        groups, config = opt.param_groups, opt.config
        estimate = estimate_peak(groups, config, 0, frees=True, copies_lag=opt._copies_lag())
        stats = opt.stats()
        # the allocator's peak: the weights and the device state (fixed after the first step) and the gradients'
        # blocks at their most
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        allocator = weights + device_state_bytes(opt.engine_state.splits, opt.engine_state.dense) + blocks.peak_bytes
    finally:
        opt.close()
        blocks.remove()
    gradient = WIDTH * WIDTH * 4
    assert estimate.total == pytest.approx(allocator, rel=0.10)
    assert stats["peak_device_bytes"] == pytest.approx(allocator, rel=0.10)
    assert blocks.peak_bytes == (FREED_IN_FLIGHT + 1) * gradient  # the copies lagged: the bound is what held


def test_waiting_for_the_link_changes_no_bits(slow_link):
    """The hooks that wait for the oldest copy compute what they would without waiting: the same weights as the
    CPU device's transport, whose copies are synchronous."""
    model = _model()
    opt = zenflow_adamw(model.parameters(), **SETTINGS)
    _train(model, opt)
    opt.close()
    assert slow_link and sum(b.copies for b in slow_link) > 0
    slow_link.clear()
    torch.manual_seed(0)
    reference = _model()
    with pytest.MonkeyPatch.context() as patch:
        from hf_zenflow.transport.cpu_device.transport import CpuDeviceTransport

        patch.setattr("hf_zenflow.transport.transport_for", lambda device: CpuDeviceTransport())
        ref_opt = zenflow_adamw(reference.parameters(), **SETTINGS)
        _train(reference, ref_opt)
        ref_opt.close()
    assert max_rel_diff(model, reference) == 0.0
