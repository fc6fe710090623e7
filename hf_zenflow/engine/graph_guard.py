"""Where ZenFlow's gradient hooks and `step()` cannot run, refused with what to do instead: a backward traced by
compiled autograd, and CUDA graphs.

- **Compiled autograd** (``torch._dynamo.config.compiled_autograd``, ``compiled_autograd._enable``) traces the
  post-accumulate-grad hooks into the backward graph. ZenFlow's hooks have side effects that belong to each run, not
  to a graph: they start the gradient's copy to the host, may set ``p.grad`` to None, and share a hand-off slot with
  the host worker's thread. `torch.compile(model)` of the forward is another matter: AOTAutograd's backward is one
  autograd node, after which the parameters' gradients are accumulated and their hooks called eagerly, as without it.
- **CUDA graphs.** A graph replay writes its outputs into the same memory every time, whatever `record_stream` says,
  while the copy of a gradient to the host runs on a side stream that the replay does not wait for. So a gradient
  that is a CUDA graph tree's output (``torch.compile(mode="reduce-overhead")``: torch flags those outputs "cached",
  which lets the parameters' ``.grad`` take them over) is refused in its hook, from the first replay on (the runs
  that record the graph give ordinary tensors), and so is a backward or a `step()` captured into a graph
  (``torch.cuda.graph``: a replay would repeat none of the host's part). Not seen here: the gradients of
  ``torch.cuda.make_graphed_callables``, which ``.grad`` takes over as aliases of the graph's static buffers
  (nothing flags them).

Each check is a Python flag or a host-side CUDA query: no kernel launch, no sync.
"""

from __future__ import annotations

import sys

import torch


__all__ = ["refuse_captured_step", "refuse_traced_hook"]


COMPILED_AUTOGRAD = (
    "ZenFlowAdamW cannot run under compiled autograd (torch._dynamo.config.compiled_autograd or "
    "torch._dynamo.compiled_autograd._enable): its backward hooks start each gradient's copy to the host and may free "
    "it, side effects of each run that a compiled backward graph would trace. Compile the model's forward only "
    "(torch.compile(model) without compiled autograd): its backward still calls the hooks as without compiling.")
GRAPH_OUTPUT = (
    "ZenFlowAdamW got a gradient of shape {shape} that lives in a CUDA graph's memory "
    "(torch.compile(mode='reduce-overhead') or another CUDA graph tree): the graph's next replay overwrites it "
    "while its copy to the host may still read it. Use torch.compile's default mode or "
    "mode='max-autotune-no-cudagraphs'.")
CAPTURE = (
    "ZenFlowAdamW cannot run inside a CUDA graph capture (torch.cuda.graph): its {where} copies gradients to the "
    "host, waits on events and reads results on the host, which a replay of the graph would not repeat. Keep "
    "backward and step() out of CUDA graphs.")


def _in_compiled_autograd() -> bool:
    # (a flag compiled autograd sets while its backward graph runs; the module is loaded by whoever enables it)
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (False while CUDA is not initialised)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def refuse_traced_hook(g: torch.Tensor | None) -> None:
    """Called first in each gradient hook, with the gradient `g` (``p.grad``): raise `RuntimeError` under compiled
    autograd, for a gradient that is a CUDA graph tree's output, or inside a CUDA graph capture."""
    if _in_compiled_autograd():
        raise RuntimeError(COMPILED_AUTOGRAD)
    if g is not None and torch._C._is_cached_tensor(g):
        # (CUDA graph trees mark their outputs "cached" so that autograd may take them over as ``.grad``)
        raise RuntimeError(GRAPH_OUTPUT.format(shape=tuple(g.shape)))
    if _capturing():
        raise RuntimeError(CAPTURE.format(where="backward hook"))


def refuse_captured_step() -> None:
    """Called first in `step()`: raise `RuntimeError` inside a CUDA graph capture."""
    if _capturing():
        raise RuntimeError(CAPTURE.format(where="step()"))
