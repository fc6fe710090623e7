"""`StagingLander`: each step's gradients reach their landing slots (ordinary host memory) through a ring of pinned
chunks, so that the pinned memory the gradients need is the ring's whatever the model's size.

The thread that hands a gradient off (a backward hook, or the step) takes a free chunk, enqueues the copy of a piece
of the gradient into it on the transport's side stream and records an event after it; the lander's own thread waits
for that event, copies the piece from the chunk into its landing slot and frees the chunk. A hand-off is complete
(`LandedMark.synchronize`, which the host job that reads the slots waits for) once its last piece is in its slot:
the lander lands pieces in the order they were enqueued. Where copies are synchronous (no event), a piece lands at
once on the thread that handed it off.

Example (synchronous copies):
    >>> import torch
    >>> from hf_zenflow.transport.pinned import PinnedArena
    >>> from hf_zenflow.transport.ring import PinnedRing
    >>> lander = StagingLander(PinnedRing(PinnedArena(pin=False), chunk_bytes=64, chunks=2))
    >>> src, slot = torch.randn(10, 10), torch.empty(10, 10)
    >>> mark = lander.stage(slot, src, lambda d, s: d.copy_(s), lambda: None)
    >>> mark.synchronize(); torch.equal(slot, src)
    True
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .link import counted_device_wait
from .ring import PinnedRing


class LanderError(RuntimeError):
    """The lander's thread failed: the gradients of the hand-offs it had not landed are lost."""


class LandedMark:
    """Complete once the last piece of one hand-off is in its landing slot (`synchronize` waits for that and raises
    the lander's failure, if any)."""

    def __init__(self, lander: StagingLander) -> None:
        self.lander = lander
        self._landed = threading.Event()

    def set(self) -> None:
        self._landed.set()

    def query(self) -> bool:
        return self._landed.is_set()

    def synchronize(self) -> None:
        # Sync point (this host thread waits on the lander, which waits on the device): the hand-off's pieces are in
        # their slots.
        with counted_device_wait():
            while not self._landed.wait(0.05):
                self.lander.raise_failure()
        self.lander.raise_failure()


def _pieces(rows: int, columns: int, per_chunk: int) -> Iterator[tuple[slice, slice]]:
    """The row and column ranges of a [rows, columns] matrix, in order, each at most `per_chunk` elements: whole rows
    where a row fits, else pieces of one row."""
    if columns <= per_chunk:
        step = per_chunk // columns
        for start in range(0, rows, step):
            yield slice(start, min(rows, start + step)), slice(0, columns)
        return
    for row in range(rows):
        for start in range(0, columns, per_chunk):
            yield slice(row, row + 1), slice(start, min(columns, start + per_chunk))


class StagingLander:
    """The ring's chunks, handed out to the threads that stage gradients and taken back by the lander's thread once
    their piece has landed (see the module docstring). Started at the first asynchronous piece; `close` stops it."""

    def __init__(self, ring: PinnedRing) -> None:
        self.ring = ring
        self._free = collections.deque(range(ring.chunks))
        self._freed = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise LanderError(f"landing a gradient on the host failed: {self._failure!r}") from self._failure

    def _take(self) -> tuple[int, torch.Tensor]:
        buffers = self.ring.buffers()
        with self._freed:
            while not self._free:
                # Sync point (the handing-off thread waits on the lander): every chunk holds a piece that has not
                # landed yet; the next one is free once the oldest has (the copies run at the link's rate).
                self.raise_failure()
                with counted_device_wait():
                    self._freed.wait(0.05)
            index = self._free.popleft()
        return index, buffers[index]

    def _give_back(self, index: int) -> None:
        with self._freed:
            self._free.append(index)
            self._freed.notify()

    def stage(self, slot: torch.Tensor, src: torch.Tensor, send: Callable[[torch.Tensor, torch.Tensor], None],
              event_after: Callable[[], Any]) -> LandedMark:
        """``slot.copy_(src)`` for a host `slot` and a device `src`, both [rows, columns] (`src` may be strided),
        piece by piece through the ring: `send` copies a piece into a chunk (asynchronous on CUDA) and `event_after`
        records an event after it (None where copies are synchronous). Returns the mark of the last piece."""
        self.raise_failure()
        mark = LandedMark(self)
        rows, columns = slot.shape
        per_chunk = max(1, self.ring.chunk_bytes // src.element_size())
        pieces = list(_pieces(rows, columns, per_chunk))
        for number, (row_range, column_range) in enumerate(pieces):
            part, landing = src[row_range, column_range], slot[row_range, column_range]
            index, chunk = self._take()
            staged = chunk[:part.numel() * part.element_size()].view(part.dtype).view(part.shape)
            send(staged, part)
            landed = event_after()
            last = mark if number == len(pieces) - 1 else None
            if landed is None:
                landing.copy_(staged)  # (synchronous copies: it has landed)
                self._give_back(index)
                if last is not None:
                    last.set()
            else:
                self._start()
                self._queue.put((index, staged, landing, landed, last))
        if not pieces:
            mark.set()
        return mark

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._land, name="hf_zenflow-lander", daemon=True)
            self._thread.start()

    def _land(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            index, staged, landing, landed, mark = item
            try:
                if self._failure is None:
                    landed.synchronize()  # Sync point (the lander waits on the device): the piece is in its chunk
                    landing.copy_(staged)
            except BaseException as exc:  # noqa: BLE001 - raised in the threads that wait on its marks
                self._failure = exc
            finally:
                self._give_back(index)
                if mark is not None:
                    mark.set()

    def close(self) -> None:
        """Land what is queued, then stop the thread (a later piece starts it again)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


__all__ = ["LandedMark", "LanderError", "StagingLander"]
