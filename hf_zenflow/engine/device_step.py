"""The device path: AdamW every step on the selected columns of each matrix and on every 1-D parameter, and the
per-step reads of the gradients it needs (norms, the selected columns).

The state it updates (`DeviceColumns`, `DenseDeviceState`, all fp32) and the column moves are `device_state.py`.
The selected columns' gradient is gathered in the gradient's dtype (bf16 / fp16 as they are) and widened to fp32
for the update, a few matrices at a time (`device_update`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .._base import by_device, fused_adamw_, l2_norm
from ..transport.cpu_device import kernels
from .device_state import DenseDeviceState, DeviceColumns, gather_columns, runs_within, scatter_columns


if TYPE_CHECKING:
    from .split_matrix import SplitMatrix


def _to(value: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """A number as it is; a tensor on `device` (a non-blocking copy when it lives elsewhere)."""
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def norms_and_gather(
    splits: dict[torch.Tensor, SplitMatrix], entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor],
    gather_now: bool, gathered: set[torch.Tensor],
) -> list[torch.Tensor]:
    """Per-gradient L2 norms, and the selected columns gathered in the same sweep (added to `gathered`).

    On a CPU device one C kernel does both row by row (the strided gather then costs almost nothing on top of
    the streaming read); elsewhere each gradient's norm is followed right away by its gather, so the gather
    finds the gradient in cache where it fits.
    """
    norms: list[torch.Tensor | None] = [None] * len(grads)
    want = [
        (i, split) if gather_now and (split := splits.get(p)) is not None and split.device is not None
        else (i, None)
        for i, (_, p) in enumerate(entries)
    ]
    # the kernels gather the strided columns of row-major matrices; they read any contiguous gradient
    reads = [(i, grads[i] if split is None else split.matrix(grads[i]),
              split if split is not None and split.axis == 1 else None) for i, split in want]
    native = [(i, matrix, split) for i, matrix, split in reads if kernels.supports(matrix)]
    if native and kernels.library() is not None:
        sums = kernels.norms_and_gather(
            [matrix for _, matrix, _ in native],
            [split.device.grad_buffer(matrix.dtype) if split is not None else None for _, matrix, split in native],
            [split.device.index if split is not None else None for _, _, split in native],
        )
        for (i, _, split), total in zip(native, sums):
            norms[i] = torch.tensor(math.sqrt(total), dtype=torch.float32)
            if split is not None:
                gathered.add(entries[i][1])
    for i, split in want:
        if norms[i] is None:
            norms[i] = l2_norm(grads[i])
        if split is not None and entries[i][1] not in gathered:
            # whole rows (column-major weights, `select_rows`), or no kernels: torch's own gather
            split.device.gather_grad(split.matrix(grads[i]))
            gathered.add(entries[i][1])
    return norms  # type: ignore[return-value]


def gather_selected(
    splits: dict[torch.Tensor, SplitMatrix], entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor],
    gathered: set[torch.Tensor],
) -> None:
    """Gather the selected columns of every split matrix with device columns (added to `gathered`)."""
    items = []
    for (_, p), g in zip(entries, grads):
        split = splits.get(p)
        if split is not None and split.device is not None and p not in gathered:
            items.append((split.device, split.matrix(g)))
            gathered.add(p)
    gather_columns(items)


def _fp32_like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`g` in fp32 with `p`'s strides. The fused kernel walks the parameter, its moments and the gradient as flat
    buffers, so they must share one layout: autograd gives a dense parameter's gradient its strides, but a gradient
    set by hand (or by a hook) may be contiguous while the parameter is permuted."""
    if g.stride() == p.stride():
        return g if g.dtype == torch.float32 else g.float()
    return torch.empty_like(p, dtype=torch.float32).copy_(g)


class ParamWrites:
    """The rounded fp32 masters a device update copies into its parameters (selected columns scattered into their
    matrices, dense masters copied into parameters of another dtype), held until the step knows it is not skipped.

    A parameter with an fp32 master of its own is written only by the optimizer: its version counter is the
    optimizer's mark that nobody else changed it (`weight_marks.py`). A skipped step must leave it untouched,
    or the next step would take the skipped step's write for an outside edit and re-read the master from the
    rounded weights (losing the fp32 bits and the open window's gradients)."""

    def __init__(self, scatters: list[tuple[DeviceColumns, torch.Tensor]],
                 dense_copies: list[tuple[torch.Tensor, torch.Tensor]], widened_bytes: int = 0) -> None:
        self._scatters, self._dense_copies = scatters, dense_copies
        #: the most bytes of widened (fp32) gathered gradients the update held at once: transient, gone when it
        #: returns (the device's peak counts them, `DeviceMemoryMeter.note`)
        self.widened_bytes = widened_bytes

    def apply(self) -> None:
        scatter_columns(self._scatters)
        for p, master in self._dense_copies:
            p.copy_(master)
        self._scatters, self._dense_copies = [], []


