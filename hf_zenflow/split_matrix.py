"""`SplitMatrix`: one weight matrix under ZenFlow, its selected columns on the device and its host state.

Either side may be absent: no device columns before the first selection (or with ``topk_ratio=0``), no host state
when every column lives on the device (``topk_ratio=1``).
"""

from __future__ import annotations

from typing import Any

import torch

from .device_step import DeviceColumns
from .host import HostMatrix
from .schedule import ZenAutoStats
from .selection import selection_axis, storage_matrix
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
