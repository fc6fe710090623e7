"""`CopyTransport`: separate device and host buffers and a synchronous copy for every move, the buffers from one
`PinnedArena` (pinned or not), a write-back from the fp32 master through a `PinnedRing`. `CudaTransport` (`cuda.py`)
is this schedule with side streams and events; the CPU test suite runs the optimizer with this one to check the
copying logic."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._base import by_device
from .link import CopyEvents, HostEnd, LinkedMatrix, Transport
from .pinned import HostRegistrar, PinnedArena
from .ring import PinnedRing


class CopyTransport(Transport):
    """Separate device and host buffers and a copy for every move: `CudaTransport`'s schedule without streams."""

    stages_gradients = True

    def __init__(self, pin: bool = False, registrar: HostRegistrar | None = None) -> None:
        self.arena = PinnedArena(pin, registrar)
        self.pins_host_memory = pin
        #: the write-back from the fp32 master crosses through this ring (its own arena: reserved at the first such
        #: write-back, released with the transport)
        self.ring = PinnedRing(PinnedArena(pin, registrar))

    def fixed_host_bytes(self, from_master: bool) -> int:
        return self.ring.nbytes if from_master else 0  # (the ring, taken at the first write-back from the master)

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

    def hand_off(self, work: list[tuple[LinkedMatrix, torch.Tensor]], slot: int
                 ) -> tuple[list[tuple[HostEnd, torch.Tensor]], CopyEvents]:
        landed = CopyEvents()
        for device, items in by_device(work, lambda item: item[1].device):
            with self._copying(device):
                for split, g in items:
                    self._copy(split.host.staging[slot], split.host_part(g))
                    self._keep_alive(g, device)
                event = self._landed_event(device)
            if event is not None:
                landed.events.append(event)
        return [(split.host, split.host.staging[slot]) for split, _ in work], landed

    def _keep_alive(self, t: torch.Tensor, device: torch.device) -> None:
        """Keep `t`'s memory from being reused before the copy enqueued on `device`'s side stream has read it."""

    def ship_window_sums(self, splits: list[LinkedMatrix]) -> CopyEvents:
        landed = CopyEvents()
        for device, items in by_device([(s, s.window_sum) for s in splits], lambda item: item[1].device):
            with self._copying(device):
                for split, total in items:
                    host = split.host
                    self._copy(host.accum, total)
                event = self._landed_event(device)
            if event is not None:
                landed.events.append(event)
                for split, _ in items:
                    split.window_sum_free = event  # the next window's first add waits for this copy on the device
        return landed

    @property
    def pinned_bytes(self) -> int:
        return self.arena.pinned_bytes + self.ring.arena.pinned_bytes

    def _read_event(self, device: torch.device) -> Any:
        """An event after the copies just enqueued on `device`'s compute stream (CUDA), or None."""
        return None

    def put_weights(self, split: LinkedMatrix) -> None:
        host, weight = split.host, split.matrix(split.param)
        if host.writes_back_master:
            # No write-back buffer: the master is rounded piece by piece into the ring's pinned chunks on this thread,
            # each chunk copied into its piece of the weight as below; a chunk is refilled once its copy has run.
            # The worker's next pass may write the master as soon as this returns (every piece has been read).
            self.ring.copy(weight, host.writeback, self._copy, lambda: self._read_event(split.param.device))
            return
        # An asynchronous host->device copy from pinned memory on the compute stream (CUDA): the next forward pass
        # and the scatter of the device columns are ordered after it; the host thread does not wait.
        self._copy(weight, host.writeback)

    def close(self) -> None:
        self.ring.wait()
        self.ring.arena.release()
        self.ring.forget()
        self.arena.release()


__all__ = ["CopyTransport"]
