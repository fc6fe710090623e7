"""What travels with one step's gradients on their way to the host worker: the hand-off slot, the pairs handed off,
what the host job reads and waits for (`HandOff`), and the copies the backward hooks started early (`EarlyCopies`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..distributed.sharding import is_dtensor
from ..transport.link import Landed
from .worker import GradSlot


if TYPE_CHECKING:
    from .host import HostMatrix
    from .split_matrix import SplitMatrix


@dataclass
class HandOff:
    """One step's gradients on their way to the host worker: the slot they hold, the (matrix, gradient) pairs,
    what the host job reads and what it waits for."""

    grant: GradSlot
    work: list[tuple[SplitMatrix, torch.Tensor]]
    sources: list[tuple[HostMatrix, torch.Tensor]]
    landed: Landed
    done: bool = False  # submitted or abandoned: the slot is accounted for
    #: sources copied in backward before a GradScaler's ``unscale_``: still scaled, the host multiplies them by the
    #: inverse scale (`HeldHandOff`) instead of copying them again
    scaled: list[tuple[HostMatrix, torch.Tensor]] = field(default_factory=list)


@dataclass
class FreedGradient:
    """A gradient that left the device in its backward hook (`HostWindows.grad_ready`): the empty stand-in `step()`
    sees in its place (its dtype and device; the hooks' norm is keyed by it), the host copy the worker reads, what
    that copy waits for, and the gradient's shape and strides (to bring it back: `restore`)."""

    stand_in: torch.Tensor
    source: torch.Tensor
    landed: Landed
    shape: torch.Size
    stride: tuple[int, ...]
    #: a re-selection's column scores of this gradient (`selection.column_scores_of`), taken in the hook
    scores: torch.Tensor | None = None
    #: the hook gathered the selected columns into the device columns' buffer
    gathered: bool = False
    #: 1.0 where the gradient holds an inf or NaN, else 0.0 (a device scalar), taken in the hook when a GradScaler
    #: is in use (its overflow check cannot see a freed gradient); None when not taken
    overflow: torch.Tensor | None = None
    #: the inverse scale still on the host copy (a GradScaler's ``unscale_`` ran after the hook), or None
    factor: torch.Tensor | None = None

    def restore(self, split: SplitMatrix, device: torch.device) -> torch.Tensor:
        """The gradient again, on `device`, in its own layout, from the host copy (which has landed), unscaled as
        ``unscale_`` unscaled the others when it ran after the hook (`factor`)."""
        out = torch.empty_strided(self.shape, self.stride, dtype=self.stand_in.dtype, device=device)
        split.matrix(out).copy_(self.source)
        if self.factor is not None:
            out.mul_(self.factor.to(device))
        return out

    def gather_selected(self, split: SplitMatrix) -> None:
        """The selected columns of this gradient into the device columns' buffer, from the host copy (which has
        landed): after a re-selection, which chose them from the scores."""
        cols = split.device
        if self.source.device == cols.grad.device:
            cols.gather_grad(self.source)
        else:  # (a copy to the device: the columns only)
            cols.grad_buffer(self.source.dtype).copy_(
                torch.index_select(self.source, cols.axis, cols.index.to(self.source.device)))
        if self.factor is not None:
            cols.grad.mul_(self.factor.to(cols.grad.device))

    def has_overflow(self) -> torch.Tensor:
        """1.0 where this gradient holds an inf or NaN, else 0.0: the hook's flag, or (not taken) read from the
        host copy (which has landed; a pass over it)."""
        if self.overflow is not None:
            return self.overflow
        self.landed.wait()  # Sync point (rare: the first step with a GradScaler): the copy has landed on the host
        return non_finite(self.source)


def non_finite(g: torch.Tensor) -> torch.Tensor:
    """1.0 when `g` holds an inf or NaN, else 0.0, as a scalar on `g`'s device and without a sync: its largest
    magnitude (one read, no temporary) is finite exactly when every element is (what a GradScaler's overflow check
    finds; an L2 norm is no such test, as it can overflow in fp16 on finite values)."""
    if g.numel() == 0:  # (an empty FSDP2 shard)
        return torch.zeros((), device=g.device)
    return (~torch.isfinite(torch.linalg.vector_norm(g, float("inf")))).float()


@dataclass
class EarlyCopies:
    """Gradients whose copy to the host the backward hooks started before `step()` (on a transport that copies):
    the hand-off slot whose buffers they land in, and per parameter the gradient copied (a weak reference), its
    version then, the host buffer and what the host job must wait for."""

    grant: GradSlot
    copies: dict[torch.Tensor, tuple[weakref.ref, int, torch.Tensor, Landed]] = field(default_factory=dict)
    #: the gradients freed in backward, by parameter
    freed: dict[torch.Tensor, FreedGradient] = field(default_factory=dict)
    #: the inverse scale still on these copies (a GradScaler's ``unscale_`` ran after them), or None
    factor: torch.Tensor | None = None


def set_grad(owner: torch.Tensor, grad: torch.Tensor) -> None:
    """``owner.grad = grad``; under FSDP2 (`owner` a DTensor parameter, `grad` its local shard's gradient) as the
    DTensor FSDP2 itself would have set."""
    if is_dtensor(owner):
        from torch.distributed.tensor import DTensor

        grad = DTensor.from_local(grad, owner.device_mesh, owner.placements, run_check=False, shape=owner.shape,
                                  stride=owner.stride())
    owner.grad = grad


def local_grad(owner: torch.Tensor) -> torch.Tensor | None:
    """``owner.grad``, or its local shard under FSDP2."""
    g = owner.grad
    return g._local_tensor if g is not None and is_dtensor(g) else g
