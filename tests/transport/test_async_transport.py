"""The reference tests again, on `CudaTransport`'s own code over a CPU double of an asynchronous device
(`tests/doubles/async_device.py`): copies land late on background threads and their destinations read as NaN until
then, so a missing wait or a torn read fails here although no GPU is present. (The same tests on the CPU device's
transport are in test_optimizer.py, test_transport.py and test_gradients.py.)"""

from __future__ import annotations

import pytest
import torch

import hf_zenflow.transport as transport_package
from hf_zenflow import SyncOffloadAdamW
from hf_zenflow.transport import CudaTransport
from hf_zenflow.transport.cpu_device.transport import CpuDeviceTransport
from tests.conftest import (
    DEVICE,
    FP32_MOMENTS,
    batches,
    linear_schedule,
    make_model,
    max_rel_diff,
    param_groups,
    train,
    zenflow_adamw,
)
from tests.doubles.async_device import (
    AsyncCopies,
    CheckedRegistrar,
    async_transports,
    lazy_transports,
)
from tests.engine.test_gradients import train_accumulating
from tests.engine.test_several_devices import TwoHalves, backward_in_two_threads
from tests.optimizer.test_optimizer import LR, STEPS, assert_resume_continues_identically, run_reference, run_zenflow


if DEVICE.type != "cpu":
    pytest.skip("replaces the CPU device's transport with the double", allow_module_level=True)


@pytest.fixture(params=[0, 1], ids=["seed0", "seed1"])
def async_device(request, monkeypatch) -> list[AsyncCopies]:
    """Every transport the optimizers of the test create is a `CudaTransport` over its own `AsyncCopies` (the
    delays seeded by the parameter); yields their doubles, and fails the test on anything a background copy
    recorded (a torn read of an unlocked block, an event that never completed)."""
    with async_transports(monkeypatch, 1000 * request.param) as backends:
        yield backends


def copied(backends: list[AsyncCopies]) -> int:
    return sum(b.copies for b in backends)


