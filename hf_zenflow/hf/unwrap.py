"""The `ZenFlowAdamW` behind a wrapped optimizer: the Trainer, its callbacks and `ZenFlowPlugin` are handed
accelerate's `AcceleratedOptimizer` (or the bare optimizer) and need the engine itself.

Example:
    >>> import torch
    >>> from hf_zenflow import ZenFlowAdamW
    >>> opt = ZenFlowAdamW([torch.nn.Parameter(torch.zeros(4, 4))], lr=1e-3)
    >>> class Wrapper:  # what an AcceleratedOptimizer looks like from here
    ...     def __init__(self, optimizer): self.optimizer = optimizer
    >>> unwrap_zenflow_optimizer(Wrapper(Wrapper(opt))) is opt
    True
    >>> unwrap_zenflow_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)])) is None
    True
"""

from __future__ import annotations

from typing import Any

from ..optimizer.zenflow import ZenFlowAdamW


#: How many `.optimizer` links are followed: a wrapper chain longer than this (or a cycle) is not a ZenFlow one.
MAX_WRAPPERS = 8


def unwrap_zenflow_optimizer(optimizer: Any) -> ZenFlowAdamW | None:
    """The `ZenFlowAdamW` behind `optimizer` (itself, or reached through up to `MAX_WRAPPERS` ``.optimizer``
    attributes, as an `AcceleratedOptimizer` wraps it), or None when there is none."""
    for _ in range(MAX_WRAPPERS):
        if optimizer is None or isinstance(optimizer, ZenFlowAdamW):
            break
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer if isinstance(optimizer, ZenFlowAdamW) else None


__all__ = ["MAX_WRAPPERS", "unwrap_zenflow_optimizer"]
