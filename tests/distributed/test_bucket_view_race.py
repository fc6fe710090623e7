"""DDP with ``gradient_as_bucket_view=True``, on the asynchronous CPU double of a CUDA device (on CUDA: CUDA's own
transport, against the same run with every copy synchronous): each gradient the step hands to the host is a view of
a bucket that the next backward's reducer writes into on the compute stream. The caching allocator's
`record_stream` cannot protect a view it never frees, so the copy to the host must have read the bucket before the
compute stream writes it again."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow.transport import CopyTransport, CudaTransport
from tests.conftest import DEVICE, batches, make_model, param_groups, zenflow_adamw
from tests.doubles.async_device import AsyncCopies, CheckedRegistrar


def _train(steps: int, double: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], int]:
    """`double`: copies that land late (the CPU: the double; CUDA: its own transport), else the reference (the CPU
    device's transport; CUDA: every copy synchronous)."""
    backends: list[AsyncCopies] = []
    if DEVICE.type != "cpu":
        if not double:
            monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    elif double:
        def make(device: torch.device) -> CudaTransport:
            # lazy: a copy runs only when something waits for it, i.e. as late as CUDA may run it
            backend = AsyncCopies(seed=len(backends), lazy=True)
            backends.append(backend)
            return CudaTransport(streams=backend, registrar=CheckedRegistrar(backend))

        monkeypatch.setattr("hf_zenflow.transport.transport_for", make)
    model = make_model()
    params = list(model.parameters())
    opt = zenflow_adamw(param_groups(model), lr=1e-2, topk_ratio=0.1, update_interval=2, min_offload_numel=0,
                        accumulate_on="host", select_strategy="step", select_interval=4)
    # DDP's reducer rewrites each gradient after the hooks: they read nothing, step() reads the reduced gradients
    opt._reads.reduced_later = lambda: True
    # one bucket for every gradient, as DDP's reducer keeps it across steps
    bucket = torch.zeros(sum(p.numel() for p in params), device=DEVICE)
    views, offset = [], 0
    for p in params:
        views.append(bucket[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    for x, y in batches(steps):
        logits = model(x.to(DEVICE))
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1)).backward()
        with torch.no_grad():
            for p, view in zip(params, views):  # the reducer: into the bucket (compute stream), p.grad its view
                view.copy_(p.grad)
                p.grad = view
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.flush()
    opt.close()
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()
    return [p.detach().clone() for p in params], sum(b.torn_reads for b in backends)


def test_bucket_views_are_read_before_the_next_backward_writes_them(monkeypatch):
    reference, _ = _train(8, double=False, monkeypatch=monkeypatch)
    weights, torn = _train(8, double=True, monkeypatch=monkeypatch)
    assert torn == 0
    for a, b in zip(weights, reference):
        assert torch.equal(a, b)
