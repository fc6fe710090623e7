"""The resource model of `compare` and `tune` on a CPU device: D cores are "the device", H cores "the host".

On a GPU box the device (forward, backward, the device-side optimizer work) and the host (host AdamW, gradient
accumulation, the host side of the copies) are separate resources. The CPU stand-in models that the same way for
every run: the training thread gets D intra-op threads (``torch.set_num_threads``) and every host step, synchronous
offload's as well as ZenFlow's worker, gets H (``cpu_threads``). ``adamw_torch`` has no host work; its training thread
still gets only D, so that all three runs have the same device. Default D = H = half the cores this process may use.

On CUDA the device is the GPU: D is not applied (the training thread keeps torch's setting) and H is the host's cores
given to the host step.

Device memory: a GPU's caching allocator hands freed device memory to the next allocation of that size. The CPU
stand-in gets the same from glibc (`keep_freed_memory`, once per process, before the first run): without it every
freed block above glibc's mmap threshold (at most 32 MiB; MiniLM's 47 MB word-embedding gradient, made anew by each
backward) goes back to the kernel, and the next backward pays page faults for it in a share of the steps that
depends on each run's heap layout, which made the device's speed differ between runs.

Example:
    >>> split = CoreSplit.resolve(device_cores=None, host_cores=None, cuda=False, cores=2)
    >>> (split.device, split.host)
    (1, 1)
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hf_zenflow.settings.threads import rank_cpu_count


@dataclass(frozen=True)
class CoreSplit:
    """D device cores (None on CUDA: the GPU) and H host cores of one comparison, the same for every run."""

    device: int | None
    host: int
    cores: int
    cuda: bool

    @classmethod
    def resolve(cls, device_cores: int | None, host_cores: int | None, cuda: bool, cores: int | None = None,
                ) -> CoreSplit:
        cores = cores if cores is not None else rank_cpu_count()
        for name, value in (("device_cores", device_cores), ("host_cores", host_cores)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: allowed is an integer >= 1.")
        half = max(1, cores // 2)
        host = host_cores if host_cores is not None else half
        if cuda:
            return cls(None, host, cores, True)
        return cls(device_cores if device_cores is not None else half, host, cores, False)

    def apply_device(self) -> None:
        """Give the training thread D intra-op threads and the process a caching allocator (`keep_freed_memory`),
        before a run's first forward; a CPU device only."""
        if self.device is None:
            return
        keep_freed_memory()
        if torch.get_num_threads() != self.device:
            torch.set_num_threads(self.device)

    def describe(self) -> str:
        if self.cuda:
            return f"device: the GPU; host: {self.host} of {self.cores} cores (host AdamW of both offloading runs)"
        over = (f" (together {self.device + self.host} > {self.cores} cores: the two sides share cores)"
                if self.device + self.host > self.cores else "")
        return (f"device = {self.device} core(s) (forward, backward, device-side optimizer work), host = {self.host} "
                f"core(s) (host AdamW, accumulation, copies' host side), of {self.cores}; the same for every run"
                f"{over}")

    def to_dict(self) -> dict[str, Any]:
        # whether the CPU device reused freed memory (`keep_freed_memory`; None: not applied yet, or the GPU's own)
        return {**asdict(self), "reuses_freed_memory": None if self.device is None else _kept}


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
#: The most heap glibc may keep free at its top before giving memory back (mallopt takes an int).
_KEEP_BYTES = 2**31 - 1
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Make this process's allocator reuse freed memory as a GPU's caching allocator does: glibc serves every
    allocation from its heap (no mmap per large block: freeing one would unmap it and the next one of that size would
    fault its pages in anew) and keeps up to 2 GiB free at the heap's top instead of returning it. Changes no value,
    only where memory comes from; the process keeps its peak heap. Once per process; True where it applies (glibc),
    False elsewhere (the allocator then stays as it is).

    Example:
        >>> keep_freed_memory() == (platform.libc_ver()[0] == "glibc")
        True
    """
    global _kept
    if _kept is None:
        _kept = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(None)
                _kept = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
            except (OSError, AttributeError):  # no mallopt in this process's C library after all
                _kept = False
    return _kept
