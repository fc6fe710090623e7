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
# word-embedding gradient after the previous one was freed: the page faults of each allocation (the first ones may
# grow the heap; the last three show the steady state)
_SCRIPT = """
import json, resource, sys
import torch
from hf_zenflow.compare.cores import CoreSplit
torch.set_num_threads(1)
split = CoreSplit.resolve(device_cores=1, host_cores=1, cuda=False, cores=2)
if sys.argv[1] == "cpu-device":
    split.apply_device()
n = 16 * 2**20  # 64 MiB of fp32
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t = torch.zeros(n)
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    del t
print(json.dumps({"faults": faults, "pages": n * 4 // 4096, "reported": split.to_dict()["reuses_freed_memory"]}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_cpu_device_reuses_freed_memory() -> None:
    plain, device = _faults("plain"), _faults("cpu-device")
    # the reference: every page of every new block faults again
    assert all(f > 0.9 * plain["pages"] for f in plain["faults"][3:])
    # the device model: the freed blocks are reused
    assert all(f < 0.05 * device["pages"] for f in device["faults"][3:])
    assert device["reported"] is True and plain["reported"] is None  # results.json's cores say which


def test_cuda_split_leaves_the_allocator_alone() -> None:
    from hf_zenflow.compare import cores

    kept = cores._kept
    cores.CoreSplit.resolve(device_cores=None, host_cores=1, cuda=True, cores=2).apply_device()
    assert cores._kept is kept  # the GPU brings its own caching allocator: nothing to model
