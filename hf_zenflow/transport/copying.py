"""`CopyTransport`: separate device and host buffers and a synchronous copy for every move: the write-back, the device
sums and each step's gradients cross through a `PinnedRing` each (pinned or not), between the device and ordinary
host memory.
`CudaTransport` (`cuda.py`) is this schedule with side streams and events; the CPU test suite runs the optimizer with
this one to check the copying logic."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._base import by_device
from .lander import StagingLander
from .link import CopyEvents, HostEnd, LinkedMatrix, Transport
from .pinned import HostRegistrar, PinnedArena
from .ring import PinnedRing


class SumsReceipt:
    """The window sums of one device on their way to the host accumulators through the transport's receive ring
    (`PinnedRing.receive`), run once by whichever thread needs them first: the host AdamW job before it reads the
    accumulators (`synchronize`, through `CopyEvents.wait`), or the training thread before the next window's first
    add overwrites a sum (`sent`). `after`: an event after the window's last add on the compute stream (None where
    copies are synchronous)."""

    def __init__(self, transport: CopyTransport, device: torch.device, pairs: list[tuple[HostEnd, torch.Tensor]],
                 after: Any) -> None:
        self.transport, self.device, self.pairs, self.after = transport, device, pairs, after
        self._lock = threading.Lock()
        self._sent = threading.Event()
        self._last: Any = None  # the event after the last copy out of the device sums
        self.done = False
        self.cancelled = False

    def _on_sent(self, last: Any) -> None:
        self._last = last
        self._sent.set()

    def query(self) -> bool:
        """Whether the sums are in the host accumulators (no wait)."""
        return self.done

    def synchronize(self) -> None:
        """Receive the sums into the host accumulators, unless that has happened already."""
        with self._lock:
            if self.cancelled:
                raise RuntimeError("the window sums were not received: the transport was closed first")
            if not self.done:
                with self.transport._copying(self.device, after=self.after):
                    self.transport.receive_ring.receive(
                        [(host.accum, _sum_pieces(host, total)) for host, total in self.pairs], self.transport._copy,
                        lambda: self.transport._landed_event(self.device), self._on_sent)
                self.done, self.pairs = True, []

    def sent(self) -> Any:
        """The event after the last copy out of the device sums, once every copy is enqueued (receiving them first
        if no thread has started to): after it, the sums may be written again."""
        if not self._sent.is_set():
            self.synchronize()  # (or, when another thread holds the lock, wait for it to finish)
        return self._last


def _sum_pieces(host: HostEnd, total: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
    """``piece_of(start, end)``: elements ``[start, end)`` of what `host`'s accumulator keeps of the device sum
    `total` (2-D): all of it (a view), or, where the accumulator keeps some of its columns (`HostEnd.sum_index`
    along `sum_axis`), the rows of those columns that cover the piece, gathered on the device where the copies are
    enqueued (a transient of about one chunk; fewer bytes over the link, and the host lands a contiguous copy)."""
    if host.sum_index is None:
        flat = total.view(-1)
        return lambda start, end: flat[start:end]
    row_length = host.sum_index.numel() if host.sum_axis == 1 else total.shape[1]  # (of the kept matrix)
    index = host.sum_index.to(total.device)

    def piece_of(start: int, end: int) -> torch.Tensor:
        # Called inside `_copying`: on CUDA the gather runs on the side stream, after the window's last add (the
        # receipt's `after` event), before the copy out of it; its block goes back to the caching allocator once
        # the copy is enqueued, for later work on that stream only (after the copy).
        first, last = start // row_length, -(-end // row_length)
        if host.sum_axis == 1:
            rows = total[first:last].index_select(1, index)
        else:
            rows = total.index_select(0, index[first:last])
        return rows.view(-1)[start - first * row_length:end - first * row_length]

    return piece_of


class CopyTransport(Transport):
    """Separate device and host buffers and a copy for every move: `CudaTransport`'s schedule without streams."""

    stages_gradients = True
    copies_window_sums = True

    def __init__(self, pin: bool = False, registrar: HostRegistrar | None = None) -> None:
        self.pins_host_memory = pin
        #: the write-back (from its buffer, or from the fp32 master) crosses through this ring (its own arena:
        #: reserved at the first write-back, released with the transport)
        self.ring = PinnedRing(PinnedArena(pin, registrar))
        #: the device sums cross through this one (reserved at the first window's close) into ordinary host memory
        self.receive_ring = PinnedRing(PinnedArena(pin, registrar))
        self._receipts: list[SumsReceipt] = []  # the receipts not known to be done (`close` cancels them)
        #: each step's gradients cross through this one (reserved at the first hand-off) into the landing slots, in
        #: ordinary host memory, which the lander's thread fills
        self.lander = StagingLander(PinnedRing(PinnedArena(pin, registrar)))

    def fixed_host_bytes(self, receives_sums: bool = False) -> int:
        # (each ring is taken at its first use: the first write-back; the first window's device sums, or the first
        # step's gradients where the host sums the window)
        crossing = self.receive_ring if receives_sums else self.lander.ring
        return self.ring.nbytes + crossing.nbytes

    @contextlib.contextmanager
    def _copying(self, device: torch.device, after: Any = None) -> Iterator[None]:
        """Where the copies of one device are enqueued (CUDA: its side stream, ordered after the compute stream's
        work, or after the event `after` recorded on it)."""
        yield

    def _produced_event(self, device: torch.device) -> Any:
        """An event after the work enqueued so far on `device`'s compute stream (CUDA), or None."""
        return None

    def _stream_waits(self, device: torch.device, event: Any) -> None:
        """Order `device`'s compute stream after `event` (CUDA); nothing where copies are synchronous."""

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy, enqueued where `_copying` says (CUDA: asynchronous, on the current stream)."""
        dst.copy_(src, non_blocking=True)

    def _landed_event(self, device: torch.device) -> Any:
        """An event after the copies just enqueued for `device` (CUDA), or None."""
        return None

    def hand_off(self, work: list[tuple[LinkedMatrix, torch.Tensor]], slot: int
                 ) -> tuple[list[tuple[HostEnd, torch.Tensor]], CopyEvents]:
        # Piece by piece through the lander's ring into the slot's landing buffers (ordinary memory): the host job
        # waits for the lander's marks; the event after the last copy lets the compute stream wait for the copies
        # out of the gradients (`compute_waits_for`).
        landed = CopyEvents()
        for device, items in by_device(work, lambda item: item[1].device):
            recorded: list[Any] = []  # (the events after each piece's copy: the last one is after them all)

            def event_after(device: torch.device = device, recorded: list[Any] = recorded) -> Any:
                recorded.append(self._landed_event(device))
                return recorded[-1]

            with self._copying(device):
                for split, g in items:
                    landed.events.append(self.lander.stage(split.host.staging[slot], split.host_part(g), self._copy,
                                                           event_after))
                    self._keep_alive(g, device)
            if recorded and recorded[-1] is not None:
                landed.events.append(recorded[-1])
        return [(split.host, split.host.staging[slot]) for split, _ in work], landed

    def _keep_alive(self, t: torch.Tensor, device: torch.device) -> None:
        """Keep `t`'s memory from being reused before the copy enqueued on `device`'s side stream has read it."""

    def ship_window_sums(self, splits: list[LinkedMatrix]) -> CopyEvents:
        # The sums cross through the receive ring when the host job first needs them (`SumsReceipt`): the copies out
        # of them are ordered after this point of the compute stream, and the next window's first add into a sum
        # waits for the copies out of it (`before_window_add`).
        landed = CopyEvents()
        self._receipts = [r for r in self._receipts if not r.done]
        for device, items in by_device([(s, s.window_sum) for s in splits], lambda item: item[1].device):
            receipt = SumsReceipt(self, device, [(split.host, total) for split, total in items],
                                  self._produced_event(device))
            landed.events.append(receipt)
            self._receipts.append(receipt)
            for split, _ in items:
                split.window_sum_free = receipt
        return landed

    def before_window_add(self, split: LinkedMatrix) -> None:
        receipt = split.window_sum_free
        if receipt is not None:
            # Sync point: the training thread waits until every copy out of the last window's sums is enqueued
            # (normally long done by the host job: the window's first add comes a step after its close), then, on
            # CUDA, the compute stream waits for those copies before the sum is overwritten.
            last = receipt.sent()
            if last is not None:
                self._stream_waits(split.param.device, last)
            split.window_sum_free = None

    @property
    def pinned_bytes(self) -> int:
        return sum(ring.arena.pinned_bytes for ring in (self.ring, self.receive_ring, self.lander.ring))

    def _read_event(self, device: torch.device) -> Any:
        """An event after the copies just enqueued on `device`'s compute stream (CUDA), or None."""
        return None

    def put_weights(self, split: LinkedMatrix) -> None:
        host, weight = split.host, split.matrix(split.param)
        # Piece by piece through the ring's pinned chunks on this thread: the write-back buffer copied (or, with no
        # buffer, the master rounded) into a chunk, then an asynchronous host->device copy of the chunk into its
        # piece of the weight on the compute stream (CUDA: the next forward pass and the scatter of the device
        # columns are ordered after it). Sync point: a chunk is refilled only once the copy out of it has run, so
        # the host thread waits for the link once the ring is full. The worker's next pass may write the buffer or
        # the master as soon as this returns: every piece has been read.
        self.ring.copy(weight, host.writeback, self._copy, lambda: self._read_event(split.param.device))

    def close(self) -> None:
        for receipt in self._receipts:
            with receipt._lock:  # (waits for a receipt another thread is receiving)
                receipt.cancelled = not receipt.done
        self._receipts = []
        self.lander.close()
        self.ring.wait()
        for ring in (self.ring, self.receive_ring, self.lander.ring):
            ring.arena.release()
            ring.forget()


__all__ = ["CopyTransport"]
