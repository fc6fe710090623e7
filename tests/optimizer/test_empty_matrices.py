"""Zero-size parameters train as torch's AdamW trains them (nothing to update) beside the others."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import ZenFlowAdamW


@pytest.mark.parametrize("shape", [(8, 0), (0, 8), (0,)])
@pytest.mark.parametrize("min_offload_numel", [0, 1 << 18])
def test_an_empty_matrix_is_accepted_and_the_rest_trains_as_adamw(shape, min_offload_numel):
    """Repro: ``nn.Parameter(torch.randn(8, 0))`` was refused at construction as "a view with gaps in memory"
    (torch's AdamW accepts it)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)), torch.nn.Parameter(torch.randn(8)),
              torch.nn.Parameter(torch.randn(16, 16))]
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    opt = ZenFlowAdamW(params, lr=1e-3, topk_ratio=1.0, min_offload_numel=min_offload_numel)
    adamw = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    for _ in range(4):
        for ps, o in ((params, opt), (ref, adamw)):
            (ps[0].sum() + ps[1].square().sum() + ps[2].square().sum()).backward()
            o.step()
            o.zero_grad()
    opt.flush()
    opt.close()
    assert params[0].shape == torch.Size(shape)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
