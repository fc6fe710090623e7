#!/usr/bin/env python
"""Usage: python scripts/replay_gloo_exit_abort.py pinned|unpinned (Linux; exit 134 = the abort).

Replay of the exit race (one gloo rank, world size 1), ended like the test workers: DDP built
after init, a last collective on a temporary, destroy_process_group, exit.

gloo's threads are put on SCHED_IDLE on the main thread's only CPU, so a gloo thread that completed a collective
is preempted before it drops its reference to the work (as on a busy 2-core CI machine, only for longer). The
main thread then blocks for 0.2 s in a C call that keeps the GIL: the gloo thread drops the work, whose tensor's
Python object needs the GIL, and waits for it (switch interval 60 s: no forced hand-over). It gets the GIL when
the main thread next releases it, inside interpreter finalization if the group outlived destroy_process_group.

mode 'pinned': torch.distributed.nn imported by DDP after init keeps the group alive past destroy (the tests'
workers before the fix); 'unpinned': imported before init, destroy frees the group and joins its threads."""

import ctypes
import importlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist


mode = sys.argv[1]
if mode == "unpinned":
    importlib.import_module("torch.distributed.nn")
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
torch.set_num_threads(1)
d = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{d}/i", rank=0, world_size=1)
for t in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{t}/comm") as f:
        if f.read().startswith(("pt_gloo", "gloo")):
            os.sched_setscheduler(int(t), os.SCHED_IDLE, os.sched_param(0))
m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
del m
sys.setswitchinterval(60)
dist.all_reduce(torch.ones(1000))
dist.destroy_process_group()
ctypes.PyDLL(None).usleep(200_000)  # blocks holding the GIL
