"""Every wait for the host worker is bounded and names what it waited for."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import hf_zenflow.engine.waits as waits
from hf_zenflow import SyncOffloadAdamW
from hf_zenflow.engine.worker import HostAdamWorker, HostWorkerError
from tests.conftest import batches, make_model, param_groups, train


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
