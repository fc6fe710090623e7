"""`CudaTransport`: asynchronous copies on one side stream per CUDA device, through the rings of pinned chunks
`CopyTransport` keeps (each registered once, outside the backward hooks); CUDA events say when a copy has landed (host
jobs wait on them) and when a buffer has been read (its next writer waits on them).
`CudaStreams` holds every stream, event and copy call it makes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .copying import CopyTransport
from .link import CopyEvents, LinkedMatrix, counted_device_wait
from .pinned import HostRegistrar


class HostWaitEvent:
    """A blocking CUDA event whose `synchronize` counts the time the calling host thread waited
    (`link.counted_device_wait`): a host job that waits for a copy is not host work. `record`, `wait` (which
    ``Stream.wait_event`` calls) and `query` are the event's own."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event(blocking=True)

    def record(self, stream: Any = None) -> None:
        self.event.record(stream)

    def wait(self, stream: Any = None) -> None:
        self.event.wait(stream)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        with counted_device_wait():
            self.event.synchronize()


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
        return HostWaitEvent()

    def timing_event(self) -> Any:
        """An event that records when the stream reached it (for `elapsed_ms`)."""
        return torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, start: Any, end: Any) -> float | None:
        """Device time between two recorded timing events, or None while `end` has not run (never waits)."""
        return start.elapsed_time(end) if end.query() else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # on the current stream (`use`)

    def keep_alive(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


class CudaTransport(CopyTransport):
    """Asynchronous copies on one side stream per CUDA device, rings of pinned chunks, events. `streams`
    and `registrar`: the CUDA calls (`CudaStreams`, `HostRegistrar`); the CPU test suite passes doubles."""

    def __init__(self, streams: CudaStreams | None = None, registrar: HostRegistrar | None = None) -> None:
        super().__init__(pin=True, registrar=registrar)
        self.streams = streams if streams is not None else CudaStreams()
        self._streams: dict[torch.device, Any] = {}
        self._devices: set[torch.device] = set()  # every device a copy was enqueued for (`close` waits for them)
        self._writeback_started: dict[torch.device, Any] = {}  # the write-back being enqueued: its timing event
        self._writeback_timings: list[tuple[Any, Any]] = []  # (start, end) of write-backs not yet counted

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = self.streams.side_stream(device)
        return self._streams[device]

    @contextlib.contextmanager
    def _copying(self, device: torch.device, after: Any = None) -> Iterator[None]:
        stream = self._stream(device)
        self._devices.add(device)
        # Sync point (device streams only): the side stream waits for the compute stream that produced the data (up
        # to `after` where given: a later host thread enqueues these copies); the host thread does not wait.
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(self.streams.current_stream(device))
        with self.streams.use(stream):
            yield

    def _produced_event(self, device: torch.device) -> Any:
        event = self.streams.event()
        event.record(self.streams.current_stream(device))
        return event

    def _stream_waits(self, device: torch.device, event: Any) -> None:
        # Sync point (device streams only): the compute stream waits for `event`; the host thread does not wait.
        self.streams.current_stream(device).wait_event(event)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.streams.copy(dst, src)

    def _landed_event(self, device: torch.device) -> Any:
        event = self.streams.event()
        event.record(self._stream(device))
        event.hf_zenflow_device = device  # (`compute_waits_for`: whose compute stream may wait for it)
        return event

    def _read_event(self, device: torch.device) -> Any:
        event = self.streams.event()
        event.record(self.streams.current_stream(device))
        return event

    def compute_waits_for(self, landed: CopyEvents) -> None:
        for event in landed.events:
            device = getattr(event, "hf_zenflow_device", None)
            if device is not None:
                # Sync point (device streams only): the compute stream waits for the copies to the host; the host
                # thread does not wait here, but in the step's sync, which now covers them.
                self.streams.current_stream(device).wait_event(event)

    def _keep_alive(self, t: torch.Tensor, device: torch.device) -> None:
        self.streams.keep_alive(t, self._stream(device))

    def put_weights(self, split: LinkedMatrix) -> None:
        device = split.param.device
        self._devices.add(device)
        if device not in self._writeback_started:
            # the write-back's copies run on the compute stream, which the next forward waits behind: their device
            # time is measured between two timing events (read once they have run, never waited for)
            self._writeback_started[device] = self.streams.timing_event()
            self._writeback_started[device].record(self.streams.current_stream(device))
        super().put_weights(split)

    def after_write_back(self, splits: list[LinkedMatrix]) -> None:
        # The worker must not refill a write-back buffer before every copy out of it has run (one rank's write-back
        # has read it on this thread, through the ring; several ranks' all-gather copies it on the compute stream):
        # one event per device, recorded on the compute stream after the copies, that the worker waits for
        # (`host_adamw_window`).
        events: dict[torch.device, Any] = {}
        for split in splits:
            device = split.param.device
            if device not in events:
                events[device] = self.streams.event()
                events[device].record(self.streams.current_stream(device))
            split.host.writeback_free = events[device]
        for device, start in self._writeback_started.items():
            end = self.streams.timing_event()
            end.record(self.streams.current_stream(device))
            self._writeback_timings.append((start, end))
        self._writeback_started.clear()

    def take_device_ms(self) -> float:
        # the measured write-backs whose copies have run (the others stay for a later call; no wait)
        done, waiting = 0.0, []
        for start, end in self._writeback_timings:
            elapsed = self.streams.elapsed_ms(start, end)
            if elapsed is None:
                waiting.append((start, end))
            else:
                done += elapsed
        self._writeback_timings = waiting
        return done

    def close(self) -> None:
        # Sync point (close and reload only): no copy may still read or fill a block when it is unlocked.
        for device in self._devices:
            self.streams.synchronize(device)
        self._devices.clear()
        super().close()


__all__ = ["CudaStreams", "CudaTransport", "HostWaitEvent"]
