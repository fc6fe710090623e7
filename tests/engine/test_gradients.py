"""Reading gradients as backward produces them (`hf_zenflow.engine.gradients`): exact under gradient accumulation and
clipping, used by `step()` instead of a second read, never stale, and never keeping the optimizer alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hf_zenflow.engine.gradients as gradients_module
from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine.gradients import GradientReads, torch_norm
from hf_zenflow.transport import CopyTransport
from hf_zenflow.transport.cpu_device.transport import CpuDeviceTransport
from tests.conftest import (
    DEVICE,
    FP32_MOMENTS,
    batches,
    finish_step,
    linear_schedule,
    make_model,
    max_rel_diff,
    param_groups,
    zenflow_adamw,
)


LR = 1e-2
EXACT = dict(topk_ratio=0.1, update_interval=1, overlap_step=False, select_strategy="step", select_interval=5,
             min_offload_numel=0, **FP32_MOMENTS)


def loss_of(model, x, y):
    logits = model(x.to(DEVICE)).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1))


def train_accumulating(model, opt, data, micro: int, clip: float | None, sched=None) -> list[float]:
    """`micro` backward passes per optimizer step (each on its own batch, loss scaled by 1/micro)."""
    losses = []
    for i in range(0, len(data), micro):
        total = 0.0
        for x, y in data[i:i + micro]:
            loss = loss_of(model, x, y) / micro
            loss.backward()
            total += loss.item()
        finish_step(model, opt, clip, sched)
        losses.append(total)
    return losses


@pytest.mark.parametrize("clip", [None, 0.5])
def test_gradient_accumulation_stays_exact(clip):
    """Three backward passes per step: each pass runs the hooks again; only the final gradient may count (a norm
    taken after the first pass would be stale). At U=1 without overlap ZenFlow is AdamW, so it must stay AdamW."""
    data = batches(36)
    ref = make_model()
    ref_opt = torch.optim.AdamW(param_groups(ref), lr=LR)
    ref_losses = train_accumulating(ref, ref_opt, data, 3, clip, linear_schedule(ref_opt, 12))
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **EXACT)
    losses = train_accumulating(model, opt, data, 3, clip, linear_schedule(opt, 12))
    opt.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model, ref) < 1e-5


def test_step_uses_the_norms_taken_in_backward(monkeypatch):
    model = make_model()
    # (it rewrites a gradient after backward: the gradients stay on the device)
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=0,
                        free_gradients_in_backward="off")
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    opt.step()  # the first step selects columns
    opt.zero_grad()
    read_in_step: list[int] = []
    real = gradients_module.norms_and_gather

    def counting(splits, entries, grads, *args, **kwargs):
        read_in_step.append(len(grads))
        return real(splits, entries, grads, *args, **kwargs)

    monkeypatch.setattr(gradients_module, "norms_and_gather", counting)
    loss_of(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    assert read_in_step == []  # every norm came from the hooks
    loss_of(model, x, y).backward()
    with torch.no_grad():
        model.up.weight.grad.mul_(0.5)  # changed after its hook ran: its norm must be read again
    opt.step()
    assert read_in_step == [1]
    opt.close()


def test_clipping_with_the_hooks_norms_is_torch_bit_for_bit():
    model = make_model()
    # torch sums the norms in this order; torch's clip reads p.grad, so the gradients stay on the device
    opt = zenflow_adamw(model.parameters(), lr=LR, min_offload_numel=0, free_gradients_in_backward="off")
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    assert all(opt._reads.norm(p) is not None for p in model.parameters())
    ours = opt.clip_grad_norm_(0.1)
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert torch.equal(ours, theirs)
    opt.close()


def test_a_recycled_gradient_is_never_taken_for_the_one_read():
    lin = torch.nn.Linear(8, 8, bias=False)
    reads = GradientReads([lin.weight])
    lin(torch.randn(2, 8)).sum().backward()
    assert torch.equal(reads.norm(lin.weight), torch_norm(lin.weight.grad))
    lin.weight.grad = torch.ones(8, 8)  # set by hand: no hook ran for it
    assert reads.norm(lin.weight) is None
    lin.weight.grad = None
    assert reads.norm(lin.weight) is None
    reads.remove()
    lin(torch.randn(2, 8)).sum().backward()
    assert reads.norm(lin.weight) is None  # hooks removed


def test_the_hooks_do_not_keep_the_optimizer_alive():
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=2, min_offload_numel=0)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    opt.step()
    opt.close()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    loss_of(model, x, y).backward()  # the model trains on without it


@pytest.mark.parametrize("micro", [1, 3])
def test_copies_started_in_backward_give_the_same_bits(micro, monkeypatch):
    """On a transport that copies (CUDA's schedule, run here on the CPU) the hooks start each gradient's copy to the
    host in backward; with several backward passes per step the earlier copies are stale and are made again. Same
    bits as the CPU device's transport, which copies nothing."""
    if DEVICE.type != "cpu":
        pytest.skip("swaps the CPU device's transport")
    data = batches(24)
    results = []
    for transport_cls in (CpuDeviceTransport, CopyTransport):
        monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device, cls=transport_cls: cls())
        model = make_model()
        opt = ZenFlowAdamW(param_groups(model), lr=LR, topk_ratio=0.25, update_interval=3, select_strategy="step",
                           select_interval=5, min_offload_numel=0)
        losses = train_accumulating(model, opt, data, micro, 1.0, linear_schedule(opt, len(data) // micro))
        opt.flush()
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
        opt.close()
    (cpu_losses, cpu_weights), (copy_losses, copy_weights) = results
    assert copy_losses == cpu_losses
    for p, q in zip(copy_weights, cpu_weights):
        assert torch.equal(p, q)


def test_copies_started_in_backward_are_taken_by_the_step(monkeypatch):
    if DEVICE.type != "cpu":
        pytest.skip("swaps the CPU device's transport")
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=LR, topk_ratio=0.25, update_interval=3, min_offload_numel=0)
    x, y = batches(1)[0]
    loss_of(model, x, y).backward()
    opt.step()  # the first step creates the host state: from now on the hooks can copy
    opt.zero_grad()
    copied_in_step: list[int] = []
    real = opt.host_windows.backward._sources
    monkeypatch.setattr(opt.host_windows.backward, "_sources", lambda work, slot: (copied_in_step.append(len(work)),
                                                                             real(work, slot))[1])
    for _ in range(3):
        loss_of(model, x, y).backward()
        early = opt.host_windows.backward.early
        assert early is not None and len(early.copies) == 3  # the three matrices, copied in backward
        opt.step()
        opt.zero_grad()
        assert opt.host_windows.backward.early is None
    assert copied_in_step == []  # the step copied nothing itself
    opt.close()
