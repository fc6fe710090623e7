"""The device side's state: the selected columns of a matrix (`DeviceColumns`: index, fp32 master values and
moments) and the whole-parameter state of a 1-D or small parameter (`DenseDeviceState`), and moving columns between
them and the weights and gradients (`gather_columns`, `scatter_columns`; the CPU kernels where they apply).

All device-side optimizer state is fp32 (master values and both moments), whatever the parameter dtype, so a bf16
model never has its master truncated: the parameter only ever receives a rounded copy of the fp32 master. The
selected columns' gathered gradient keeps the gradient's own dtype when that is bf16 or fp16 (a gather is a copy:
nothing is lost), 2 B per selected element instead of 4; whatever reads it widens it to fp32 first (one matrix at a
time, `DeviceColumns.widened_grad`; the update a run of matrices at a time) and computes exactly as on an fp32
gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..transport.cpu_device import kernels


#: gradient dtypes the selected columns are gathered in as they are (anything else is gathered in fp32)
NARROW_GRAD_DTYPES = (torch.bfloat16, torch.float16)


def gathered_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype the selected columns of a `grad_dtype` gradient are gathered in: bf16 and fp16 as they are (their
    widening to fp32 is exact, so it can wait until the columns are used), anything else fp32."""
    return grad_dtype if grad_dtype in NARROW_GRAD_DTYPES else torch.float32


@dataclass
class DeviceColumns:
    """fp32 master values and moments of the selected columns of one matrix, on the parameter's device, and the
    buffer their gradient is gathered into (`grad`, in `gathered_dtype` of the gradient's dtype).

    `index` holds the selected input columns, sorted. `axis` is the dimension of the matrix's `storage_matrix`
    that indexes input columns: every tensor here is [out, k] (axis 1, row-major parameter) or [k, out] (axis 0,
    column-major parameter, where each selected column is a contiguous row).
    """

    index: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    grad: torch.Tensor  # reused gather buffer (fp32, or the gradient's bf16 / fp16)
    axis: int = 1
    #: `index` on the host, when known (`host_index`): reading it there again costs no device sync
    index_on_host: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_columns(
        cls, index: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
        step: torch.Tensor, device: torch.device, axis: int = 1, grad_dtype: torch.dtype = torch.float32,
        index_on_host: torch.Tensor | None = None,
    ) -> DeviceColumns:
        """The columns `index` with their state (any dtype, moved to fp32 on `device`); `grad_dtype`: the dtype of
        the gradients that will be gathered (the buffer is `gathered_dtype` of it); `index_on_host`: the same
        index on the host, when the caller has it."""
        to = {"device": device, "dtype": torch.float32}
        master = master.to(**to).contiguous()
        if index_on_host is None and index.device.type == "cpu":
            index_on_host = index
        index = index.to(device)
        return cls(
            index=index, master=master, exp_avg=exp_avg.to(**to).contiguous(),
            exp_avg_sq=exp_avg_sq.to(**to).contiguous(), step=step.to(**to).clone(),
            grad=torch.empty_like(master, dtype=gathered_dtype(grad_dtype)), axis=axis, index_on_host=index_on_host,
        )

    def host_index(self) -> torch.Tensor:
        """`index` on the host (Sync point, the first time only, where `index` lives on an accelerator and the
        host copy was not given: a blocking copy)."""
        if self.index_on_host is None:
            self.index_on_host = self.index.cpu()
        return self.index_on_host

    @property
    def k(self) -> int:
        return self.index.numel()

    def grad_buffer(self, grad_dtype: torch.dtype) -> torch.Tensor:
        """The gather buffer for a gradient of `grad_dtype` (made anew, once, when the gradients' dtype is not the
        one the buffer was made for)."""
        dtype = gathered_dtype(grad_dtype)
        if self.grad.dtype != dtype:
            self.grad = torch.empty_like(self.master, dtype=dtype)
        return self.grad

    def gather_grad(self, grad2d: torch.Tensor) -> torch.Tensor:
        """Copy the selected gradient columns of the gradient's `storage_matrix` into the buffer (one strided read
        of the gradient with axis 1; contiguous row copies with axis 0)."""
        out = self.grad_buffer(grad2d.dtype)
        if grad2d.dtype == out.dtype:
            torch.index_select(grad2d, self.axis, self.index, out=out)
        else:
            out.copy_(torch.index_select(grad2d, self.axis, self.index))
        return out

    def widened_grad(self) -> torch.Tensor:
        """The gathered gradient in fp32: the buffer itself when it is fp32, else a new fp32 copy (exact), which the
        caller holds only while it uses it."""
        return self.grad if self.grad.dtype == torch.float32 else self.grad.float()

    def scatter_into(self, param2d: torch.Tensor) -> None:
        """Write the (rounded) master columns into the parameter's `storage_matrix`."""
        source = self.master if param2d.dtype == torch.float32 else self.master.to(param2d.dtype)
        param2d.index_copy_(self.axis, self.index, source)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.master, self.exp_avg, self.exp_avg_sq, self.grad))


