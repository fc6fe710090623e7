"""torch.compile and CUDA graphs (`hf_zenflow.engine.graph_guard`): compiling the model's forward trains as without
it; a backward traced by compiled autograd, a gradient that a CUDA graph's replay overwrites, and a backward or a
`step()` captured into a CUDA graph are refused, naming what to do instead. (The CUDA facts are doubles here: the
flag CUDA graph trees set on their outputs, and the capture state of the current stream.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.conftest import DEVICE, batches, make_model, param_groups, zenflow_adamw
from tests.engine.test_free_gradients import _run as run_training


def _loss(forward: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = forward(x.to(DEVICE)).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1))


def test_a_compiled_forward_trains_as_without_compiling():
    """`torch.compile(model)` (AOTAutograd, whose backward graph is one autograd node): the parameters' gradients
    are still accumulated and their hooks called eagerly, so the hooks free the gradients (a lower peak than with
    freeing off) and the weights are those of the run without compiling, bit for bit (``aot_eager`` runs the same
    kernels as eager)."""
    def compiled(model: torch.nn.Module) -> Callable:
        torch._dynamo.reset()
        return torch.compile(model, backend="aot_eager")

    eager, _, _ = run_training("on", steps=8, high_lr_rule="off")
    compiled_weights, _, freed_peaks = run_training("on", steps=8, forward=compiled, high_lr_rule="off")
    _, _, kept_peaks = run_training("off", steps=8, forward=compiled, high_lr_rule="off")
    for a, b in zip(compiled_weights, eager):
        assert torch.equal(a, b)
    assert all(f < k for f, k in zip(freed_peaks[1:], kept_peaks[1:]))


@pytest.mark.parametrize("how", ["context", "config"])
def test_compiled_autograd_is_refused(how):
    """Compiled autograd traces the post-accumulate-grad hooks, whose side effects (a copy to the host started, the
    gradient freed) belong to each run: the first hook refuses, naming the forward-only compile instead."""
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, min_offload_numel=0)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"compiled autograd.*torch\.compile\(model\) without compiled autograd"):
        if how == "context":
            with compiled_autograd._enable(torch.compile(backend="eager")):
                _loss(model, x, y).backward()
        else:
            # (the config's own patch: a monkeypatch of the config module leaves a stale attribute behind it)
            with torch._dynamo.config.patch(compiled_autograd=True):

                @torch.compile(backend="eager")
                def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
                    _loss(model, x, y).backward()

                train_step(x, y)
    torch._dynamo.reset()
    opt.close()


def test_a_gradient_in_cuda_graph_memory_is_refused(monkeypatch):
    """A gradient that is a CUDA graph tree's output (``mode="reduce-overhead"``; those outputs carry torch's
    "cached tensor" flag, which lets ``.grad`` take them over): the graph's next replay overwrites it, whatever
    `record_stream` says, so its hook refuses, naming the modes without CUDA graphs."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, min_offload_numel=0)
    x, y = batches(1)[0]
    loss = _loss(model, x, y)
    monkeypatch.setattr(torch._C, "_is_cached_tensor", lambda t: True)  # (the double: every gradient is one)
    with pytest.raises(RuntimeError, match=r"CUDA graph's memory.*max-autotune-no-cudagraphs"):
        loss.backward()
    opt.close()


def test_a_cuda_graph_capture_is_refused_in_backward_and_in_step(monkeypatch):
    """Inside ``torch.cuda.graph`` (the current stream capturing) a backward hook and `step()` refuse: a replay would
    repeat none of the host's part."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, min_offload_numel=0)
    x, y = batches(1)[0]
    loss = _loss(model, x, y)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match=r"CUDA graph capture.*backward hook"):
            loss.backward()
    opt.zero_grad()
    _loss(model, x, y).backward()
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_initialized", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match=r"CUDA graph capture.*step\(\)"):
            opt.step()
    opt.step()  # (outside the capture: the step goes on)
    opt.close()
