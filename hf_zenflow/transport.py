"""Moving data between the device and the host: one interface, one implementation per kind of device.

The optimizer hands each step's gradients to the host, ships a window's device-side gradient sums
(``accumulate_on="device"``) and writes host results back into the weights, always through a `Transport`; it never
asks what the device is.

- `CudaTransport`: asynchronous copies on one side stream per CUDA device, into and out of pinned host buffers carved
  from one registered arena (`PinnedArena`); CUDA events say when a copy has landed (host jobs wait on them) and when
  a buffer has been read (its next writer waits on them).
- `CopyTransport`: the same schedule with ordinary synchronous copies and unpinned buffers: what `CudaTransport` does,
  minus streams and events. The CPU test suite runs the optimizer with it to check the copying logic.
- `cpu_device.transport.CpuDeviceTransport`: the device is the CPU (tests, CI, `hf-zenflow compare` here). Nothing
  is copied where a reference will do: the worker reads the gradient tensors themselves, a window's device-side sum
  becomes the host accumulator by a buffer swap, and the write-back gives the weight the buffer the worker filled as
  its storage. (That is the `Transport` base behaviour.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._base import by_device


if TYPE_CHECKING:
    from .host import HostMatrix
    from .split_matrix import SplitMatrix

#: Every buffer carved from a pinned arena starts on this boundary (DMA-friendly, and any dtype's alignment).
ARENA_ALIGN = 512


@dataclass
class Landed:
    """What a host job must wait for before it reads data copied from the device: one CUDA event per device that
    sent something, or nothing (the data is already there)."""

    events: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()  # Sync point (worker waits on the device): the copy has landed on the host


class PinnedArena:
    """Host buffers that cross the link, carved from a few large page-locked allocations.

    `torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every allocation up
    to a power of two (an 86 MiB buffer costs 128 MiB) and pins each separately. Here each `reserve` allocates one
    ordinary host block of the exact size and page-locks it with ``cudaHostRegister``; `take` hands out aligned
    slices. (Where registration fails, the block is pinned through torch instead, with its rounding.)
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._blocks: list[torch.Tensor] = []
        self._registered: list[int] = []
        self._block: torch.Tensor | None = None
        self._offset = 0

    @staticmethod
    def aligned(nbytes: int) -> int:
        return (nbytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN

    def reserve(self, nbytes: int) -> None:
        """Make room for `nbytes` (sum of `aligned` sizes) of buffers in one new block."""
        if nbytes <= 0:
            return
        block = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin:
            status = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)
            if int(status) == 0:
                self._registered.append(block.data_ptr())
            else:
                block = block.pin_memory()
        self._blocks.append(block)
        self._block, self._offset = block, 0

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised buffer from the current block (a new block of exactly its size when it is full)."""
        nbytes = self.aligned(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
        if self._block is None or self._offset + nbytes > self._block.numel():
            self.reserve(nbytes)
        buf = self._block[self._offset:self._offset + nbytes]
        self._offset += nbytes
        numel = int(torch.Size(shape).numel())
        return buf.view(dtype)[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._blocks)

    def release(self) -> None:
        """Unpin the registered blocks (their tensors must no longer be in use)."""
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        self._blocks.clear()
        self._block = None


class Transport:
    """The interface, and the reference-and-swap behaviour of a CPU device (`CpuDeviceTransport`)."""

    #: whether each step's gradient is copied into host staging buffers (one per hand-off slot)
    stages_gradients = False
    #: whether host buffers that cross the link are pinned (asynchronous copies)
    pins_host_memory = False

    def host_buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that crosses the link (pinned where copies are asynchronous)."""
        return torch.empty(shape, dtype=dtype)

    def reserve(self, nbytes: int) -> None:
        """A hint: `nbytes` of `host_buffer` (each `PinnedArena.aligned`) are about to be asked for."""

    def hand_off(self, work: list[tuple[SplitMatrix, torch.Tensor]], slot: int
                 ) -> tuple[list[tuple[HostMatrix, torch.Tensor]], Landed]:
        """Start moving this step's gradients (this rank's share of each storage matrix) to the host; returns what
        the host job reads and what it must wait for. The caller then drops its references to the gradients."""
        # (host_grad_dtype="bfloat16": the worker reads the gradient rounded as a copy over the link would be)
        return [(split.host, split.host_part(g).to(split.host.grad_dtype)) for split, g in work], Landed()

    def before_window_add(self, split: SplitMatrix) -> None:
        """Called before the first add of a window into `split.window_sum` (``accumulate_on="device"``)."""

    def ship_window_sums(self, splits: list[SplitMatrix]) -> Landed:
        """Move each closed window's device-side sum into its host accumulator (the worker is not reading it)."""
        for split in splits:
            host = split.host
            host.accum, split.window_sum = split.window_sum, host.accum
        return Landed()

    def put_weights(self, split: SplitMatrix) -> None:
        """Put the host result the worker rounded into `split.host.writeback` into the weight (all columns; the
        caller writes the device columns back on top)."""
        host = split.host
        # `.data`, not `.detach()`: the worker writes the spare next, which must not bump the version counter that
        # autograd checks. The weight keeps its Parameter object, shape and strides; only its storage changes.
        spare = split.matrix(split.param.data)
        split.param.data = split.unmatrix(host.writeback)
        host.writeback = spare

    def after_write_back(self, splits: list[SplitMatrix]) -> None:
        """Called once the write-back of `splits` is enqueued."""

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory held (for `stats()`)."""
        return 0

    def close(self) -> None:
        """Release what the transport holds (pinned memory)."""


class CopyTransport(Transport):
    """Separate device and host buffers and a copy for every move: `CudaTransport`'s schedule without streams."""

    stages_gradients = True

    def __init__(self, pin: bool = False) -> None:
        self.arena = PinnedArena(pin)
        self.pins_host_memory = pin

    def host_buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.arena.take(shape, dtype)

    def reserve(self, nbytes: int) -> None:
        self.arena.reserve(nbytes)

    @contextlib.contextmanager
    def _copying(self, device: torch.device) -> Iterator[None]:
        """Where the copies of one device are enqueued (CUDA: its side stream)."""
        yield

    def _landed_event(self, device: torch.device) -> Any:
        """An event after the copies just enqueued for `device` (CUDA), or None."""
        return None

    def hand_off(self, work: list[tuple[SplitMatrix, torch.Tensor]], slot: int
                 ) -> tuple[list[tuple[HostMatrix, torch.Tensor]], Landed]:
        landed = Landed()
        for device, items in by_device(work, lambda item: item[1].device):
            with self._copying(device):
                for split, g in items:
                    # a staging buffer narrower than the gradient (host_grad_dtype="bfloat16"): copy_ rounds on the
                    # device, on this side stream (after its wait for the compute stream), into a temporary it
                    # copies from; only the narrow bytes cross the link
                    split.host.staging[slot].copy_(split.host_part(g), non_blocking=True)
                    self._keep_alive(g, device)
                event = self._landed_event(device)
            if event is not None:
                landed.events.append(event)
        return [(split.host, split.host.staging[slot]) for split, _ in work], landed

    def _keep_alive(self, t: torch.Tensor, device: torch.device) -> None:
        """Keep `t`'s memory from being reused before the copy enqueued on `device`'s side stream has read it."""

    def ship_window_sums(self, splits: list[SplitMatrix]) -> Landed:
        landed = Landed()
        for device, items in by_device([(s, s.window_sum) for s in splits], lambda item: item[1].device):
            with self._copying(device):
                for split, total in items:
                    split.host.accum.copy_(total, non_blocking=True)
                event = self._landed_event(device)
            if event is not None:
                landed.events.append(event)
                for split, _ in items:
                    split.window_sum_free = event  # the next window's first add waits for this copy on the device
        return landed

    @property
    def pinned_bytes(self) -> int:
        return self.arena.nbytes if self.arena.pin else 0

    def put_weights(self, split: SplitMatrix) -> None:
        # An asynchronous host->device copy from pinned memory on the compute stream (CUDA): the next forward pass
        # and the scatter of the device columns are ordered after it; the host thread does not wait.
        split.matrix(split.param).copy_(split.host.writeback, non_blocking=True)

    def close(self) -> None:
        self.arena.release()


class CudaTransport(CopyTransport):
    """Asynchronous copies on one side stream per CUDA device, pinned buffers from one arena, events."""

    def __init__(self) -> None:
        super().__init__(pin=True)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    @contextlib.contextmanager
    def _copying(self, device: torch.device) -> Iterator[None]:
        stream = self._stream(device)
        # Sync point (device streams only): the side stream waits for the compute stream that produced the data;
        # the host thread does not wait.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield

    def _landed_event(self, device: torch.device) -> Any:
        event = torch.cuda.Event()
        event.record(self._stream(device))
        return event

    def _keep_alive(self, t: torch.Tensor, device: torch.device) -> None:
        t.record_stream(self._stream(device))

    def before_window_add(self, split: SplitMatrix) -> None:
        if split.window_sum_free is not None:
            # Sync point (device streams only): the compute stream waits until the last window's device->host copy
            # has read the sum before it is overwritten; the host thread does not wait.
            torch.cuda.current_stream(split.param.device).wait_event(split.window_sum_free)
            split.window_sum_free = None

    def after_write_back(self, splits: list[SplitMatrix]) -> None:
        # The worker must not refill a write-back buffer before the copy out of it has run: one event per device,
        # recorded on the compute stream after the copies, that the worker waits for (`host_adamw_window`).
        events: dict[torch.device, Any] = {}
        for split in splits:
            device = split.param.device
            if device not in events:
                events[device] = torch.cuda.Event()
                events[device].record(torch.cuda.current_stream(device))
            split.host.writeback_free = events[device]


def transport_for(device: torch.device) -> Transport:
    """The transport for parameters on `device`."""
    if device.type == "cuda":
        return CudaTransport()
    if device.type == "cpu":
        from .cpu_device.transport import CpuDeviceTransport

        return CpuDeviceTransport()
    return CopyTransport()
