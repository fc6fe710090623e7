"""Every wait for the host worker is bounded and names what it waited for."""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from concurrent.futures import Future

import pytest
import torch

import hf_zenflow.engine.waits as waits
from hf_zenflow import SyncOffloadAdamW
from hf_zenflow.engine.worker import HostAdamWorker, HostWorkerError
from hf_zenflow.transport import CopyTransport
from tests.conftest import batches, make_model, param_groups, train, zenflow_adamw


@pytest.fixture
def quick_waits(monkeypatch):
    monkeypatch.setattr(waits, "_POLL_S", 0.01)
    monkeypatch.setattr(waits, "WAIT_WARN_S", 0.05)
    monkeypatch.setenv("HF_ZENFLOW_HOST_WAIT_LIMIT_S", "0.3")


def test_a_host_job_that_never_ends_is_given_up_on_naming_it(quick_waits, caplog):
    """A host job stuck forever (here: waiting on an event nobody sets) hung `synchronize()` and every later step
    without a word. Now the caller warns naming the job, then raises `HostWorkerError` naming it."""
    stuck = threading.Event()
    worker = HostAdamWorker(threads=1, background=True)
    try:
        future = worker.submit("host_adamw", stuck.wait)
        with caplog.at_level(logging.WARNING, logger="hf_zenflow"), \
                pytest.raises(HostWorkerError, match=r"gave up waiting for host job 'host_adamw' after"):
            worker.wait(future)
        assert "still waiting for host job 'host_adamw'" in caplog.text
    finally:
        stuck.set()
        worker.close()


def test_a_hand_off_slot_that_never_frees_is_given_up_on(quick_waits):
    stuck = threading.Event()
    worker = HostAdamWorker(threads=1, background=True)
    try:
        slots = [worker.take_slot() for _ in range(2)]
        for slot in slots:
            slot.submit("accumulate", stuck.wait)
        with pytest.raises(HostWorkerError, match="gave up waiting for a free gradient hand-off slot"):
            worker.acquire_slot()
    finally:
        stuck.set()
        worker.close()


def test_the_synchronous_baseline_waits_bounded_too(quick_waits, monkeypatch):
    import hf_zenflow.optimizer.sync_offload as sync_offload

    stuck = threading.Event()
    monkeypatch.setattr(sync_offload, "fused_adamw_", lambda *args, **kwargs: stuck.wait())
    model = make_model()
    opt = SyncOffloadAdamW(param_groups(model), lr=1e-3, cpu_threads=1)
    try:
        with pytest.raises(HostWorkerError, match="gave up waiting for the synchronous host AdamW"):
            train(model, opt, batches(1))
    finally:
        stuck.set()
        opt.close()


@pytest.mark.parametrize("text", ["0", "-5", "soon"])
def test_the_limit_setting_is_checked(monkeypatch, text):
    monkeypatch.setenv("HF_ZENFLOW_HOST_WAIT_LIMIT_S", text)
    with pytest.raises(ValueError, match="HF_ZENFLOW_HOST_WAIT_LIMIT_S=.*a number of seconds > 0"):
        waits.wait_limit_s()


def test_the_synchronous_baseline_is_unchanged_by_its_executor():
    """The host AdamW on its executor thread: the same weights as torch's AdamW on the same numbers."""
    model, ref = make_model(), make_model()
    opt = SyncOffloadAdamW(param_groups(model), lr=1e-3, cpu_threads=1)
    train(model, opt, batches(3))
    opt.close()
    train(ref, torch.optim.AdamW(param_groups(ref), lr=1e-3, fused=True), batches(3))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("lag", [2, 3, 4, "auto"])
def test_a_slow_host_adamw_never_blocks_a_backward_hook(monkeypatch, lag):
    """With ``writeback_lag`` >= 2 the window's host AdamW has that many steps before its write-back waits for it;
    meanwhile the backward hooks of the next steps take hand-off slots (a transport that copies: each step's hooks
    start its copies). The AdamW job keeps its slot until it has run and each later accumulate job queues behind it
    on the in-order worker, so a pool of two slots left the hooks of the second step after the close waiting inside
    backward for the AdamW. Here every host AdamW is held until the step that writes it back waits for it (or a
    hook finds no free slot while it runs: a stall, recorded and then let go); no hook may find the pool empty then,
    and the weights are those of the sequential reference (the inline executor). "auto": chosen as 3 at the first
    step, after the host state with its landing buffers exists."""
    from hf_zenflow.engine.backward import HeldHandOff

    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    if lag == "auto":
        monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_lag_from_sizes", lambda elements, longest: 3)
    settings = dict(lr=1e-3, topk_ratio=0.25, update_interval=4, writeback_lag=lag, high_lr_rule="off",
                    select_strategy="step", select_interval=1000, min_offload_numel=0)
    data = batches(14)
    reference = make_model()
    inline = zenflow_adamw(param_groups(reference), host_executor="inline", **settings)
    train(reference, inline, data)
    inline.close()

    gates: dict[Future, threading.Event] = {}  # each host AdamW job's, opened when the caller waits for it
    stalls: list[int] = []
    step = [0]
    real_submit_close, real_wait, real_take = HeldHandOff.submit_close, HostAdamWorker.wait, HostAdamWorker.take_slot

    def submit_close(self, worker, work, landed, window_step):
        gate = threading.Event()

        def slowed(*args):
            gate.wait(30.0)  # (bounded: a test that goes wrong fails instead of hanging)
            window_step(*args)

        future = real_submit_close(self, worker, work, landed, slowed)
        gates[future] = gate
        return future

    def open_gates() -> None:
        for gate in gates.values():
            gate.set()

    def wait(self, future):
        open_gates()
        real_wait(self, future)

    def take_slot(self):
        # No free slot: the jobs ahead of the oldest held host AdamW run (they free theirs); a take that still finds
        # none would wait for that AdamW.
        while self._slots.empty():
            pending = [f for f in list(self._outstanding) if not f.done()]
            if not pending:
                break
            if pending[0] in gates and not gates[pending[0]].is_set():
                stalls.append(step[0])
                open_gates()
                break
            futures.wait(pending[:1], timeout=30.0)
        return real_take(self)

    monkeypatch.setattr(HeldHandOff, "submit_close", submit_close)
    monkeypatch.setattr(HostAdamWorker, "wait", wait)
    monkeypatch.setattr(HostAdamWorker, "take_slot", take_slot)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), **settings)
    train(model, opt, data, hook=lambda i: step.__setitem__(0, i + 1))
    opt.synchronize()  # (opens the last window's gate)
    opt.close()
    assert opt.stats()["writeback_lag"] == (3 if lag == "auto" else lag)
    assert len(gates) >= 2
    assert stalls == [], f"a backward hook waited for the host AdamW in steps {stalls}"
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
