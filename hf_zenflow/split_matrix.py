"""`SplitMatrix`: one weight matrix under ZenFlow, its selected columns on the device and its host state.

Either side may be absent: no device columns before the first selection (or with ``topk_ratio=0``), no host state
when every column lives on the device (``topk_ratio=1``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .device_step import DenseDeviceState, DeviceColumns
from .host import HostMatrix
from .schedule import ZenAutoStats
from .selection import column_scores, selection_axis, storage_matrix, top_columns
from .transport import Transport


class SplitMatrix:
    """One matrix: its device columns and its host state (either may be absent)."""

    __slots__ = ("param", "rows", "axis", "k", "columns", "device", "host", "auto", "window_sum", "window_count",
                 "window_sum_free")

    def __init__(self, param: torch.Tensor, k: int, rows: bool = False) -> None:
        self.param = param
        # rows: the param group's `select_rows` (an embedding table, whose input channels are its rows: tokens)
        self.rows = rows
        self.axis = 0 if rows else selection_axis(param)
        assert self.axis is not None
        self.columns = self.matrix(param).shape[self.axis]
        self.k = k
        self.device: DeviceColumns | None = None
        self.host: HostMatrix | None = None
        self.auto = ZenAutoStats()
        # accumulate_on="device": the open window's fp32 gradient sum on the parameter's device, the steps in it,
        # and (CUDA) the event after which its last device->host copy has read it
        self.window_sum: torch.Tensor | None = None
        self.window_count = 0
        self.window_sum_free: Any = None

    def matrix(self, t: torch.Tensor) -> torch.Tensor:
        """The parameter, or its gradient, as this matrix's contiguous `storage_matrix` (host state has its shape):
        dimension `axis` indexes the selectable units."""
        return storage_matrix(t, 1) if self.rows else storage_matrix(t, self.axis)

    def unmatrix(self, m: torch.Tensor) -> torch.Tensor:
        """Inverse of `matrix`: a storage matrix viewed in the parameter's shape and layout."""
        return m.view(self.param.shape) if self.rows or self.axis == 1 else m.t()

    def attach_host(self, accumulate_on: str, transport: Transport | None = None) -> None:
        """Create the host state, its link buffers from `transport` (and, accumulating on the device, the
        device-side window sum)."""
        p2d = self.matrix(self.param)
        self.host = HostMatrix.create(p2d, self.grad_dtype, accumulate_on, transport)
        if accumulate_on == "device":
            self.window_sum = torch.zeros(p2d.shape, dtype=torch.float32, device=self.param.device)
            self.window_count = 0

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.param.dtype if self.param.grad is None else self.param.grad.dtype

    def detach_host(self) -> None:
        self.host, self.window_sum, self.window_count, self.window_sum_free = None, None, 0, None

    @property
    def offloaded(self) -> bool:
        """True when some columns live on the host (k < in)."""
        return self.k < self.columns

    @torch.no_grad()
    def full_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 master, exp_avg and exp_avg_sq of every column, as host `storage_matrix` tensors (new tensors): the
        host state with the device columns on top. Before any state exists: the weights and zero moments."""
        if self.host is not None:
            master, m, v = (t.clone() for t in (self.host.master, self.host.exp_avg, self.host.exp_avg_sq))
        else:
            master = self.matrix(self.param.detach()).float().cpu().clone()
            m, v = torch.zeros_like(master), torch.zeros_like(master)
        if self.device is not None:
            cols = self.device
            index = cols.index.cpu()
            for full, part in ((master, cols.master), (m, cols.exp_avg), (v, cols.exp_avg_sq)):
                full.index_copy_(self.axis, index, part.cpu())
        return master, m, v

    def select(self, grad: torch.Tensor, scores: torch.Tensor | None,
               attach_host: Callable[[list[SplitMatrix]], None]) -> None:
        """Choose this matrix's device columns from `grad` (or precomputed `scores`) and migrate the state to match:
        the outgoing device columns' master values and moments go to the host state, the incoming columns' come
        from it (no reset). The caller has drained the host worker. `attach_host` creates the host state when all
        columns were on the device so far."""
        split = self
        p = split.param
        if split.host is None and split.offloaded:
            # every column was on the device (a resumed run with a lower topk_ratio): the host state starts from the
            # weights and takes every device column below
            attach_host([split])
        host = split.host
        # Sync point (re-selection only, every `select_period` steps): the outgoing device columns are copied to the
        # host and the incoming ones up with blocking copies; the worker was drained by the caller first.
        axis = split.axis
        if split.device is not None and host is not None:
            idx = split.device.index.cpu()
            host.master.index_copy_(axis, idx, split.device.master.cpu())
            host.exp_avg.index_copy_(axis, idx, split.device.exp_avg.cpu())
            host.exp_avg_sq.index_copy_(axis, idx, split.device.exp_avg_sq.cpu())
            if split.k == 0:
                split.device = None  # (topk_ratio now 0) every column lives on the host
        if split.k == 0 or (split.device is not None and split.device.k == split.k == split.columns):
            return  # nothing on the device, or every column already there
        if split.offloaded:
            scores = column_scores(split.matrix(grad), axis) if scores is None else scores
            # Sync point (selection only): an all-zero gradient ranks nothing (LoRA's lora_A at its first step, while
            # lora_B is still zero). Keep the current columns, or none yet: `_select_new_matrices` retries at the
            # next step whose gradient of this matrix is not zero.
            if not bool(scores.any()):
                return
            index = top_columns(scores, split.k)
        else:
            index = torch.arange(split.k, device=p.device)
        if split.device is not None:
            step = split.device.step  # most device columns stay: keep the device path's count
        elif host is not None:
            step = host.step
        else:
            step = torch.zeros(())
        if host is not None:
            cpu_idx = index.cpu()
            cols = [t.index_select(axis, cpu_idx) for t in (host.master, host.exp_avg, host.exp_avg_sq)]
        else:
            master = split.matrix(p).detach().index_select(axis, index).float()
            cols = [master, torch.zeros_like(master), torch.zeros_like(master)]
        split.device = DeviceColumns.from_columns(index, *cols, step=step, device=p.device, axis=axis)
        if not split.offloaded:
            split.detach_host()  # every column on the device (topk_ratio=1): the host keeps nothing
        split.auto.reset()


def master_value(param: torch.Tensor, splits: dict[torch.Tensor, SplitMatrix],
                 dense: dict[torch.Tensor, DenseDeviceState]) -> torch.Tensor:
    """The fp32 master value of `param` on the host, in its shape: host columns from the host master, device columns
    from the device, a parameter without optimizer state from its weights."""
    if param in dense:
        return dense[param].master_of(param).detach().float().cpu().clone()
    split = splits.get(param)
    if split is None:
        return param.detach().float().cpu().clone()
    return split.unmatrix(split.full_state()[0])
