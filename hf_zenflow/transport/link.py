"""Moving data between the device and the host: the interface (`Transport`, `CopyEvents`, what it moves of a matrix:
`LinkedMatrix`, `HostEnd`), and one implementation per kind of device in its own module.

The optimizer hands each step's gradients to the host, ships a window's device-side gradient sums
(``accumulate_on="device"``) and writes host results back into the weights, always through a `Transport`; it never
asks what the device is.

- `cuda.CudaTransport`: asynchronous copies on one side stream per CUDA device, through rings of pinned chunks for
  each step's gradients, a window's device sums and the write-back (`ring.PinnedRing`, `lander.StagingLander`), all
  to and from ordinary host memory; CUDA events
  say when a copy has landed (host jobs wait on them) and when a buffer has been read (its next writer waits on them).
- `copying.CopyTransport`: the same schedule with ordinary synchronous copies and unpinned rings: what
  `CudaTransport` does, minus streams and events. The CPU test suite runs the optimizer with it to check the copying
  logic.
- `cpu_device.transport.CpuDeviceTransport`: the device is the CPU (tests, CI, `hf-zenflow compare` here). Nothing
  is copied where a reference will do: the worker reads the gradient tensors themselves, a window's device-side sum
  becomes the host accumulator by a buffer swap, and the write-back gives the weight the buffer the worker filled as
  its storage. (That is the `Transport` base behaviour.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


__all__ = ["HostEnd", "CopyEvents", "LinkedMatrix", "Transport", "counted_device_wait", "device_wait_ms"]


class HostEnd(Protocol):
    """The host end of one offloaded matrix, as the link sees it: buffers (the engine's `HostMatrix` is one)."""

    accum: torch.Tensor  # the window's gradient sum
    writeback: torch.Tensor | None  # the host result, rounded to the weight's dtype, for the write-back
    writeback_free: object | None  # what the next writer of `writeback` waits for (a CUDA event), or None
    writes_back_master: bool  # `writeback` is the fp32 master itself (no buffer): copied, never taken as storage
    staging: list[torch.Tensor]  # one landing buffer per hand-off slot (when gradients are staged)
    grad_dtype: torch.dtype  # the dtype gradients cross the link in
    #: the columns (along `sum_axis` of the storage matrix) `accum` keeps of a window sum, sorted; None: all of them
    sum_index: torch.Tensor | None
    sum_axis: int


class LinkedMatrix(Protocol):
    """One offloaded matrix, as the link sees it: the weight, its host end, the device-side window sum, and the views
    between the weight's layout and the host's ``[rows, columns]`` storage (the engine's `SplitMatrix` is one). The
    link moves these tensors; it knows nothing of column selection or AdamW state."""

    param: torch.Tensor
    host: HostEnd
    window_sum: torch.Tensor | None
    window_sum_free: Any

    def matrix(self, t: torch.Tensor) -> torch.Tensor: ...

    def unmatrix(self, m: torch.Tensor) -> torch.Tensor: ...

    def host_part(self, t: torch.Tensor) -> torch.Tensor: ...


_waits = threading.local()


@contextlib.contextmanager
def counted_device_wait() -> Iterator[None]:
    """Count the time of the host wait inside (an event's `synchronize`) as this thread's device wait."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _waits.ms = getattr(_waits, "ms", 0.0) + (time.perf_counter() - start) * 1e3


def device_wait_ms() -> float:
    """Milliseconds this thread has waited for the device (`counted_device_wait`) since it started: a host job's
    own time is its wall time minus the growth of this figure."""
    return getattr(_waits, "ms", 0.0)


@dataclass
class CopyEvents:
    """What a host job must wait for before it reads data copied from the device: one CUDA event per device that
    sent something, or nothing (the data is already there)."""

    events: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()  # Sync point (worker waits on the device): the copy has landed on the host


def _owned(part: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`part` (of gradient `g`) as the worker may read it later: itself, unless `g` is a view of storage its owner
    keeps and writes again (DDP's gradient_as_bucket_view: the next backward's reducer writes the same bucket while
    the worker may still read it), which is then copied now."""
    if g._base is not None and part.untyped_storage().data_ptr() == g.untyped_storage().data_ptr():
        return part.clone()
    return part


class Transport:
    """The interface, and the reference-and-swap behaviour of a CPU device (`CpuDeviceTransport`)."""

    #: whether each step's gradient is copied into host staging buffers (one per hand-off slot)
    stages_gradients = False
    #: whether host buffers that cross the link are pinned (asynchronous copies)
    pins_host_memory = False
    #: whether a window's device sum is copied into the host accumulator (so the accumulator may keep only some of
    #: its columns, `HostEnd.sum_index`, gathered on the device) rather than swapped with it (`ship_window_sums`)
    copies_window_sums = False

    def fixed_host_bytes(self, receives_sums: bool = False) -> int:
        """Host bytes the transport holds whatever the model's size (its pinned rings), when windows are summed on
        the device (`receives_sums`) or not. None here."""
        return 0

    def hand_off(self, work: list[tuple[LinkedMatrix, torch.Tensor]], slot: int
                 ) -> tuple[list[tuple[HostEnd, torch.Tensor]], CopyEvents]:
        """Start moving this step's gradients (this rank's share of each storage matrix) to the host; returns what
        the host job reads and what it must wait for. The caller then drops its references to the gradients."""
        sources = [(split.host, _owned(split.host_part(g), g)) for split, g in work]
        return sources, CopyEvents()

    def compute_waits_for(self, landed: CopyEvents) -> None:
        """Order the compute stream after the copies `landed` waits for (CUDA), so that the step's one sync covers
        them; nothing where copies are synchronous."""

    def before_window_add(self, split: LinkedMatrix) -> None:
        """Called before the first add of a window into `split.window_sum` (``accumulate_on="device"`` or
        ``"device_bf16"``)."""

    def ship_window_sums(self, splits: list[LinkedMatrix]) -> CopyEvents:
        """Move each closed window's device-side sum into its host accumulator, in its own dtype (the worker is
        not reading it)."""
        for split in splits:
            host = split.host
            shared = host.writeback is host.accum  # (`HostMatrix.shares_writeback`: written back already)
            host.accum, split.window_sum = split.window_sum, host.accum
            if shared:
                host.writeback = host.accum
        return CopyEvents()

    def put_weights(self, split: LinkedMatrix) -> None:
        """Put the host result the worker rounded into `split.host.writeback` into the weight (all columns; the
        caller writes the device columns back on top)."""
        host = split.host
        if host.writes_back_master:
            # no write-back buffer: the master stays the host's, so it is copied into the weight (rounded to the
            # weight's dtype) instead of becoming its storage
            split.matrix(split.param).copy_(host.writeback)
            return
        # `.data`, not `.detach()`: the worker writes the spare next, which must not bump the version counter that
        # autograd checks. The weight keeps its Parameter object, shape and strides; only its storage changes.
        spare = split.matrix(split.param.data)
        split.param.data = split.unmatrix(host.writeback)
        if host.accum is host.writeback:  # (`HostMatrix.shares_writeback`: the weight's old storage serves both)
            host.accum = spare
        host.writeback = spare

    def after_write_back(self, splits: list[LinkedMatrix]) -> None:
        """Called once the write-back of `splits` is enqueued."""

    def take_device_ms(self) -> float:
        """Device time (ms) of the write-back copies that have run since the last call, where they hold up the
        device (CUDA: host->device copies on the compute stream); 0 where a write-back moves nothing."""
        return 0.0

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory held (for `stats()`)."""
        return 0

    def close(self) -> None:
        """Release what the transport holds (pinned memory)."""
