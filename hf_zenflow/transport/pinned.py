"""Page-locked host memory for the buffers that cross the link: `PinnedArena`, and `HostRegistrar`, the one object
that talks to ``cudaHostRegister``/``cudaHostUnregister`` (a CPU test replaces it with a fake that counts calls).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

import torch


logger = logging.getLogger(__name__)

#: Every buffer carved from a pinned arena starts on this boundary (DMA-friendly, and any dtype's alignment).
ARENA_ALIGN = 512

#: ``cudaHostRegisterPortable``: the block counts as pinned for every CUDA device (and context) of the process, so
#: the devices of a ``device_map="auto"`` model can all copy into and out of it asynchronously. Without it only the
#: device current at registration sees it pinned, and another device's "asynchronous" copies are synchronous.
HOST_REGISTER_PORTABLE = 1


class HostRegistrar:
    """Page-locks ordinary host blocks in place (``cudaHostRegister``) and unlocks them again. `cudart`: the CUDA
    runtime bindings (default ``torch.cuda.cudart()``, looked up at first use; a CPU test passes a fake)."""

    def __init__(self, cudart: Any = None) -> None:
        self._cudart = cudart

    def runtime(self) -> Any:
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def register(self, ptr: int, nbytes: int) -> bool:
        """Pin `nbytes` at `ptr` for every device; False (and CUDA's error state left clean) when the driver
        refuses (``ulimit -l``, a container's locked-memory limit, memory already registered)."""
        status = int(self.runtime().cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE))
        if status != 0:
            # The failure stays recorded as CUDA's "last error", and torch's next kernel-launch check
            # (cudaGetLastError) would raise it from an unrelated op: read it now, which resets it.
            self.clear_error()
            return False
        return True

    def unregister(self, ptr: int) -> None:
        self.runtime().cudaHostUnregister(ptr)

    def clear_error(self) -> None:
        """Reset CUDA's last error (``cudaGetLastError``): through torch's runtime bindings where they have it,
        else through the runtime library itself."""
        bound = getattr(self.runtime(), "cudaGetLastError", None)
        if bound is not None:
            bound()
            return
        for name in (ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.12", "libcudart.so.11.0"):
            if name is None:
                continue
            try:
                ctypes.CDLL(name).cudaGetLastError()
                return
            except (OSError, AttributeError):
                continue
        logger.warning("hf_zenflow: could not reset CUDA's error state after a failed cudaHostRegister; a later "
                       "CUDA call may report that failure.")


class PinnedArena:
    """Host buffers that cross the link, carved from a few large page-locked allocations.

    `torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every allocation up
    to a power of two (an 86 MiB buffer costs 128 MiB) and pins each separately. Here each `reserve` allocates one
    ordinary host block of the exact size and page-locks it in place (`HostRegistrar`, portable to every device);
    `take` hands out aligned slices. Where the driver refuses, the block stays ordinary memory (copies to and from
    it are then synchronous: slower, never wrong), with a warning once per arena. `release` unlocks every block:
    `close()` and a reloaded state (which allocates new buffers) call it, so pinned memory never outlives its use.
    """

    def __init__(self, pin: bool, registrar: HostRegistrar | None = None) -> None:
        self.pin = pin
        self.registrar = registrar if registrar is not None else HostRegistrar()
        self._blocks: list[torch.Tensor] = []
        self._registered: list[tuple[int, int]] = []  # (address, bytes) of each page-locked block
        self._block: torch.Tensor | None = None
        self._offset = 0
        self._warned = False

    @staticmethod
    def aligned(nbytes: int) -> int:
        return (nbytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN

    def reserve(self, nbytes: int) -> None:
        """Make room for `nbytes` (sum of `aligned` sizes) of buffers in one new block."""
        if nbytes <= 0:
            return
        block = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin:
            if self.registrar.register(block.data_ptr(), nbytes):
                self._registered.append((block.data_ptr(), nbytes))
            elif not self._warned:
                self._warned = True
                logger.warning(
                    "hf_zenflow: page-locking %d bytes of host memory failed (cudaHostRegister; the locked-memory "
                    "limit, `ulimit -l`, may be too low): those buffers stay pageable, and copies to and from them "
                    "are synchronous.", nbytes)
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
        """Bytes of the blocks in use."""
        return sum(b.numel() for b in self._blocks)

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now."""
        return sum(n for _, n in self._registered)

    def release(self) -> None:
        """Unlock every registered block and forget the blocks. No copy may still be in flight from or into them
        (the caller waits for its streams first); buffers already handed out stay valid as ordinary memory."""
        registered, self._registered = self._registered, []
        for ptr, _ in registered:
            self.registrar.unregister(ptr)
        self._blocks.clear()
        self._block, self._offset = None, 0
