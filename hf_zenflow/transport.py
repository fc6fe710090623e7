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
from .pinned import ARENA_ALIGN, HostRegistrar, PinnedArena


__all__ = ["ARENA_ALIGN", "CopyTransport", "CudaStreams", "CudaTransport", "Landed", "PinnedArena", "Transport",
           "transport_for"]

if TYPE_CHECKING:
    from .host import HostMatrix
    from .split_matrix import SplitMatrix


@dataclass
class Landed:
    """What a host job must wait for before it reads data copied from the device: one CUDA event per device that
    sent something, or nothing (the data is already there)."""

    events: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()  # Sync point (worker waits on the device): the copy has landed on the host


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

    def compute_waits_for(self, landed: Landed) -> None:
        """Order the compute stream after the copies `landed` waits for (CUDA), so that the step's one sync covers
        them; nothing where copies are synchronous."""

    def before_window_add(self, split: SplitMatrix) -> None:
        """Called before the first add of a window into `split.window_sum` (``accumulate_on="device"`` or
        ``"device_bf16"``)."""

    def ship_window_sums(self, splits: list[SplitMatrix]) -> Landed:
        """Move each closed window's device-side sum into its host accumulator (the worker is not reading it); a
        bf16 sum (``accumulate_on="device_bf16"``) into its bf16 landing buffer instead, as it is."""
        for split in splits:
            host = split.host
            if host.landing is not None:  # (bf16 sums: swapped into the landing buffer, the worker widens them)
                host.landing, split.window_sum = split.window_sum, host.landing
                continue
            shared = host.writeback is host.accum  # (`HostMatrix.shares_writeback`: written back already)
            host.accum, split.window_sum = split.window_sum, host.accum
            if shared:
                host.writeback = host.accum
        return Landed()

    def put_weights(self, split: SplitMatrix) -> None:
        """Put the host result the worker rounded into `split.host.writeback` into the weight (all columns; the
        caller writes the device columns back on top)."""
        host = split.host
        # `.data`, not `.detach()`: the worker writes the spare next, which must not bump the version counter that
        # autograd checks. The weight keeps its Parameter object, shape and strides; only its storage changes.
        spare = split.matrix(split.param.data)
        split.param.data = split.unmatrix(host.writeback)
        if host.accum is host.writeback:  # (`HostMatrix.shares_writeback`: the weight's old storage serves both)
            host.accum = spare
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

    def __init__(self, pin: bool = False, registrar: HostRegistrar | None = None) -> None:
        self.arena = PinnedArena(pin, registrar)
        self.pins_host_memory = pin

    def host_buffer(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.arena.take(shape, dtype)

    def reserve(self, nbytes: int) -> None:
        self.arena.reserve(nbytes)

    @contextlib.contextmanager
    def _copying(self, device: torch.device) -> Iterator[None]:
        """Where the copies of one device are enqueued (CUDA: its side stream)."""
        yield

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy, enqueued where `_copying` says (CUDA: asynchronous, on the current stream)."""
        dst.copy_(src, non_blocking=True)

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
                    self._copy(split.host.staging[slot], split.host_part(g))
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
                    host = split.host
                    self._copy(host.landing if host.landing is not None else host.accum, total)
                event = self._landed_event(device)
            if event is not None:
                landed.events.append(event)
                for split, _ in items:
                    split.window_sum_free = event  # the next window's first add waits for this copy on the device
        return landed

    @property
    def pinned_bytes(self) -> int:
        return self.arena.pinned_bytes

    def put_weights(self, split: SplitMatrix) -> None:
        # An asynchronous host->device copy from pinned memory on the compute stream (CUDA): the next forward pass
        # and the scatter of the device columns are ordered after it; the host thread does not wait.
        self._copy(split.matrix(split.param), split.host.writeback)

    def close(self) -> None:
        self.arena.release()


class CudaStreams:
    """Every CUDA stream, event and copy call `CudaTransport` makes, in one object: the CPU test suite stands a
    double of an asynchronous device in for it (background copies that land late), so a missing wait fails there.

    Events are created with ``blocking=True``: a host thread waiting on one (the worker, before it reads a landed
    gradient or refills a write-back buffer) sleeps in the driver instead of spinning a core that the host AdamW
    needs (the default event's `synchronize` busy-waits)."""

    def side_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event(blocking=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # on the current stream (`use`)

    def keep_alive(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


class CudaTransport(CopyTransport):
    """Asynchronous copies on one side stream per CUDA device, pinned buffers from one arena, events. `streams`
    and `registrar`: the CUDA calls (`CudaStreams`, `HostRegistrar`); the CPU test suite passes doubles."""

    def __init__(self, streams: CudaStreams | None = None, registrar: HostRegistrar | None = None) -> None:
        super().__init__(pin=True, registrar=registrar)
        self.streams = streams if streams is not None else CudaStreams()
        self._streams: dict[torch.device, Any] = {}
        self._devices: set[torch.device] = set()  # every device a copy was enqueued for (`close` waits for them)

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = self.streams.side_stream(device)
        return self._streams[device]

    @contextlib.contextmanager
    def _copying(self, device: torch.device) -> Iterator[None]:
        stream = self._stream(device)
        self._devices.add(device)
        # Sync point (device streams only): the side stream waits for the compute stream that produced the data;
        # the host thread does not wait.
        stream.wait_stream(self.streams.current_stream(device))
        with self.streams.use(stream):
            yield

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.streams.copy(dst, src)

    def _landed_event(self, device: torch.device) -> Any:
        event = self.streams.event()
        event.record(self._stream(device))
        event.hf_zenflow_device = device  # (`compute_waits_for`: whose compute stream may wait for it)
        return event

    def compute_waits_for(self, landed: Landed) -> None:
        for event in landed.events:
            device = getattr(event, "hf_zenflow_device", None)
            if device is not None:
                # Sync point (device streams only): the compute stream waits for the copies to the host; the host
                # thread does not wait here, but in the step's sync, which now covers them.
                self.streams.current_stream(device).wait_event(event)

    def _keep_alive(self, t: torch.Tensor, device: torch.device) -> None:
        self.streams.keep_alive(t, self._stream(device))

    def before_window_add(self, split: SplitMatrix) -> None:
        if split.window_sum_free is not None:
            # Sync point (device streams only): the compute stream waits until the last window's device->host copy
            # has read the sum before it is overwritten; the host thread does not wait.
            self.streams.current_stream(split.param.device).wait_event(split.window_sum_free)
            split.window_sum_free = None

    def put_weights(self, split: SplitMatrix) -> None:
        self._devices.add(split.param.device)
        super().put_weights(split)

    def after_write_back(self, splits: list[SplitMatrix]) -> None:
        # The worker must not refill a write-back buffer before the copy out of it has run: one event per device,
        # recorded on the compute stream after the copies, that the worker waits for (`host_adamw_window`).
        events: dict[torch.device, Any] = {}
        for split in splits:
            device = split.param.device
            if device not in events:
                events[device] = self.streams.event()
                events[device].record(self.streams.current_stream(device))
            split.host.writeback_free = events[device]

    def close(self) -> None:
        # Sync point (close and reload only): no copy may still read or fill a block when it is unlocked.
        for device in self._devices:
            self.streams.synchronize(device)
        self._devices.clear()
        super().close()


def transport_for(device: torch.device) -> Transport:
    """The transport for parameters on `device`."""
    if device.type == "cuda":
        return CudaTransport()
    if device.type == "cpu":
        from .cpu_device.transport import CpuDeviceTransport

        return CpuDeviceTransport()
    return CopyTransport()
