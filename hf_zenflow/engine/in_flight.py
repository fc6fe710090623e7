"""Gradients freed in backward that are still on their way to the host: `FreedInFlight`.

A gradient freed in its backward hook (`free_gradients_in_backward`) leaves ``p.grad`` at once, but on CUDA its
memory stays allocated until the side-stream copy that reads it has run (``record_stream``: the caching allocator
reuses the block only after the copy). When backward produces gradients faster than the link carries them, every
gradient of the step would be in flight at its end, and the device would hold as much as synchronous offload does.
So at most `FREED_IN_FLIGHT` freed gradients are in flight: the hook that frees one more waits for the oldest copy to
land. The link is then busy all the time (one copy runs, the next is queued behind it on the same stream), and the
device holds at most `FREED_IN_FLIGHT` freed gradients plus the one autograd has just produced (`in_flight_count`):
the count `device_budget.estimate_peak` and `DeviceMemoryMeter` take. Where copies are synchronous (a CPU device's
transport) a freed gradient is gone when its hook returns.

Example:
    >>> from hf_zenflow.transport import CopyEvents
    >>> freed = FreedInFlight()
    >>> freed.add(1024, CopyEvents())  # (a copy with no event has landed already)
    >>> freed.bytes()
    0
"""

from __future__ import annotations

import threading
from collections import deque

from ..transport import CopyEvents


#: Freed gradients whose copy to the host may still run when the next one is freed: one copying, one queued.
FREED_IN_FLIGHT = 2


def in_flight_count(copies_lag: bool) -> int:
    """How many freed gradients the device may hold at once: with copies that can lag backward (CUDA's side
    stream), `FREED_IN_FLIGHT` in flight and the one just produced; with synchronous copies, the one just produced.

    Example:
        >>> in_flight_count(True), in_flight_count(False)
        (3, 1)
    """
    return FREED_IN_FLIGHT + 1 if copies_lag else 1


def landed(events: CopyEvents) -> bool:
    """Whether every copy of `events` has run (no wait)."""
    return all(event.query() for event in events.events)


class FreedInFlight:
    """The freed gradients whose copy to the host has not landed yet: their bytes and what their copy records.
    Backward hooks of several devices may call `add` at once (one autograd thread each)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, CopyEvents]] = deque()
        self._lock = threading.Lock()

    def add(self, nbytes: int, copy_landed: CopyEvents) -> None:
        """A gradient of `nbytes` was freed while its copy (`copy_landed`) may still read it. With more than
        `FREED_IN_FLIGHT` in flight, wait for the oldest copies to land."""
        with self._lock:
            self._queue.append((nbytes, copy_landed))
            self._drop_landed()
            oldest = [self._queue.popleft() for _ in range(len(self._queue) - FREED_IN_FLIGHT)]
        for _, events in oldest:
            # Sync point (backward waits for the link, only while copies lag behind backward): the oldest freed
            # gradient's copy has read it, so that its memory goes back to the allocator before autograd makes the
            # next gradient. The link stays busy: the next copy is already queued behind it.
            events.wait()

    def _drop_landed(self) -> None:
        self._queue = deque(item for item in self._queue if not landed(item[1]))

    def bytes(self) -> int:
        """Bytes of the freed gradients whose copy has not landed yet (no wait)."""
        with self._lock:
            self._drop_landed()
            return sum(nbytes for nbytes, _ in self._queue)

    def clear(self) -> None:
        """Forget them (the transports were closed: every copy has run)."""
        with self._lock:
            self._queue.clear()


__all__ = ["FREED_IN_FLIGHT", "FreedInFlight", "in_flight_count", "landed"]
