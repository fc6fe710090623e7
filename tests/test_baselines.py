"""`SyncOffloadAdamW` is AdamW with its state on the host."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import SyncOffloadAdamW
from tests.conftest import batches, linear_schedule, make_model, param_groups, roundtrip, train


@pytest.mark.parametrize("clip", [None, 0.5])
def test_sync_offload_is_fused_adamw(clip):
    ref = make_model()
    opt_ref = torch.optim.AdamW(param_groups(ref), lr=1e-2, fused=True)
    ref_losses = train(ref, opt_ref, batches(20), linear_schedule(opt_ref, 20), clip=clip)
    model = make_model()
    opt = SyncOffloadAdamW(param_groups(model), lr=1e-2)
    losses = train(model, opt, batches(20), linear_schedule(opt, 20), clip=clip)
    if clip is None:  # the same fused kernel on the same numbers: bit for bit
        assert losses == ref_losses
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
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


def test_sync_offload_host_step_runs_on_a_host_thread_with_cpu_threads(monkeypatch):
    """Issue 21: the synchronous host AdamW runs on the H host cores (its own thread with cpu_threads intra-op
    threads, as ZenFlow's worker), the caller waits, and the training thread's pool is never resized."""
    import threading

    import hf_zenflow.baselines as baselines

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
