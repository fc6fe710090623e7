"""`PinnedRing`: a fixed number of page-locked chunks, reused in turn, through which a tensor of any size crosses the
link piece by piece, so that the pinned memory a crossing needs is the ring's, whatever the model's size. On a
transport with asynchronous copies:

- the write-back from the fp32 master (``host_writeback="master"``, `PinnedRing.copy`): each piece of the master is
  rounded into a chunk on the host and copied from there to the weight;
- a window's device sums (``accumulate_on="device"`` / ``"device_bf16"``, `PinnedRing.receive`): each piece of a
  sum (or of the columns the host accumulator keeps, gathered on the device) is copied into a chunk, and from the
  chunk into the host accumulator (ordinary memory) once it has landed;
- each step's gradients, where the host sums the window (`lander.StagingLander`): the same, into the landing slots.

Example:
    >>> import torch
    >>> ring = PinnedRing(PinnedArena(pin=False), chunk_bytes=1024, chunks=2)
    >>> src, dst = torch.randn(1000), torch.empty(1000, dtype=torch.bfloat16)
    >>> ring.copy(dst, src, lambda d, s: d.copy_(s), lambda: None)
    >>> torch.equal(dst, src.to(torch.bfloat16))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .pinned import PinnedArena


#: The ring's chunks: enough of them that the host fills one while the link copies the others.
RING_CHUNKS = 4
#: Bytes per chunk: a copy of this size runs at the link's full rate, and a piece of the master this size is
#: rounded in a few milliseconds.
RING_CHUNK_BYTES = 32 << 20
#: What the ring pins: `RING_CHUNKS` x `RING_CHUNK_BYTES`, whatever the model's size.
RING_BYTES = RING_CHUNKS * RING_CHUNK_BYTES


#: Where `PinnedRing.copy` places a piece in a chunk: at a multiple of this many bytes after the one before.
PIECE_ALIGN = 64


class PinnedRing:
    """`chunks` chunks of `chunk_bytes` from `arena` (reserved at the first use, outside any backward hook), taken
    in turn. A chunk is refilled only after the copy out of it has run: each use leaves an event (`copy`'s
    `event_after`), which the next use of that chunk waits for on the host."""

    def __init__(self, arena: PinnedArena, chunk_bytes: int = RING_CHUNK_BYTES, chunks: int = RING_CHUNKS) -> None:
        self.arena, self.chunk_bytes, self.chunks = arena, chunk_bytes, chunks
        self._buffers: list[torch.Tensor] = []
        self._read: list[Any] = [None] * chunks  # per chunk: the event after the copy that last read it, or None
        self._next = 0
        # `copy`'s place: the chunk it fills (-1: none yet) and the first free byte in it
        self._filling, self._free = -1, chunk_bytes

    @property
    def nbytes(self) -> int:
        return self.chunk_bytes * self.chunks

    def buffers(self) -> list[torch.Tensor]:
        """The chunks, reserved at the first call."""
        if not self._buffers:
            self.arena.reserve(self.nbytes)
            self._buffers = [self.arena.take((self.chunk_bytes,), torch.uint8) for _ in range(self.chunks)]
        return self._buffers

    def _room(self, element_size: int) -> tuple[int, int]:
        """(chunk, first free byte) where `copy` places its next piece: after the last piece in the chunk it fills,
        or, where not one element fits there, at the start of the next chunk."""
        self.buffers()
        if self._filling < 0 or self._free + element_size > self.chunk_bytes:
            index = (self._filling + 1) % self.chunks
            read = self._read[index]
            if read is not None:
                # Sync point (host waits on the device): the copies out of this chunk, enqueued one turn of the
                # ring ago, must have read it before the host writes the next pieces into it.
                read.synchronize()
                self._read[index] = None
            self._filling, self._free = index, 0
        return self._filling, self._free

    def copy(self, dst: torch.Tensor, src: torch.Tensor, send: Callable[[torch.Tensor, torch.Tensor], None],
             event_after: Callable[[], Any]) -> None:
        """``dst.copy_(src)`` for a host `src` and a device `dst` of the same shape, both contiguous, piece by piece:
        each piece of `src` is converted to `dst`'s dtype into a chunk, and `send` (the transport's copy, asynchronous
        on CUDA) copies the chunk into its piece of `dst`; `event_after` records an event after that copy (None where
        copies are synchronous). Pieces are packed: each goes after the one before in the chunk being filled (that
        one's copies need only other bytes of it), across calls, so a write-back of many small matrices fills one
        chunk rather than waiting for each chunk in turn; a chunk is refilled only once the ring has come round."""
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        size = dst.element_size()
        start = 0
        while start < flat_dst.numel():
            index, offset = self._room(size)
            count = min(flat_dst.numel() - start, (self.chunk_bytes - offset) // size)
            piece = flat_dst[start:start + count]
            staged = self._buffers[index][offset:offset + count * size].view(piece.dtype)
            staged.copy_(flat_src[start:start + count])  # (rounded to the weight's dtype here, on the host)
            send(piece, staged)
            # (an event after this copy is after every earlier copy out of the chunk: they share the stream)
            self._read[index] = event_after()
            self._free = -(-(offset + count * size) // PIECE_ALIGN) * PIECE_ALIGN
            start += count

    def receive(self, pairs: list[tuple[torch.Tensor, Callable[[int, int], torch.Tensor]]],
                send: Callable[[torch.Tensor, torch.Tensor], None], event_after: Callable[[], Any],
                on_sent: Callable[[Any], None] = lambda last: None) -> None:
        """For each (host `dst`, `piece_of`) of `pairs`, `dst` (contiguous) receives from the device, piece by piece,
        the elements that ``piece_of(start, end)`` gives (a device tensor of ``end - start`` elements of one dtype:
        a view of a contiguous source, or the part of a gathered one): `send` copies a piece into a chunk
        (asynchronous on CUDA), `event_after` records an event after that copy (None where copies are synchronous),
        and the piece goes from the chunk into `dst` once the event has completed. Up to `chunks` pieces are in
        flight at once. `on_sent` gets the event after the last copy out of the sources (None where copies are
        synchronous) as soon as it is enqueued: after it the sources may be written again."""
        self.buffers()
        in_flight: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # (chunk piece, host piece, landed), in order
        last = None

        def land() -> None:
            staged, piece, landed = in_flight.pop(0)
            if landed is not None:
                # Sync point (this host thread waits on the device): the piece has landed in its chunk; the chunk
                # is then free for the piece `chunks` places later.
                landed.synchronize()
            piece.copy_(staged)

        for dst, piece_of in pairs:
            flat_dst = dst.view(-1)
            per_chunk = max(1, self.chunk_bytes // dst.element_size())
            for start in range(0, flat_dst.numel(), per_chunk):
                end = min(start + per_chunk, flat_dst.numel())
                piece = piece_of(start, end)
                if len(in_flight) == self.chunks:
                    land()
                chunk = self._buffers[self._next]
                self._next = (self._next + 1) % self.chunks
                staged = chunk[:piece.numel() * piece.element_size()].view(piece.dtype)
                send(staged, piece)
                last = event_after()
                in_flight.append((staged, flat_dst[start:end], last))
        on_sent(last)
        while in_flight:
            land()

    def wait(self) -> None:
        """Wait until every copy out of the ring has run (before its memory is unlocked)."""
        for index, read in enumerate(self._read):
            if read is not None:
                read.synchronize()
                self._read[index] = None

    def forget(self) -> None:
        """Drop the chunks (the arena that holds them is being released); the next use reserves them again."""
        self._buffers, self._read, self._next = [], [None] * self.chunks, 0
        self._filling, self._free = -1, self.chunk_bytes


__all__ = ["PIECE_ALIGN", "RING_BYTES", "RING_CHUNKS", "RING_CHUNK_BYTES", "PinnedRing"]

