"""compare's CPU device reuses freed memory as a GPU's caching allocator does (`cores.keep_freed_memory`): a large
block freed and allocated again faults its pages in once, not at every allocation (the reference: the same
process without it)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest


# allocate and free a block above glibc's largest mmap threshold (32 MiB) six times, as each backward makes a new
# word-embedding gradient after the previous one was freed. What glibc does with each block is read from mallinfo2:
# bytes in mmap'd blocks while the block is held (the reference maps every block and unmaps it at its free, so each
# allocation faults all its pages in anew), and the heap glibc keeps after the free. (Page faults alone cannot show
# the reuse: the kernel may reclaim idle free pages of a kept heap, e.g. DAMON-based reclaim, and they fault again.)
_SCRIPT = """
import ctypes, json, resource, sys
import torch
from hf_zenflow.compare.cores import CoreSplit

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
torch.set_num_threads(1)
split = CoreSplit.resolve(device_cores=1, host_cores=1, cuda=False, cores=2)
if sys.argv[1] == "cpu-device":
    split.apply_device()
n = 16 * 2**20  # 64 MiB of fp32
faults, mapped_while_held, heap_after_free = [], [], []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t = torch.zeros(n)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    mapped_while_held.append(libc.mallinfo2().hblkhd)
    del t
    heap_after_free.append(libc.mallinfo2().arena)
print(json.dumps({"faults": faults, "bytes": n * 4, "pages": n * 4 // 4096, "mapped_while_held": mapped_while_held,
                  "heap_after_free": heap_after_free, "reported": split.to_dict()["reuses_freed_memory"]}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                    or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 33), reason="glibc >= 2.33 only")
def test_cpu_device_reuses_freed_memory() -> None:
    plain, device = _faults("plain"), _faults("cpu-device")
    # the reference: every block is mmap'd on its own, unmapped at its free, and its pages fault in again
    assert all(m >= plain["bytes"] for m in plain["mapped_while_held"])
    assert all(f > 0.9 * plain["pages"] for f in plain["faults"][3:])
    # the device model: every block comes from the heap, which keeps the freed block for the next one
    assert all(m < device["bytes"] for m in device["mapped_while_held"])
    assert all(h >= device["bytes"] for h in device["heap_after_free"])
    assert device["reported"] is True and plain["reported"] is None  # results.json's cores say which


def test_cuda_split_leaves_the_allocator_alone() -> None:
    from hf_zenflow.compare import cores

    kept = cores._kept
    cores.CoreSplit.resolve(device_cores=None, host_cores=1, cuda=True, cores=2).apply_device()
    assert cores._kept is kept  # the GPU brings its own caching allocator: nothing to model
