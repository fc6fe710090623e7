"""Column-major weights: DeepSpeed ZenFlow's transposed layout, for a model whose "device" is the CPU.

ZenFlow moves input columns of each weight ``W[out, in]``: every step the selected columns are gathered from the
gradient and written into the weight, every re-selection columns migrate. In PyTorch's row-major layout a column is
strided, and 10 % of the columns touch ~80 % of the matrix's cache lines, so on a CPU device each of those moves
costs nearly a pass over the whole matrix. DeepSpeed stores 2-D tensors transposed in its flat buffers (and ZeRO-3
replaces every 2-D parameter with a contiguous transpose) so that a column is a contiguous run.

`column_major_` does the same in place for the weights of `nn.Linear` modules: each keeps its shape and values,
only its strides change (``weight.t()`` becomes contiguous). `torch.nn.functional.linear` multiplies with either
layout at the same speed, and autograd gives each gradient its parameter's strides, so `ZenFlowAdamW` then finds
every input column contiguous in the weight, its gradient and its host state. On a GPU the gather and scatter are
cheap either way; this is for CPU devices (and costs nothing elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .params import offloads


if TYPE_CHECKING:
    from ..settings.config import ZenFlowConfig


@torch.no_grad()
def column_major_(model: torch.nn.Module, config: ZenFlowConfig | None = None) -> list[str]:
    """Store the weight of every trainable `nn.Linear` in `model` column-major, in place; returns the names converted.

    Only weights the optimizer will move columns of are re-laid: frozen weights (``requires_grad=False``: a LoRA
    base model) are left alone, and with a `config` so is every weight it does not offload (below
    ``min_offload_numel``, or ``topk_ratio=1``: `params.offloads`), so a run that offloads nothing keeps the layout
    it had. Weights shared with an `nn.Embedding` (a tied LM head) are left row-major: an embedding lookup reads
    rows, which this layout would scatter over memory. Call it before creating the optimizer (its state is laid out
    like each parameter when first created); checkpoints of `ZenFlowAdamW` load across layouts.

    Example:
        >>> import torch
        >>> from hf_zenflow import ZenFlowAdamW, column_major_
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        >>> column_major_(model)
        ['0.weight', '2.weight']
        >>> model[0].weight.t().is_contiguous()
        True
        >>> opt = ZenFlowAdamW(model.parameters(), lr=1e-3)
    """
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    converted: list[str] = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if id(weight) in embedded or id(weight) in seen or weight.ndim != 2 or not weight.requires_grad:
            continue
        if config is not None and not offloads(weight, {}, config):
            continue
        seen.add(id(weight))
        if weight.is_contiguous() and weight.shape[0] > 1 and weight.shape[1] > 1:
            weight.data = weight.data.t().contiguous().t()
        if weight.t().is_contiguous():
            converted.append(f"{module_name}.weight" if module_name else "weight")
    return converted
