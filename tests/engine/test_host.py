"""The host worker: ordering, failure propagation without hangs, thread count, shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_zenflow.engine import waits as waits_module
from hf_zenflow.engine import worker as worker_module
from hf_zenflow.engine.host import GRAD_SLOTS, HostMatrix
from hf_zenflow.engine.worker import HostAdamWorker, HostWorkerError


def test_jobs_run_in_submission_order_off_the_calling_thread():
    worker = HostAdamWorker(threads=1, background=True)
    seen, gate = [], threading.Event()
    worker.submit("first", lambda: (gate.wait(5), seen.append(("first", threading.current_thread().name))))
    worker.submit("second", lambda: seen.append(("second", threading.current_thread().name)))
    assert seen == []  # submission did not wait for the (blocked) job
    gate.set()
    worker.synchronize()
    assert [name for name, _ in seen] == ["first", "second"]
    assert {thread for _, thread in seen} == {"hf_zenflow-host"}
    worker.close()


def test_inline_worker_runs_at_submission():
    worker = HostAdamWorker(threads=1, background=False)
    seen = []
    future = worker.submit("job", lambda: seen.append(threading.current_thread().name))
    assert future.done() and seen == [threading.current_thread().name]


def test_failure_is_raised_in_the_caller_and_poisons_the_worker():
    worker = HostAdamWorker(threads=1, background=True)
    ran = []
    worker.submit("broken", lambda: 1 / 0)
    later = worker.submit("later", lambda: ran.append(1))
    start = time.monotonic()
    with pytest.raises(HostWorkerError, match="'broken'.*ZeroDivisionError") as info:
        worker.synchronize()
    assert time.monotonic() - start < 5
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(HostWorkerError):
        worker.wait(later)
    assert ran == []  # nothing runs on top of a failed update
    with pytest.raises(HostWorkerError):
        worker.submit("again", lambda: None)
    worker.close()


def test_keyboard_interrupt_in_a_job_reaches_the_caller():
    worker = HostAdamWorker(threads=1, background=True)
    def interrupted():
        raise KeyboardInterrupt
    worker.submit("interrupted", interrupted)
    with pytest.raises(HostWorkerError, match="KeyboardInterrupt"):
        worker.synchronize()
    worker.close()


def test_slot_wait_raises_instead_of_hanging_when_the_worker_fails():
    worker = HostAdamWorker(threads=1, background=True)
    slots = [worker.acquire_slot() for _ in range(GRAD_SLOTS)]
    assert sorted(slots) == list(range(GRAD_SLOTS))
    worker.submit("broken", lambda: 1 / 0)
    start = time.monotonic()
    with pytest.raises(HostWorkerError):
        worker.acquire_slot()  # no slot will ever come back: must not block forever
    assert time.monotonic() - start < 5
    worker.close()


def test_worker_uses_its_own_thread_count_whatever_the_caller_has():
    torch.set_num_threads(1)  # what `accelerate launch` leaves the training process with (OMP_NUM_THREADS=1)
    worker = HostAdamWorker(threads=2, background=True)
    seen = []
    worker.submit("probe", lambda: seen.append(torch.get_num_threads()))
    worker.synchronize()
    assert seen == [2] and torch.get_num_threads() == 1
    inline = HostAdamWorker(threads=2, background=False)
    inline.submit("probe", lambda: seen.append(torch.get_num_threads()))
    assert seen == [2, 2] and torch.get_num_threads() == 1
    worker.close()


def test_close_joins_the_thread():
    worker = HostAdamWorker(threads=1, background=True)
    thread = worker._thread
    worker.close()
    assert not thread.is_alive()


def test_accumulation_is_the_clipped_window_sum():
    param = torch.zeros(3, 4)
    host = HostMatrix.create(param, torch.float32)
    g1, g2 = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.bfloat16)
    host.accumulate(g1, 0.5)
    host.accumulate(g2, None)
    torch.testing.assert_close(host.accum, g1 * 0.5 + g2.float())
    assert host.accum_count == 2
    # 16 B of state + the write-back buffer in the parameter dtype (on a CPU device, the weight's spare storage)
    assert host.nbytes() == (16 + 4) * param.numel()


@pytest.mark.parametrize("native", ["1", "0"])
def test_batched_accumulation_equals_one_matrix_at_a_time(monkeypatch, native):
    """`accumulate_all` (one kernel call per window position) gives the bits of `accumulate` per matrix, also when
    the matrices of a batch are at different positions of their window."""
    monkeypatch.setenv("HF_ZENFLOW_NATIVE", native)
    gen = torch.Generator().manual_seed(5)
    shapes = [(7, 5), (64, 33), (3, 128)]
    steps = [[torch.randn(s, generator=gen).to(dt) for s, dt in zip(shapes, (torch.float32, torch.bfloat16,
                                                                              torch.float32))] for _ in range(3)]
    one = [HostMatrix.create(torch.zeros(s), torch.float32) for s in shapes]
    batched = [HostMatrix.create(torch.zeros(s), torch.float32) for s in shapes]
    for t, grads in enumerate(steps):
        live = range(len(shapes)) if t else [1]  # matrices 0 and 2 start their window one step late
        for i in live:
            one[i].accumulate(grads[i], 0.75)
        HostMatrix.accumulate_all([(batched[i], grads[i]) for i in live], 0.75)
    for a, b in zip(one, batched):
        assert torch.equal(a.accum, b.accum)
        assert a.accum_count == b.accum_count


def test_held_jobs_start_on_release_and_waits_never_deadlock():
    worker = HostAdamWorker(threads=1, background=True)
    ran: list[str] = []
    worker.hold()
    first = worker.submit("a", lambda: ran.append("a"))
    time.sleep(0.05)
    assert ran == [] and not first.done()  # held: the job waits for the caller's release
    worker.release()
    worker.wait(first)
    assert ran == ["a"]
    # a wait for a held job lets the held jobs go (the optimizer's sequential paths wait inside step()) and keeps
    # holding the ones submitted later; a wait for a job submitted before the hold lets nothing go
    early = worker.submit("early", lambda: ran.append("early"))
    worker.hold()
    worker.wait(early)
    second = worker.submit("b", lambda: ran.append("b"))
    time.sleep(0.05)
    assert ran == ["a", "early"]
    worker.wait(second)
    assert ran == ["a", "early", "b"]
    later = worker.submit("later", lambda: ran.append("later"))
    time.sleep(0.05)
    assert ran == ["a", "early", "b"] and not later.done()
    worker.release()
    worker.wait(later)
    ran.remove("early")
    ran.remove("later")
    worker.hold()
    worker.submit("c", lambda: ran.append("c"))
    worker.synchronize()
    assert ran == ["a", "b", "c"]
    # slots: a caller that needs a slot freed by a held job releases the hold instead of waiting forever
    worker.hold()
    slots = [worker.acquire_slot() for _ in range(GRAD_SLOTS)]
    for slot in slots:
        worker.submit("free", lambda slot=slot: worker.release_slot(slot))
    worker.release_slot(worker.acquire_slot())
    worker.close()


def test_optimizer_step_leaves_the_worker_released():
    from hf_zenflow import ZenFlowAdamW, ZenFlowConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, config=ZenFlowConfig(topk_ratio=0.25, update_interval=2),
                       min_offload_numel=0)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        assert opt.host_windows.worker._gate is None
        opt.zero_grad()
    opt.close()


def test_a_wait_longer_than_the_poll_interval_keeps_waiting(monkeypatch):
    """`Future.result(timeout)` raises `concurrent.futures.TimeoutError`, which is not the built-in `TimeoutError`
    before Python 3.11: every wait longer than the poll interval escaped `step()` there (.ci/run runs this file
    under the oldest supported Python too)."""
    monkeypatch.setattr(waits_module, "_POLL_S", 0.005)
    worker = HostAdamWorker(threads=1, background=True)
    done = []
    future = worker.submit("slow", lambda: (time.sleep(0.2), done.append(1)))
    worker.wait(future)  # about 40 poll timeouts
    assert done == [1]
    worker.submit("slow again", lambda: time.sleep(0.1))
    worker.synchronize()
    worker.close()


def _slot_count(worker: HostAdamWorker) -> int:
    return worker._slots.qsize()


def _hand_off(worker: HostAdamWorker, job=None, interrupt: bool = False):
    """A caller's hand-off as the optimizer does it: take a slot, maybe submit, give the slot back on the way out
    by an exception."""
    slot = worker.take_slot()
    try:
        if job is not None:
            slot.submit("job", job)
        if interrupt:
            raise KeyboardInterrupt
    except BaseException:
        slot.give_back()
        raise
    return slot


def test_a_slot_comes_back_exactly_once_whatever_interrupts_the_hand_off():
    worker = HostAdamWorker(threads=1, background=True)
    for _ in range(GRAD_SLOTS + 1):  # before the job exists: more interrupted hand-offs than there are slots
        with pytest.raises(KeyboardInterrupt):
            _hand_off(worker, interrupt=True)
    assert _slot_count(worker) == GRAD_SLOTS
    # after the submission, while the job is still held: the slot comes back now and the job never runs (the
    # caller may reuse the slot's buffers at once)
    ran: list[str] = []
    worker.hold()
    with pytest.raises(KeyboardInterrupt):
        _hand_off(worker, lambda: ran.append("held"), interrupt=True)
    worker.release()
    worker.synchronize()
    assert ran == [] and _slot_count(worker) == GRAD_SLOTS
    # a give_back after the job has run changes nothing; normal hand-offs: returned by their job, once each
    late = _hand_off(worker, lambda: ran.append("late"))
    worker.synchronize()
    late.give_back()
    for i in range(5):
        _hand_off(worker, lambda i=i: ran.append(f"job{i}"))
    worker.synchronize()
    assert ran == ["late"] + [f"job{i}" for i in range(5)] and _slot_count(worker) == GRAD_SLOTS
    worker.close()


def test_an_interrupted_hand_off_in_step_does_not_leak_its_slot(monkeypatch):
    """A KeyboardInterrupt between taking the gradient slot and queueing the job, in two steps in a row, used to
    leak both slots: the next step() blocked forever in `acquire_slot`."""
    from hf_zenflow import ZenFlowAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=4, min_offload_numel=0)
    submit = HostAdamWorker.submit
    interrupts: list[KeyboardInterrupt] = []

    def interrupted_submit(self, what, fn):
        if what == "accumulate" and interrupts:
            raise interrupts.pop()  # Ctrl-C lands right before the job is queued
        return submit(self, what, fn)

    monkeypatch.setattr(HostAdamWorker, "submit", interrupted_submit)

    def train_step() -> None:
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()

    train_step()
    for _ in range(2):
        interrupts.append(KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            train_step()
        assert not interrupts  # it was the hand-off that got interrupted
    outcome: list[object] = []

    def later_steps() -> None:
        try:
            for _ in range(3):
                train_step()
            opt.synchronize()
            outcome.append("done")
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    runner = threading.Thread(target=later_steps, daemon=True)
    runner.start()
    runner.join(timeout=30)
    assert outcome == ["done"], "the step after two interrupted hand-offs did not complete (leaked slots)"
    assert _slot_count(opt.host_windows.worker) == GRAD_SLOTS
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


def test_close_while_handling_ctrl_c_does_not_wait_and_later_workers_do():
    """close() from code handling a KeyboardInterrupt returns at once instead of joining a long host job; that
    job still finishes, and no later worker runs a job before it has (they work on the same host state)."""
    order: list[str] = []
    go = threading.Event()
    worker = HostAdamWorker(threads=1, background=True)
    worker.submit("long", lambda: (go.wait(30), order.append("old")))
    returned = threading.Event()

    def close_on_ctrl_c() -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            worker.close()
            returned.set()

    closer = threading.Thread(target=close_on_ctrl_c, daemon=True)
    closer.start()
    assert returned.wait(5), "close() waited for the running host job"
    successor = HostAdamWorker(threads=1, background=True)
    successor.submit("new", lambda: order.append("new"))
    time.sleep(0.1)
    assert order == []  # the new worker waits for the old one's job
    go.set()
    successor.synchronize()
    assert order == ["old", "new"]
    successor.close()


_SLOW_HOST_STEP_SCRIPT = """
import signal
import time
# What a terminal's Ctrl-C meets: Python's KeyboardInterrupt handler (a process started in the background by a
# non-interactive shell, as CI may be, inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch
import hf_zenflow.engine.windows as zenflow_windows
import hf_zenflow.engine.worker as zenflow_worker
from hf_zenflow import ZenFlowAdamW