@pytest.mark.parametrize("topk_ratio", [0.0, 0.1])
def test_interval_one_sequential_is_adamw(async_device, topk_ratio):
    ref, ref_losses = run_reference(clip=0.5)
    model, losses, _ = run_zenflow(clip=0.5, topk_ratio=topk_ratio, update_interval=1, overlap_step=False,
                                   select_strategy="step", select_interval=3, **FP32_MOMENTS)
    assert copied(async_device) > 0
    assert max_rel_diff(model, ref) < 1e-5  # (the reference's own tolerance: torch clips by a tensor, we by a float)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_nothing_selected_interval_one_is_sync_offload(async_device):
    model_s = make_model()
    sync = SyncOffloadAdamW(param_groups(model_s), lr=LR)
    sync_losses = train(model_s, sync, batches(STEPS), linear_schedule(sync, STEPS), clip=1.0)
    model, losses, _ = run_zenflow(clip=1.0, topk_ratio=0.0, update_interval=1, overlap_step=False, **FP32_MOMENTS)
    assert copied(async_device) > 0
    assert losses == sync_losses
    for p, q in zip(model.parameters(), model_s.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("settings", [
    dict(topk_ratio=0.1, update_interval=4),
    dict(topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=7),
    dict(topk_ratio=0.1, update_interval=4, accumulate_on="device", writeback_lag=2),
])
def test_overlapped_equals_sequential_schedule(async_device, settings):
    threaded, losses_t, opt_t = run_zenflow(steps=30, clip=1.0, host_executor="thread", **settings)
    inline, losses_i, opt_i = run_zenflow(steps=30, clip=1.0, host_executor="inline", **settings)
    assert copied(async_device) > 0
    assert losses_t == losses_i
    for p, q in zip(threaded.parameters(), inline.parameters()):
        assert torch.equal(p, q)
    assert opt_t.stats()["windows"] == opt_i.stats()["windows"] > 0


@pytest.mark.parametrize("settings", [
    dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8),
    dict(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=8, accumulate_on="device"),
])
def test_resume_continues_identically(async_device, settings):
    assert_resume_continues_identically(6, 22, settings)
    assert copied(async_device) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_async_copies_give_the_cpu_device_bits(async_device, dtype, monkeypatch):
    """Micro-batches: the copies the hooks start in backward go stale and are made again into the same landing
    buffer (a torn first read, ordered before the second on the side stream)."""
    data = batches(24)
    results = []
    make_async = transport_package.transport_for
    for factory in (lambda device: CpuDeviceTransport(), make_async):
        monkeypatch.setattr("hf_zenflow.transport.transport_for", factory)
        model = make_model(dtype=dtype)
        opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.25, update_interval=3, select_strategy="step",
                            select_interval=5, min_offload_numel=0)
        losses = train_accumulating(model, opt, data, 2, 1.0, linear_schedule(opt, len(data) // 2))
        opt.flush()
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
        opt.close()
    assert copied(async_device) > 0
    (cpu_losses, cpu_weights), (async_losses, async_weights) = results
    assert async_losses == cpu_losses
    for p, q in zip(async_weights, cpu_weights):
        assert torch.equal(p, q)


def test_hooks_of_two_devices_at_once_give_the_sequential_bits(async_device, monkeypatch):
    """Several devices: both halves' hooks start their copies from two threads at once, into one hand-off slot;
    the result is that of one backward on the CPU device's transport."""
    make_async = transport_package.transport_for
    results = []
    for factory, concurrent in ((lambda device: CpuDeviceTransport(), False), (make_async, True)):
        monkeypatch.setattr("hf_zenflow.transport.transport_for", factory)
        model = TwoHalves()
        opt = zenflow_adamw(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2, min_offload_numel=0)
        for step in range(12):
            losses = model.losses(torch.full((8, 32), 0.1 * step) + torch.arange(32) / 32)
            if concurrent:
                backward_in_two_threads(losses)
            else:
                sum(losses).backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        results.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    assert copied(async_device) > 0
    for p, q in zip(*results):
        assert torch.equal(p, q)


def test_a_sequential_step_waits_for_the_device_once(monkeypatch):
    """Regression (issue 20, defect 6): with ``overlap_step=False`` an ordinary step waited for the device twice: in
    its sync (the step's scalars) and again in the host job, for the gradients' copies. The compute stream now
    waits for those copies before the sync, which covers both. Counted on a lazy double, where nothing completes
    until something waits for it, so every host wait the schedule leaves is seen."""
    backends: list[AsyncCopies] = []

    def make(device):
        backends.append(AsyncCopies(lazy=True))
        return CudaTransport(streams=backends[-1], registrar=CheckedRegistrar(backends[-1]))

    monkeypatch.setattr("hf_zenflow.transport.transport_for", make)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=1, overlap_step=False,
                        select_strategy="step", select_interval=100, min_offload_numel=0)
    train(model, opt, batches(3), clip=1.0)  # past the first selection: ordinary steps from now on
    (backend,) = backends
    reads: list[str] = []

    def counted(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            # host memory (the one-pass window kernel reads them, or a view of them): no device wait
            if id(self) in host_counters or (self._base is not None and id(self._base) in host_counters):
                return real(self, *args, **kwargs)
            reads.append(name)
            backend.sync_compute()  # a host read of a device value waits for the compute stream
            return real(self, *args, **kwargs)
        return read

    # the host matrices' AdamW step counts and their kept columns' places live in host memory (`HostMatrix.step`,
    # `HostMatrix.sum_before`), as on CUDA
    hosts = [split.host for split in opt.engine_state.splits.values() if split.host is not None]
    host_counters = {id(t) for host in hosts for t in (host.step, host.sum_before) if t is not None}
    for step in range(3):
        x, y = batches(1, seed=10 + step)[0]
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
        opt.clip_grad_norm_(1.0)
        reads.clear()
        waits = backend.host_waits
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__float__", "__bool__", "__int__"):
                m.setattr(torch.Tensor, name, counted(name))
            opt.step()
        opt.zero_grad()
        assert len(reads) + backend.host_waits - waits == 1, (reads, backend.host_waits - waits)
    assert backend.copies > 0
    opt.close()
    backend.check()


def test_the_write_back_copies_device_time_is_counted_as_a_device_wait(async_device):
    """The write-back's host->device copies run on the compute stream, where the next forward waits behind them:
    their device time (timing events, read once they have run) is ``writeback_device_ms``, part of the device waits
    that `device_utilization` subtracts. Before, only the caller's enqueue time (``cp_writeback_ms``) counted."""
    from hf_zenflow.engine.telemetry import device_wait_ms

    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=2, select_strategy="step",
                        select_interval=100, min_offload_numel=0, writeback_lag=1, high_lr_rule="off")
    measured: list[float] = []
    waits: list[tuple[float, float]] = []
    for x, y in batches(12):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
        opt.step()
        opt.zero_grad()
        stats = opt.stats()
        measured.append(stats["writeback_device_ms"])
        phases = sum(stats[f"cp_{p}_ms"] for p in ("handoff", "wait", "writeback", "host_update"))
        waits.append((device_wait_ms(stats), phases + stats["writeback_device_ms"]))
    opt.close()
    assert opt.stats()["windows"] > 2
    assert sum(m > 0 for m in measured) >= 3  # the write-backs' copies, each counted once they ran
    assert all(total == pytest.approx(expected) for total, expected in waits)


def test_a_caller_that_waits_for_the_device_sees_the_write_back_in_its_own_step(async_device):
    """`hf-zenflow compare` synchronises after `step()`: then `stats()` counts each write-back in the step that made
    it, and only there."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=2, select_strategy="step",
                        select_interval=100, min_offload_numel=0, writeback_lag=1, high_lr_rule="off")
    seen = []
    for x, y in batches(10):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
        opt.step()
        opt.zero_grad()
        for backend in async_device:
            backend.sync_compute()  # (torch.cuda.synchronize)
        stats = opt.stats()
        assert opt.stats()["writeback_device_ms"] == stats["writeback_device_ms"]  # a second read counts nothing
        seen.append((stats["bytes_to_device"] > 0, stats["writeback_device_ms"] > 0))
    opt.close()
    assert sum(wrote for wrote, _ in seen) >= 3
    assert all(wrote == measured for wrote, measured in seen), seen


def test_a_host_jobs_time_excludes_its_waits_for_the_device():
    """A host job that waits for a copy to land (an event) reports its host work in `last_job_ms` and the wait in
    `last_job_wait_ms`: `writeback_lag="auto"` sizes the lag by the host work, not by how late a copy ran."""
    from hf_zenflow.engine.worker import HostAdamWorker

    backend = AsyncCopies()
    stream = backend.side_stream(torch.device("cpu"))
    worker = HostAdamWorker(threads=1, background=True)

    def job() -> None:
        stream.enqueue(lambda: None, delay=0.2)  # a copy that lands 0.2 s later
        event = backend.event()
        event.record(stream)
        event.synchronize()  # the job waits for it, as the worker waits for landed gradients

    worker.submit("host_adamw", job)
    worker.synchronize()
    worker.close()
    assert worker.last_job_wait_ms["host_adamw"] >= 150
    assert worker.last_job_ms["host_adamw"] < 100  # before: >= 200, the wait counted as host work
def test_unscale_runs_after_the_copies_started_in_backward(monkeypatch):
    """The Trainer's fp16 order (unscale_, clip, step) on a lazy double, whose copies run only when something
    waits for them (as late as CUDA may run them): the copies the hooks started are kept after unscale_, so
    unscale_'s in-place rewrite must wait for them (else they read the unscaled values, a torn read here)."""
    from tests.engine.test_amp import _assert_same_weights
    from tests.engine.test_amp import _run as run_amp

    ref, ref_norms, _ = run_amp(8, 1.0, None, topk_ratio=0.1)
    backends = lazy_transports(monkeypatch)
    model, norms, _ = run_amp(8, 1.0, "unscale", topk_ratio=0.1)
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()
    assert sum(b.torn_reads for b in backends) == 0
    assert norms == ref_norms
    _assert_same_weights(model, ref)


@pytest.mark.parametrize("free", ["off", "on"])
def test_unscale_waits_only_for_the_copies_of_the_gradients_it_rewrites(free, monkeypatch):
    """The Trainer's fp16 order (unscale_, clip, step) on a lazy double: under ``unscale_`` the compute stream waits
    for the early copy of each gradient still in ``p.grad`` (unscale_ rewrites it in place) and for no other. A
    gradient freed in backward is not in ``p.grad``, so unscale_ never rewrites it: waiting for its copy would hold
    the next forward behind the whole transfer to the host (before: one wait per early copy, freed ones included).
    The run stays that of the loop without a scaler, bit for bit, and no copy reads torn data."""
    from tests.doubles.async_device import FakeStream
    from tests.engine.test_amp import SCALE, _assert_same_weights, _loss

    def run(scaled: bool) -> tuple[torch.nn.Module, list[tuple[int, int]], list[AsyncCopies]]:
        backends = lazy_transports(monkeypatch)
        model = make_model()
        opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=3, min_offload_numel=0,
                            select_strategy="step", select_interval=5, free_gradients_in_backward=free,
                            high_lr_rule="off")
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALE) if scaled else None
        real_wait, counting = FakeStream.wait_event, [False, 0]

        def wait_event(stream: FakeStream, event) -> None:
            counting[1] += counting[0] and stream.compute
            real_wait(stream, event)

        seen: list[tuple[int, int]] = []  # per step: (compute-stream waits under unscale_, gradients it rewrites)
        with monkeypatch.context() as m:
            m.setattr(FakeStream, "wait_event", wait_event)
            for x, y in batches(10):
                loss = _loss(model, x, y)
                if scaler is None:
                    loss.backward()
                    opt.clip_grad_norm_(1.0)
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    offloaded = [p for p, s in opt.engine_state.splits.items() if s.host is not None]
                    rewritten = sum(p.grad is not None for p in offloaded)  # (the others were freed in backward)
                    counting[:] = [True, 0]
                    scaler.unscale_(opt)
                    seen.append((counting[1], rewritten))
                    counting[0] = False
                    opt.clip_grad_norm_(1.0)
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
        opt.flush()
        opt.close()
        for backend in backends:
            backend.synchronize(torch.device("cpu"))
            backend.check()
        return model, seen, backends

    ref, _, _ = run(scaled=False)
    model, seen, backends = run(scaled=True)
    assert sum(b.torn_reads for b in backends) == 0
    _assert_same_weights(model, ref)
    assert [waits for waits, _ in seen] == [rewritten for _, rewritten in seen]
    if free == "off":
        assert sum(rewritten for _, rewritten in seen) > 0  # (gradients kept: each waited for)
    else:
        assert all(rewritten == 0 for _, rewritten in seen[1:])  # (freed in every step after the first)