def _widening_chunks(columns: list[DeviceColumns], gradient_bytes: int) -> list[list[DeviceColumns]]:
    """`columns` whose gathered gradient is narrower than fp32, in consecutive runs whose fp32 copies together take
    no more than `gradient_bytes` (the largest offloaded gradient's: a transient no larger than a gradient in its
    backward hook) or the largest one's: each run is widened by one batched copy and updated in one launch (the
    gather buffers keep the narrow dtype)."""
    if not columns:
        return []
    largest = max(c.grad.numel() for c in columns)
    return runs_within(columns, lambda cols: cols.grad.numel(), max(largest, gradient_bytes // 4))


def device_update(
    splits: dict[torch.Tensor, SplitMatrix], dense: dict[torch.Tensor, DenseDeviceState],
    entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | torch.Tensor | None,
    gathered: set[torch.Tensor], writes_back: bool = False, found_inf: torch.Tensor | None = None,
) -> ParamWrites:
    """Fused AdamW on the selected columns and the dense parameters, one kernel launch per group and device (and,
    for gathered gradients narrower than fp32, one per run of matrices widened together, `_widening_chunks`).
    `coef`: the clip coefficient, a number or a device tensor; `found_inf`: a device tensor that, when set,
    makes the update change nothing. `writes_back`: a write-back follows in this step, so matrices with host
    columns are not scattered now.

    The fp32 masters are updated here; the parameters that have masters of their own receive them when the caller
    applies the returned `ParamWrites`: at once after an update that cannot be skipped any more, and after the
    step's non-finite check when the update was launched before it (with `found_inf`).

    A bf16 / fp16 gathered gradient is widened to fp32 (exact) and then multiplied by `coef` and updated exactly
    as an fp32 gather would be: AdamW is elementwise, so launching a matrix on its own changes no bit."""
    batches: dict[tuple[int, torch.device], tuple[dict, list[list[torch.Tensor]]]] = {}
    narrow: dict[tuple[int, torch.device], list[DeviceColumns]] = {}
    scatters: list[tuple[DeviceColumns, torch.Tensor]] = []
    dense_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    to_gather: list[tuple[DeviceColumns, torch.Tensor]] = []
    updates: list[tuple[dict, torch.Tensor, SplitMatrix | None, torch.Tensor]] = []
    for (group, p), g in zip(entries, grads):
        split = splits.get(p)
        if split is not None:
            if split.device is None:
                continue
            if p not in gathered:
                to_gather.append((split.device, split.matrix(g)))
        updates.append((group, p, split, g))
    gather_columns(to_gather)
    dense_pairs = [(p, _fp32_like(p, g)) for _, p, split, g in updates if split is None]
    dense_grads = [g for _, g in dense_pairs]
    if coef is not None:
        # one batched multiply per kind and device: the selected columns' own fp32 buffers in place (narrower ones
        # once widened, below); the dense parameters' gradients into new tensors (the caller's gradients are never
        # modified)
        selected = [split.device.grad for _, _, split, _ in updates
                    if split is not None and split.device.grad.dtype == torch.float32]
        for _, group in by_device(selected):
            torch._foreach_mul_(group, _to(coef, group[0].device))
        scaled = {id(g): h for _, group in by_device(dense_grads)
                  for g, h in zip(group, torch._foreach_mul(group, _to(coef, group[0].device)))}
        dense_grads = [scaled[id(g)] for g in dense_grads]
    dense_grad = {id(p): g for (p, _), g in zip(dense_pairs, dense_grads)}
    for group, p, split, _ in updates:
        key = (id(group), p.device)
        lists = batches.setdefault(key, (group, [[], [], [], [], []]))[1]
        if split is not None:
            cols = split.device
            if not (writes_back and split.host is not None):
                scatters.append((cols, split.matrix(p)))
            if cols.grad.dtype != torch.float32:
                narrow.setdefault(key, []).append(cols)
                continue
            tensors = (cols.master, cols.grad, cols.exp_avg, cols.exp_avg_sq, cols.step)
        else:
            state = dense[p]
            tensors = (state.master_of(p), dense_grad[id(p)], state.exp_avg, state.exp_avg_sq, state.step)
            if state.master is not None:
                dense_copies.append((p, state.master))  # the parameter receives the rounded fp32 master
        for bucket, t in zip(lists, tensors):
            bucket.append(t)
    widened_bytes = 0
    gradient_bytes = max((p.numel() * p.element_size() for _, p, split, _ in updates if split is not None), default=0)
    for key, (group, (params, gs, m, v, steps)) in batches.items():
        device = key[1]
        flag = None if found_inf is None else _to(found_inf, device)
        fused_adamw_(params, gs, m, v, steps, group, found_inf=flag)
        chunks = _widening_chunks(narrow.get(key, []), gradient_bytes)
        if not chunks:
            continue
        # One fp32 scratch for the runs' widened copies, reused run after run (one allocation per group and device,
        # not one per matrix), dropped after the group's last run. CUDA: every copy into it, the multiply and the
        # AdamW that reads it are queued on the current stream, so a run's copies wait for the previous run's
        # kernel, and the caching allocator reuses the block only for work queued after that kernel.
        size = max(sum(c.grad.numel() for c in chunk) for chunk in chunks)
        scratch = torch.empty(size, dtype=torch.float32, device=device)
        widened_bytes = max(widened_bytes, size * scratch.element_size())
        for chunk in chunks:
            wide, start = [], 0
            for cols in chunk:
                n = cols.grad.numel()
                wide.append(scratch[start:start + n].view(cols.grad.shape))
                start += n
            torch._foreach_copy_(wide, [cols.grad for cols in chunk])  # (exact; one batched copy per run)
            if coef is not None:
                torch._foreach_mul_(wide, _to(coef, device))
            fused_adamw_([c.master for c in chunk], wide, [c.exp_avg for c in chunk],
                         [c.exp_avg_sq for c in chunk], [c.step for c in chunk], group, found_inf=flag)
        del scratch
    return ParamWrites(scatters, dense_copies, widened_bytes)
