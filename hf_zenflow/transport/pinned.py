"""Page-locked host memory for the buffers that cross the link: `PinnedArena`, and `HostRegistrar`, the one object
that talks to ``cudaHostRegister``/``cudaHostUnregister`` (a CPU test replaces it with a fake that counts calls).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

import torch


logger = logging.getLogger(__name__)

#: Every buffer carved from a pinned arena starts on this boundary (DMA-friendly, and any dtype's alignment).
ARENA_ALIGN = 512

#: ``cudaHostRegisterPortable``: the block counts as pinned for every CUDA device (and context) of the process, so
#: the devices of a ``device_map="auto"`` model can all copy into and out of it asynchronously. Without it only the
#: device current at registration sees it pinned, and another device's "asynchronous" copies are synchronous.
HOST_REGISTER_PORTABLE = 1

#: Where this process's mapped libraries are listed (Linux).
PROCESS_MAPS = "/proc/self/maps"

#: ``madvise``'s advice that a range is not mapped into a child made by ``fork`` (Linux).
MADV_DONTFORK = 10


def page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 4096


def keep_from_fork(ptr: int, nbytes: int) -> bool:
    """Mark the page-aligned range [`ptr`, `ptr` + `nbytes`) ``MADV_DONTFORK``: a child made by ``fork`` (a
    DataLoader worker) does not get it. Without the mark, a fork makes every page of a page-locked block
    copy-on-write, and the kernel copies the pinned pages for the child at the fork (tens of GB for a large model's
    buffers, in the child's memory and the fork's time), or on kernels without that care hands the parent a new
    page on its next write while the device still reads the old one. The child never reads these buffers. False
    where the advice is not available (not Linux) or refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), MADV_DONTFORK) == 0


def loaded_cudart(maps: str) -> str | None:
    """The path of the CUDA runtime library mapped into this process (torch's own, ``libcudart.so.*``), from the
    text of ``/proc/self/maps``; None when none is (a runtime linked statically into torch)."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcudart.so"):
            return fields[5].strip()
    return None


def reset_torch_runtime_error() -> bool:
    """Reset the last error of the CUDA runtime torch uses (``cudaGetLastError``), which torch's bindings
    (``torch.cuda.cudart()``) do not expose. The library is the one already mapped into this process, opened with
    ``RTLD_NOLOAD``: it is torch's runtime, never a second one loaded by name (whose error state would be another).
    False when it cannot be found (no ``/proc``, a statically linked runtime)."""
    try:
        with open(PROCESS_MAPS) as f:
            path = loaded_cudart(f.read())
    except OSError:
        return False
    if path is None:
        return False
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError()
    except (OSError, AttributeError):
        return False
    return True


class HostRegistrar:
    """Page-locks ordinary host blocks in place (``cudaHostRegister``) and unlocks them again, through torch's CUDA
    runtime. `cudart`: the runtime bindings (default ``torch.cuda.cudart()``, looked up at first use; a CPU test
    passes a fake); `reset_error`: resets the runtime's last error (default: the bindings' ``cudaGetLastError``
    where they have one, else `reset_torch_runtime_error`)."""

    def __init__(self, cudart: Any = None, reset_error: Callable[[], bool] | None = None) -> None:
        self._cudart = cudart
        self._reset_error = reset_error

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

    def unregister(self, ptr: int) -> bool:
        """Unlock the block at `ptr`; False, with a warning naming CUDA's error (and the error state left clean),
        when the runtime refuses."""
        status = int(self.runtime().cudaHostUnregister(ptr))
        if status != 0:
            self.clear_error()
            logger.warning("hf_zenflow: unlocking a pinned host block failed (cudaHostUnregister returned %s); it "
                           "may stay page-locked until the process ends.", _error_name(status))
            return False
        return True

    def clear_error(self) -> None:
        """Reset CUDA's last error (``cudaGetLastError``) in torch's runtime."""
        bound = getattr(self.runtime(), "cudaGetLastError", None) if self._reset_error is None else None
        if bound is not None:
            bound()
            return
        reset = self._reset_error or reset_torch_runtime_error
        if not reset():
            logger.warning("hf_zenflow: could not reset CUDA's error state after a failed cudaHost(Un)register; a "
                           "later CUDA call may report that failure.")


def _error_name(status: int) -> str:
    """``"<code> (<CUDA's description>)"`` where torch can describe it, else the code."""
    try:
        return f"{status} ({torch.cuda.CudaError(status)})"
    except Exception:  # noqa: BLE001 - only a description for a warning
        return str(status)


class PinnedArena:
    """Host buffers that cross the link, carved from a few large page-locked allocations.

    `torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds every allocation up
    to a power of two (an 86 MiB buffer costs 128 MiB) and pins each separately. Here each `reserve` allocates one
    ordinary host block of the exact size and page-locks it in place (`HostRegistrar`, portable to every device);
    `take` hands out aligned slices. Where the driver refuses, the block stays ordinary memory (copies to and from
    it are then synchronous: slower, never wrong), with a warning once per arena. A page-locked block covers whole
    pages of its own, marked against fork (`keep_from_fork`). `release` unlocks every block: `close()` and a reloaded
    state (which allocates new buffers) call it, so pinned memory never outlives its use.
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
        if not self.pin:
            block = torch.empty(nbytes, dtype=torch.uint8)
        else:
            # whole pages of its own (the allocation's first and last pages may hold other data, which a child
            # made by fork must keep): the block starts on a page boundary and its pages end inside the allocation
            page = page_size()
            spaced = torch.empty(nbytes + 2 * page, dtype=torch.uint8)
            start = -spaced.data_ptr() % page
            block = spaced[start:start + nbytes]
            if self.registrar.register(block.data_ptr(), nbytes):
                self._registered.append((block.data_ptr(), nbytes))
                if not keep_from_fork(block.data_ptr(), (nbytes + page - 1) // page * page):
                    logger.debug("hf_zenflow: madvise(MADV_DONTFORK) is not available: a fork copies the pinned "
                                 "pages for its child")
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
        if nbytes == 0:  # an empty share (a rank or shard with no rows of this matrix): nothing to carve
            return torch.empty(shape, dtype=dtype)
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
