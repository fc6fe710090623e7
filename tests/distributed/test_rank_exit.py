"""A process ends cleanly, without the C++ abort "terminate called without an active exception" (SIGABRT) that
a thread still inside torch during interpreter finalization causes: a host worker thread left in a job (never
closed, or closed without waiting), and a gloo group's threads outliving destroy_process_group in a DDP rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import gloo_threads, init_ranks, run_in_group, spawn_ranks


REPO = Path(__file__).resolve().parents[2]

# Two host jobs of torch ops on a worker nobody closes, then the end of the program: the first job is inside torch
# when the interpreter exits, the second has not started (it must be dropped: it would make exit wait for it too).
LEFT_RUNNING = """
import sys, time, torch
from hf_zenflow.engine.worker import HostAdamWorker
a = torch.randn(256, 256)
started = []
def busy():
    started.append(1)
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        torch.mm(a, a)
def second():
    open(sys.argv[2], "w").close()
worker = HostAdamWorker(threads=1, background=True)
worker.submit("busy", busy)
worker.submit("second", second)
while not started:
    time.sleep(0.001)
if sys.argv[1] == "raise":
    raise RuntimeError("the training loop failed")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, code", [("return", 0), ("raise", 1)])
def test_a_host_worker_left_inside_a_job_does_not_abort_the_exit(tmp_path, how, code):
    marker = tmp_path / "second_job_ran"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", LEFT_RUNNING, how, str(marker)], env=env, capture_output=True, text=True, timeout=100
    )
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == code, proc.stderr[-3000:]
    assert not marker.exists()  # the job not started at exit was dropped
    if how == "raise":
        assert "the training loop failed" in proc.stderr


def _ddp_rank(rank: int, init_file: str, out_dir: str) -> None:
    init_ranks(rank, init_file)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    dist.all_reduce(torch.ones(8))
    del model
    dist.destroy_process_group()
    # (a thread may still be on its way out right after the call on a loaded machine: give them a few seconds)
    deadline = time.monotonic() + 10
    while gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(out_dir, f"threads{rank}.txt"), "w") as f:
        f.write(str(gloo_threads()))


@pytest.mark.timeout(120)
def test_destroy_process_group_ends_the_gloo_threads_of_a_ddp_rank(tmp_path):
    spawn_ranks(_ddp_rank, str(tmp_path))
    assert [(tmp_path / f"threads{r}.txt").read_text() for r in range(2)] == ["0", "0"]


#: weak references to the DDP models a rank built (`_ddp_body`)
_BUILT: list[weakref.ref] = []


def _ddp_body(rank: int, out_dir: str) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    outs = [torch.empty(8) for _ in range(2)]
    dist.all_gather(outs, torch.ones(8))
    _BUILT.append(weakref.ref(model))


def _ddp_rank_in_group(rank: int, init_file: str, out_dir: str) -> None:
    real = dist.destroy_process_group

    def destroy(*args, **kwargs):
        with open(os.path.join(out_dir, f"alive{rank}.txt"), "w") as f:
            f.write(str(sum(ref() is not None for ref in _BUILT)))
        real(*args, **kwargs)

    dist.destroy_process_group = destroy
    run_in_group(rank, init_file, _ddp_body, out_dir)


@pytest.mark.timeout(120)
def test_a_rank_frees_its_ddp_model_before_it_destroys_the_group(tmp_path):
    """Repro: `tests/distributed/test_ddp.py::test_the_auto_write_back_lag_is_agreed_across_ranks` hung for 600 s on a
    busy machine, and pytest never exited: the rank function destroyed the group in its ``finally`` while its DDP
    model was still alive; the model's C++ Reducer, freed when the function returned, dropped the group's last
    reference with the GIL held, and ``ProcessGroupGloo::~ProcessGroupGloo`` waited for the work mutex held by a
    ``pt_gloo_runloop`` thread freeing the last all-gather's tensors, which waited for the GIL. (A loop of that order
    beside two CPU burners hung within 12 iterations; with the model freed first, 100 of 100 ended.) `run_in_group`
    frees what the rank built before it destroys the group."""
    spawn_ranks(_ddp_rank_in_group, str(tmp_path))
    assert [(tmp_path / f"alive{r}.txt").read_text() for r in range(2)] == ["0", "0"]


def _never_ends(rank: int, init_file: str) -> None:
    time.sleep(3600)


@pytest.mark.timeout(120)
def test_ranks_that_never_end_are_killed_and_named():
    """A rank that never exits (a hang in the run or in its teardown) fails the test after the harness's limit,
    naming the ranks, instead of holding pytest past its own timeout."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank\(s\) \[0, 1\] of _never_ends still running after 5 s"):
        spawn_ranks(_never_ends, limit_s=5)
    assert time.monotonic() - start < 60
