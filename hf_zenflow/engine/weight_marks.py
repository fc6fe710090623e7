"""Weights changed from outside the optimizer (``model.load_state_dict``, the Trainer's ``load_best_model_at_end``,
an in-place edit): noticed through each parameter's version counter and storage, and answered by re-reading the fp32
masters from the weights; and FSDP2 shards re-allocated under the optimizer (`rekey`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .split_matrix import SplitMatrix


if TYPE_CHECKING:
    from .device_state import DenseDeviceState
    from .worker import HostAdamWorker

logger = logging.getLogger("hf_zenflow.optimizer")


class WeightMarks:
    """The (version counter, storage) of every parameter with an fp32 master of its own, as the optimizer left it
    after its last write; a parameter whose mark differs now was changed from outside."""

    def __init__(self) -> None:
        self._marks: dict[torch.Tensor, tuple[int, int]] = {}
        self._told = False

    def mark(self, splits: dict[torch.Tensor, SplitMatrix], dense: dict[torch.Tensor, DenseDeviceState]) -> None:
        marks = {p: (p._version, p.data_ptr()) for p in splits}
        marks.update({p: (p._version, p.data_ptr()) for p, d in dense.items() if d.master is not None})
        self._marks = marks

    def changed(self) -> list[torch.Tensor]:
        return [p for p, mark in self._marks.items() if (p._version, p.data_ptr()) != mark]

    def tell_once(self, count: int) -> None:
        if not self._told:
            self._told = True
            logger.warning(
                "ZenFlowAdamW: %d parameter(s) were changed outside the optimizer (model.load_state_dict, "
                "load_best_model_at_end, an in-place edit...): their fp32 masters are re-read from the weights; "
                "host results and window gradients still pending for them are dropped.", count,
            )


@torch.no_grad()
def reread_masters(params: list[torch.Tensor], splits: dict[torch.Tensor, SplitMatrix],
                   dense: dict[torch.Tensor, DenseDeviceState], worker: HostAdamWorker | None) -> None:
    """Set the fp32 masters of `params` to their weights. Moments are kept; what was computed from the old weights
    and is not in them yet (a pending host result, the open window's gradient sum) is dropped."""
    if worker is not None:
        worker.synchronize()  # Sync point: the worker must not be writing the host masters replaced here
    for p in params:
        state = dense.get(p)
        if state is not None:
            if state.master is not None:
                state.master.copy_(p.detach())
            continue
        split = splits.get(p)
        if split is None:
            continue
        current = split.matrix(p.detach())
        if split.host is not None:
            host, part = split.host, split.share.local(current)
            host.master.copy_(part)
            if host.writeback_free is not None:
                host.writeback_free.synchronize()  # type: ignore[attr-defined]  # a write-back copy still reads it
            host.writeback.copy_(part)  # a pending write-back now rewrites these very values
            host.writeback_fresh = False
            # the open window's gradients were taken at the old weights: dropped, as the pending result is
            host.accum_count, split.window_count = 0, 0
        if split.device is not None:
            cols = split.device
            cols.master.copy_(current.index_select(cols.axis, cols.index))


def rekey(moves: list[tuple[torch.Tensor, torch.Tensor]], tables: Iterable[dict[torch.Tensor, Any]]
          ) -> list[torch.Tensor]:
    """Move each state entry of `tables` from an old local tensor to its new one (a `SplitMatrix` also points at
    it); returns the new tensors, whose masters must be re-read from the weights."""
    moved = []
    for old, new in moves:
        for table in tables:
            if old in table:
                state = table[new] = table.pop(old)
                if isinstance(state, SplitMatrix):
                    state.param = new
                moved.append(new)
    return moved
