"""`SyncOffloadAdamW` is AdamW with its state on the host."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import SyncOffloadAdamW
from tests.conftest import (
    DEVICE,
    assert_same_across_devices,
    batches,
    linear_schedule,
    make_model,
    param_groups,
    roundtrip,
    train,
)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_sync_offload_is_fused_adamw(clip):
    ref = make_model()
    opt_ref = torch.optim.AdamW(param_groups(ref), lr=1e-2, fused=True)
    ref_losses = train(ref, opt_ref, batches(20), linear_schedule(opt_ref, 20), clip=clip)
    model = make_model()
    opt = SyncOffloadAdamW(param_groups(model), lr=1e-2)
    losses = train(model, opt, batches(20), linear_schedule(opt, 20), clip=clip)
    if clip is None:  # the same fused kernel on the same numbers: bit for bit (on CUDA: the host's kernel vs CUDA's)
        assert losses == ref_losses if DEVICE.type == "cpu" else losses == pytest.approx(ref_losses, rel=1e-5)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_same_across_devices(p, q)
    else:  # torch scales by a 0-d tensor, we by the same value as a Python float: last-bit differences
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    stats = opt.stats()
    n = sum(p.numel() for p in model.parameters())
    assert stats["bytes_to_host"] == stats["bytes_to_device"] == 4 * n  # every gradient down, every weight up
    assert stats["host_state_bytes"] == 16 * n and stats["device_state_bytes"] == 0


def test_sync_offload_checkpoint_round_trip():
    data = batches(12)
    model = make_model()
    opt = SyncOffloadAdamW(param_groups(model), lr=1e-2)
    full = train(model, opt, data)
    model_a = make_model()
    opt_a = SyncOffloadAdamW(param_groups(model_a), lr=1e-2)
    first = train(model_a, opt_a, data[:5])
    ckpt = roundtrip({"model": model_a.state_dict(), "opt": opt_a.state_dict()})
    model_b = make_model(seed=7)
    model_b.load_state_dict(ckpt["model"])
    opt_b = SyncOffloadAdamW(param_groups(model_b), lr=1e-2)
    opt_b.load_state_dict(ckpt["opt"])
    assert first + train(model_b, opt_b, data[5:]) == full


def test_bad_threads_fail_at_construction():
    with pytest.raises(ValueError, match="cpu_threads=0"):
        SyncOffloadAdamW([torch.nn.Parameter(torch.zeros(1))], cpu_threads=0)


def link_copies(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.dtype, torch.dtype, int]]:
    """The copies one `opt.step()` makes between the device side (a gradient or a weight) and host state: (direction,
    destination dtype, source dtype, elements), recorded at the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                dst, src = args[0], args[1]
                if src.untyped_storage().data_ptr() in grads:
                    seen.append(("to host", dst.dtype, src.dtype, src.numel()))
                elif dst.untyped_storage().data_ptr() in weights:
                    seen.append(("to device", dst.dtype, src.dtype, src.numel()))
            return func(*args, **(kwargs or {}))

    with Copies():
        opt.step()
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sync_offload_moves_each_gradient_and_weight_once_in_its_own_dtype(dtype):
    """Regression (issue 20, defect 6): the baseline copied a bf16 gradient into an fp32 host buffer (a cast on the
    device and 4 bytes per element over the link) and the fp32 master straight into the bf16 weight (4 bytes back,
    cast on the device), which made "x faster than sync offload" look better than it is. Now one copy each way per
    parameter, in the parameter's dtype; the casts run on the host."""
    model = make_model(dtype=dtype)
    opt = SyncOffloadAdamW(param_groups(model), lr=1e-2)
    for step in range(2):
        x, y = batches(1, seed=step)[0]
        logits = model(x).float()
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
        copies = link_copies(model, opt)
        opt.zero_grad()
        n = len(list(model.parameters()))
        assert sorted(c[0] for c in copies) == ["to device"] * n + ["to host"] * n  # one each way per parameter
        assert all(dst == src == dtype for _, dst, src, _ in copies), copies
        before = opt.stats()
        size = torch.empty((), dtype=dtype).element_size()
        elements = sum(p.numel() for p in model.parameters())
        assert before["bytes_to_host"] == before["bytes_to_device"] == size * elements


def test_sync_offload_host_step_runs_on_a_host_thread_with_cpu_threads(monkeypatch):
    """Issue 21: the synchronous host AdamW runs on the H host cores (its own thread with cpu_threads intra-op
    threads, as ZenFlow's worker), the caller waits, and the training thread's pool is never resized."""
    import threading

    import hf_zenflow.optimizer.sync_offload as baselines

    seen = []
    real = baselines.fused_adamw_

    def spy(*args, **kwargs):
        seen.append((threading.get_ident(), torch.get_num_threads(), torch.is_grad_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(baselines, "fused_adamw_", spy)
    before = torch.get_num_threads()
    host = 2 if before != 2 else 3
    model = make_model()
    opt = SyncOffloadAdamW(param_groups(model), lr=1e-2, cpu_threads=host)
    train(model, opt, batches(3))
    opt.close()
    assert seen and all(ident != threading.get_ident() for ident, _, _ in seen)
    assert all(threads == host and not grad for _, threads, grad in seen)
    assert torch.get_num_threads() == before