@dataclass
class DenseDeviceState:
    """AdamW state of a parameter updated entirely on the device (1-D parameters, small matrices, other layouts).

    `master` is an fp32 copy for a parameter of another dtype, and None for an fp32 parameter, which is its own
    master: `master_of` resolves it at every step, so whatever storage the parameter has then is what gets updated.
    """

    master: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor

    @classmethod
    def fresh(cls, param: torch.Tensor) -> DenseDeviceState:
        master = None if param.dtype == torch.float32 else param.detach().float().clone()
        like = param.detach() if master is None else master
        return cls(
            master=master,
            exp_avg=torch.zeros_like(like),
            exp_avg_sq=torch.zeros_like(like),
            step=torch.zeros((), dtype=torch.float32, device=param.device),
        )

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor the update is applied to: the own master, or the fp32 parameter itself."""
        return param.detach() if self.master is None else self.master

    def nbytes(self) -> int:
        own = [self.exp_avg, self.exp_avg_sq] + ([self.master] if self.master is not None else [])
        return sum(t.numel() * t.element_size() for t in own)


def _kernel_split(items: list[tuple[DeviceColumns, torch.Tensor]]) -> tuple[list, list]:
    """(items the CPU kernels take, the rest). The kernels are built only when a CPU tensor needs them. They
    handle the strided columns of row-major matrices; a column-major matrix's columns are contiguous rows, which
    torch's own row gather/scatter moves as fast."""
    native = [(c, t) for c, t in items if c.axis == 1 and kernels.supports(t)]
    if native and kernels.library() is None:
        return [], items
    return native, [(c, t) for c, t in items if not (c.axis == 1 and kernels.supports(t))]


def gather_columns(items: list[tuple[DeviceColumns, torch.Tensor]]) -> None:
    """Gather the selected units of each (columns, gradient `storage_matrix`) pair into `columns.grad`."""
    native, rest = _kernel_split(items)
    if native:
        kernels.norms_and_gather([g for _, g in native], [c.grad_buffer(g.dtype) for c, g in native],
                                 [c.index for c, _ in native])
    for cols, g in rest:
        cols.gather_grad(g)


#: Elements of the rounded masters `scatter_columns` holds at once (in the parameters' dtype): the rounding of a
#: run of matrices is one batched copy, not one per matrix.
ROUNDING_RUN_ELEMS = 1 << 24


def runs_within(items: list[Any], numel: Callable[[Any], int], limit: int) -> list[list[Any]]:
    """`items` in consecutive runs of at most `limit` elements together (`numel` of each), or of one item when it
    alone is larger."""
    runs: list[list[Any]] = []
    size = 0
    for item in items:
        if not runs or (runs[-1] and size + numel(item) > limit):
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += numel(item)
    return runs


def scatter_columns(items: list[tuple[DeviceColumns, torch.Tensor]]) -> None:
    """Write each matrix's (rounded) master units into its parameter's `storage_matrix`. Masters rounded to a
    narrower parameter dtype are rounded a run at a time (`ROUNDING_RUN_ELEMS`) by one batched copy (the same
    rounding to nearest as ``Tensor.to``), then scattered one matrix at a time."""
    native, rest = _kernel_split(items)
    if native:
        kernels.scatter([p for _, p in native], [c.master for c, _ in native], [c.index for c, _ in native])
    narrow: dict[tuple[torch.device, torch.dtype], list[tuple[DeviceColumns, torch.Tensor]]] = {}
    for cols, p in rest:
        if p.dtype == torch.float32:
            cols.scatter_into(p)
        else:
            narrow.setdefault((p.device, p.dtype), []).append((cols, p))
    for (_, dtype), group in narrow.items():
        for run in runs_within(group, lambda item: item[0].master.numel(), ROUNDING_RUN_ELEMS):
            rounded = [torch.empty_like(cols.master, dtype=dtype) for cols, _ in run]
            torch._foreach_copy_(rounded, [cols.master for cols, _ in run])
            for (cols, p), source in zip(run, rounded):
                p.index_copy_(cols.axis, cols.index, source)


__all__ = ["NARROW_GRAD_DTYPES", "DenseDeviceState", "DeviceColumns", "gather_columns", "gathered_dtype",
           "runs_within", "scatter_columns"]
