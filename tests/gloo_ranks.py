"""Running a function in two (or N) real gloo processes from a test: `spawn_ranks` and `init_ranks`; the device and
rank count of the distributed tests (`DEVICE`, `RANKS`, `several_ranks`)."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 - before any rank's init_process_group: see below
import torch.multiprocessing as mp


# torch.distributed.nn.functional binds `group.WORLD` as a default argument when first imported; DDP imports it
# (through torch.distributed._shard) when built. Imported after init_process_group, it pins the default gloo group
# so that destroy_process_group frees nothing: gloo's threads live on into interpreter finalization, where one that
# drops its last completed collective late (a busy CI machine) takes the GIL to free the tensors' Python objects,
# is ended by Python with pthread_exit inside a C++ destructor, and aborts the rank ("terminate called without an
# active exception"). Imported here first, its defaults hold no group and destroy_process_group joins the threads.


#: "cpu" in CI (gloo, 2 ranks); `scripts/gpu_check.sh` sets "cuda": NCCL, one rank per GPU of the machine (one GPU:
#: world size 1 through the same code).
DEVICE = os.environ.get("HF_ZENFLOW_TEST_DEVICE", "cpu")
RANKS = 2 if DEVICE == "cpu" else torch.cuda.device_count()
several_ranks = pytest.mark.skipif(RANKS < 2, reason=f"needs 2 ranks; {DEVICE} has {RANKS}")


#: How long `spawn_ranks` waits for its ranks to exit (below the 240 s the distributed tests allow themselves, so a
#: rank that never exits is reported by name, and killed, before pytest-timeout gives up on the whole session).
RANKS_LIMIT_S = 200.0


def spawn_ranks(fn, *args, ranks: int = 2, limit_s: float = RANKS_LIMIT_S) -> None:
    """``fn(rank, init_file, *args)`` in `ranks` processes; a failure in any of them fails the caller, and so do
    ranks still running after `limit_s` seconds (killed, so that no rank outlives the test)."""
    # the rendezvous file lives outside pytest's numbered temp folders, which a concurrent pytest session may prune
    rendezvous = tempfile.mkdtemp(prefix="hf_zenflow_pg_")
    try:
        context = mp.spawn(fn, args=(os.path.join(rendezvous, "pg_init"), *args), nprocs=ranks, join=False)
        deadline = time.monotonic() + limit_s
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                stuck = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                        process.join()
                raise AssertionError(f"rank(s) {stuck} of {fn.__name__} still running after {limit_s:g} s (killed): "
                                     "a hang in the run or in its teardown")
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


def run_in_group(rank: int, init_file: str, body: Callable[..., None], *args, ranks: int = 2, device: str = "cpu",
                 timeout_s: float = 60) -> None:
    """``body(rank, *args)`` between `init_ranks` and ``destroy_process_group``, with everything `body` built gone
    before the group is destroyed.

    A DDP model's C++ `Reducer` holds the process group. Freed after ``destroy_process_group`` (when the rank
    function returns), it drops the group's last reference while holding the GIL, and gloo's destructor then waits for
    its work mutex, which a ``pt_gloo_runloop`` thread may hold while it frees the last collective's tensors and waits
    for the GIL: a deadlock (seen: ``ProcessGroupGloo::~ProcessGroupGloo <- Reducer::~Reducer`` in the main thread,
    ``gil_scoped_acquire <- AsyncAllgatherWork::~AsyncAllgatherWork`` in the runloop). Freed first, the Reducer leaves
    the group to ``destroy_process_group``, whose release of it lets the GIL go. So `body` returns (its frame, with
    its models, is gone), a failure's traceback keeps its text but not its frames' variables, and then the group is
    destroyed."""
    init_ranks(rank, init_file, ranks, timeout_s=timeout_s, device=device)
    try:
        body(rank, *args)
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # (the frames' variables: a DDP model among them)
        raise
    finally:
        gc.collect()  # (a model in a reference cycle)
        dist.destroy_process_group()


def init_ranks(rank: int, init_file: str, ranks: int = 2, timeout_s: float = 60, device: str = "cpu") -> None:
    """Join the group of a `spawn_ranks` run: gloo on CPU (one compute thread per process: 2 cores are shared), or
    NCCL with one GPU per rank (`scripts/gpu_check.sh`)."""
    torch.set_num_threads(1)
    free_gradients_in_ranks()
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def free_gradients_in_ranks() -> None:
    """In a rank process of a test run with ``HF_ZENFLOW_TEST_FREE_GRADIENTS=on``: every optimizer frees its gradients
    in backward where it applies (the rule ``free_gradients_in_backward="auto"`` becomes "on"), as the test's own
    process does (`tests/conftest.py`, which passes the mode on in the environment)."""
    if os.environ.get("HF_ZENFLOW_TEST_FREE_GRADIENTS_IN_RANKS") != "on":
        return
    from hf_zenflow.settings.config import ZenFlowConfig

    original = ZenFlowConfig.__post_init__
    if getattr(original, "_frees_gradients", False):
        return

    def post_init(self: ZenFlowConfig) -> None:
        original(self)
        if self.rules.free_gradients_in_backward == "auto":
            self.rules = dataclasses.replace(self.rules, free_gradients_in_backward="on")

    post_init._frees_gradients = True  # type: ignore[attr-defined]
    ZenFlowConfig.__post_init__ = post_init  # type: ignore[method-assign]


def gloo_threads() -> int:
    """gloo's threads in this process (``pt_gloo_runloop``, ``gloo_tcp_loop``): none once its groups are destroyed."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith(("pt_gloo", "gloo"))
        except OSError:  # the thread ended meanwhile
            pass
    return count


def assert_each_rank_holds_at_most(fraction: float, rank_stats: list[dict], single: float) -> None:
    """Every rank's ``stats()`` reports all ranks and host state bytes of at most `fraction` of one process's."""
    for stats in rank_stats:
        assert stats["ranks"] == len(rank_stats)
        assert 0 < stats["host_state_bytes"] <= fraction * single, (stats["host_state_bytes"], single)


def assert_resumed_bitwise(runs: list[dict]) -> None:
    """Each rank's resumed run ended with exactly the weights of its uninterrupted run."""
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run["resumed"], run["final"]))
