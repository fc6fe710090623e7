"""The host worker: ordering, failure propagation without hangs, thread count, shutdown."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hf_zenflow.host import GRAD_SLOTS, HostAdamWorker, HostMatrix, HostWorkerError


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
        assert opt._worker._gate is None
        opt.zero_grad()
    opt.close()