# waits far longer than the prompt path's bound below: an exit that waits for the host step shows as >= 60 s
zenflow_worker._EXIT_WAIT_S = 100.0
zenflow_worker.HostAdamWorker.close.__defaults__ = (100.0,)

def slow_host_step(groups, *last):
    print("host step running", flush=True)
    time.sleep(60)

zenflow_windows.host_adamw_window = slow_host_step
torch.manual_seed(0)
model = torch.nn.Linear(32, 32)
opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=1, min_offload_numel=0)
while True:  # the second step waits for the first window's (endless) host step
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_ctrl_c_during_a_long_host_step_exits_promptly(tmp_path):
    """Ctrl-C while the training loop waits for a long host step: the process exits at once instead of waiting
    for the host step (here 60 s, with the joins at close and at exit lengthened past it, so that the bound below
    separates the two however loaded the machine is)."""
    script = tmp_path / "slow_host_step.py"
    script.write_text(_SLOW_HOST_STEP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = threading.Timer(120, proc.kill)  # a child that never starts its host step must not hang the suite
    deadline.start()
    try:
        assert proc.stdout.readline().strip() == "host step running", proc.communicate()[1][-3000:]
        time.sleep(0.5)  # the loop reaches its wait for the host step
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        try:
            _, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running 60 s after Ctrl-C:\n{proc.communicate()[1][-3000:]}")
        elapsed = time.monotonic() - start
    finally:
        deadline.cancel()
        proc.kill()
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert elapsed < 30, f"exit took {elapsed:.1f} s after Ctrl-C"


def test_the_worker_thread_makes_the_parameters_cuda_device_current(monkeypatch):
    """CUDA's current device is per OS thread (0 by default): the worker makes the parameters' device current before
    its first job, so that its event waits (and the events it frees) do not create a context on GPU 0 in every
    rank. (Recorded through a stand-in for `torch.cuda.set_device` here: no CUDA device.)"""
    made_current: list[tuple[int, str]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: made_current.append((device, threading.current_thread().name)))
    worker = HostAdamWorker(threads=1, background=True, cuda_device=3)
    worker.submit("job", lambda: None)
    worker.synchronize()
    worker.close()
    assert made_current == [(3, "hf_zenflow-host")]
    assert worker_module.cuda_device_of([torch.zeros(1)]) is None  # nothing on CUDA: nothing made current


def test_an_optimizer_on_cuda_gives_its_worker_the_parameters_device(monkeypatch):
    """`HostWindows` passes the first CUDA parameter's device index to the worker it starts."""
    import hf_zenflow.engine.windows as windows_module
    from hf_zenflow import ZenFlowAdamW

    created: list[int | None] = []
    real = worker_module.HostAdamWorker

    def worker(*args, **kwargs):
        created.append(kwargs.get("cuda_device"))
        return real(*args, **{**kwargs, "cuda_device": None})

    monkeypatch.setattr(worker_module, "HostAdamWorker", worker)  # (started by `WorkerKeeper`)
    lin = torch.nn.Linear(8, 8)
    asked: list[list] = []
    monkeypatch.setattr(windows_module, "cuda_device_of", lambda params: (asked.append(list(params)), 2)[1])
    opt = ZenFlowAdamW(lin.parameters(), lr=1e-2, min_offload_numel=0)
    lin(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.close()
    assert created and set(created) == {2}
    assert all(params == list(lin.parameters()) for params in asked)
    cuda = [SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device=torch.device("cuda", 1))]
    assert worker_module.cuda_device_of(cuda) == 1
