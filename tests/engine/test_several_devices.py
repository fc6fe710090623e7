"""Several devices in one process (``device_map="auto"``): each device's part of backward runs on its own autograd
thread, so the post-accumulate-grad hooks (`BackwardHandOff.grad_ready`) fire from several threads at once. The double
here: a model whose two halves backward in two threads at the same moment."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine.host import GRAD_SLOTS
from hf_zenflow.transport import CopyTransport
from tests.conftest import DEVICE, zenflow_adamw


if DEVICE.type != "cpu":
    pytest.skip("swaps the CPU device's transport", allow_module_level=True)


class TwoHalves(torch.nn.Module):
    """Two independent halves, as if on two devices: each has its own loss and its own backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(32, 32, bias=False)
        self.b = torch.nn.Linear(32, 32, bias=False)

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x).square().mean(), self.b(x).tanh().square().mean()


def backward_in_two_threads(losses: tuple[torch.Tensor, torch.Tensor], timeout: float = 20.0) -> None:
    """Both halves' backward passes start together (a barrier), each in its own thread; a failure or a hang in
    either is raised here (never a real hang: a bounded join)."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(loss: torch.Tensor) -> None:
        try:
            barrier.wait(timeout)
            loss.backward()
        except BaseException as exc:  # noqa: BLE001 - carried to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(loss,), daemon=True) for loss in losses]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a backward thread hung"
    if errors:
        raise errors[0]


def test_hooks_of_two_devices_at_once_take_one_hand_off_slot(monkeypatch):
    """Regression (issue 20, defect 3): `grad_ready` checked and took the step's hand-off slot without a lock, so two
    autograd threads both took one; the second overwrote the first, whose slot was never returned, and after
    `GRAD_SLOTS` such steps the next hand-off waited forever. Taking a slot is slowed here (as a stall while the
    worker is behind would), so both threads are inside it at once whenever the check is not locked."""
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    model = TwoHalves()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, min_offload_numel=0)
    x = torch.randn(8, 32)
    sum(model.losses(x)).backward()
    opt.step()  # the host state exists from now on: the hooks start the copies
    opt.zero_grad()
    worker = opt.host_windows.worker
    real_take = worker.take_slot

    def slow_take():
        time.sleep(0.05)
        return real_take()

    monkeypatch.setattr(worker, "take_slot", slow_take)
    for step in range(2 * GRAD_SLOTS):
        backward_in_two_threads(model.losses(x + step))
        early = opt.host_windows.backward.early
        assert early is not None and len(early.copies) == 2  # both halves' copies, in one slot
        assert worker._slots.qsize() == GRAD_SLOTS - 1, f"step {step}: more than one slot taken"
        done = threading.Event()
        stepper = threading.Thread(target=lambda done=done: (opt.step(), done.set()), daemon=True)
        stepper.start()
        assert done.wait(20.0), f"step {step} hung waiting for a hand-off slot"
        opt.zero_grad()
        opt.synchronize()
        assert worker._slots.qsize() == GRAD_SLOTS  # every slot back once the jobs ran
    opt.close()


def test_a_worker_is_never_started_from_an_autograd_thread(monkeypatch):
    """Regression (issue 20, defect 6): after `close()` the next backward's hooks started the host worker, and
    `worker_started` recorded the thread it ran on (CUDA: an autograd thread) as the training thread, whose intra-op
    pool it lowers and later restores. The worker is now started by `step()`, in the thread that calls it; the
    hooks leave the copies of that step to it."""
    import hf_zenflow.settings.threads as threads_module

    monkeypatch.setattr(threads_module, "_POOL", threads_module._TrainingPool())
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    model = TwoHalves()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, min_offload_numel=0)
    x = torch.randn(8, 32)
    sum(model.losses(x)).backward()
    opt.step()
    opt.zero_grad()
    opt.close()  # (the Trainer's end of training; a later step starts a new worker)
    backward_in_two_threads(model.losses(x))  # the hooks run on other threads, as autograd's on CUDA
    opt.step()
    assert opt.host_windows.worker is not None and opt.host_windows.worker.background
    assert threads_module._POOL.thread == threading.get_ident()  # the thread that called step()
    opt.close()


@pytest.mark.parametrize("overflowing", ["a", "b"])
def test_freed_gradients_overflow_is_charged_to_each_ones_device(overflowing):
    """``device_map`` + a GradScaler + gradients freed in backward: each half's hook takes its overflow flag on its
    own device, and the scaler keeps one ``found_inf`` per device. The flags are added to the scaler's check per
    device (before: stacked into one tensor, which fails for flags on two devices, and charged to one device). Half
    b's freed gradient is moved to another device after its hook ("meta", the one other device every machine
    has: its flag is only moved and grouped, never read); half a's stays on the CPU, where its flag is read."""
    model = TwoHalves()
    opt = zenflow_adamw(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, min_offload_numel=0,
                        free_gradients_in_backward="on")
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    x = torch.randn(8, 32)
    for step in range(2):  # (the second step's hooks know of the scaler: they take the flags)
        losses = model.losses(x + step)
        backward_in_two_threads(tuple(scaler.scale(loss) for loss in losses))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    a, b = model.losses(x)
    backward_in_two_threads((scaler.scale(a) * (math.inf if overflowing == "a" else 1.0),
                             scaler.scale(b) * (math.inf if overflowing == "b" else 1.0)))
    freed = opt.host_windows.backward.freed
    assert set(freed) == {model.a.weight, model.b.weight} and all(f.overflow is not None for f in freed.values())
    on_b = freed[model.b.weight]
    on_b.stand_in, on_b.overflow = on_b.stand_in.to("meta"), on_b.overflow.to("meta")
    scaler.unscale_(opt)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert set(found) == {torch.device("cpu"), torch.device("meta")}
    assert found[torch.device("cpu")].item() == (1.0 if overflowing == "a" else 0.0)
    assert found[torch.device("meta")].shape == ()
    opt.host_windows.backward.release()
    opt.close()
