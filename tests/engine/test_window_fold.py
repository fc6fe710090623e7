"""The window's last gradients folded into its host AdamW job (`backward.HeldHandOff`, `host.host_adamw_window`): one
job and one pass over the host state at the window's close instead of an accumulation job and an AdamW job, with
the same bits as the two passes."""

from __future__ import annotations

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow.engine.worker import HostAdamWorker
from tests.conftest import FP32_MOMENTS, batches, linear_schedule, make_model, param_groups, train, zenflow_adamw


SETTINGS = dict(topk_ratio=0.1, select_strategy="step", select_interval=8, min_offload_numel=0, high_lr_rule="off")


@pytest.mark.parametrize("overlap_step", [True, False])
def test_a_window_runs_one_accumulation_job_fewer(monkeypatch, overlap_step):
    """U=4, 8 steps: 3 accumulation jobs and 1 host AdamW job per window (the unfolded schedule ran 4 and 1)."""
    jobs: list[str] = []
    submit = HostAdamWorker.submit

    def spy(self, what, fn):
        jobs.append(what)
        return submit(self, what, fn)

    monkeypatch.setattr(HostAdamWorker, "submit", spy)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, update_interval=4, overlap_step=overlap_step, **SETTINGS)
    train(model, opt, batches(8), clip=1.0)
    opt.synchronize()
    opt.close()
    assert jobs.count("host_adamw") == 2
    assert jobs.count("accumulate") == 6


@pytest.mark.parametrize(("accumulate_on", "overlap_step", "interval"), [
    ("host", True, 4), ("host", False, 3), ("host", True, 1), ("device", True, 4), ("host", True, "auto"),
])
def test_the_one_pass_kernel_gives_the_bits_of_the_torch_passes(monkeypatch, accumulate_on, overlap_step, interval):
    """The same run with the one-pass kernel and with torch's add, division and fused AdamW (the fallback), with fp32
    host moments (bf16 ones: tests/engine/test_low_precision.py)."""
    runs = []
    kernel = host_module.kernels.window_adamw
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(host_module.kernels, "window_adamw_available", lambda: False)
        calls: list[int] = []

        def counted(*args, calls=calls, **kwargs):
            calls.append(1)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(host_module.kernels, "window_adamw", counted)
        model = make_model()
        opt = zenflow_adamw(param_groups(model), lr=1e-2, update_interval=interval, overlap_step=overlap_step,
                            accumulate_on=accumulate_on, auto_max_interval=5, **SETTINGS, **FP32_MOMENTS)
        losses = train(model, opt, batches(18), linear_schedule(opt, 18), clip=1.0)
        opt.flush()
        opt.close()
        runs.append((model, losses, len(calls)))
    (fused_model, fused_losses, fused_calls), (torch_model, torch_losses, torch_calls) = runs
    monkeypatch.undo()
    if host_module.kernels.window_adamw_available():
        assert fused_calls > 0  # (the kernel ran; without the CPU kernels both runs take torch's passes)
    assert torch_calls == 0
    assert fused_losses == torch_losses
    assert all(torch.equal(p, q) for p, q in zip(fused_model.parameters(), torch_model.parameters()))
