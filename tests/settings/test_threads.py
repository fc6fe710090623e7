"""The thread split between the training thread and the host worker (docs/threads.md;
`hf_zenflow.settings.threads`)."""

from __future__ import annotations

import copy
import logging
import os
import threading

import pytest
import torch

import hf_zenflow.settings.threads
from hf_zenflow import ZenFlowAdamW


#: torch's own pool size, as `import hf_zenflow` found it (before any test fixture changes it).
TORCH_DEFAULT_THREADS = torch.get_num_threads()


def _zenflow(model: torch.nn.Module, **settings) -> ZenFlowAdamW:
    values = dict(lr=1e-3, topk_ratio=0.25, update_interval=2, min_offload_numel=0)
    values.update(settings)
    return ZenFlowAdamW(model.parameters(), **values)


def _train(opt: ZenFlowAdamW, model: torch.nn.Module, steps: int = 3, pools: list[int] | None = None) -> None:
    """`steps` steps; `pools` gets the training thread's pool before each forward and after each step."""
    for _ in range(steps):
        if pools is not None:
            pools.append(torch.get_num_threads())
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
        if pools is not None:
            pools.append(torch.get_num_threads())


def _worker_threads(opt: ZenFlowAdamW) -> int:
    seen: list[int] = []
    opt.host_windows.worker.wait(opt.host_windows.worker.submit("probe", lambda: seen.append(torch.get_num_threads())))
    return seen[0]


def _host_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "hf_zenflow-host"}


def _reports(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_zenflow threads")]


@pytest.fixture
def untouched_default_pool(monkeypatch):
    """A process whose training thread is at torch's default pool on as many cores, no OMP_NUM_THREADS, one rank,
    and no split reported yet."""
    if TORCH_DEFAULT_THREADS < 2:
        pytest.skip("needs torch's default pool to have 2 threads or more")
    cores = TORCH_DEFAULT_THREADS
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(hf_zenflow.settings.threads, "_POOL", hf_zenflow.settings.threads._TrainingPool())
    torch.set_num_threads(cores)
    return cores


def test_the_pool_is_decided_when_the_optimizer_is_built_and_kept_until_close(untouched_default_pool, caplog):
    cores = untouched_default_pool
    caplog.set_level(logging.WARNING, logger="hf_zenflow")
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model)
    decided = torch.get_num_threads()  # before any forward
    assert decided == max(1, cores - max(1, cores // 2)) < cores
    pools: list[int] = []
    _train(opt, model, pools=pools)
    worker = _worker_threads(opt)
    assert worker == max(1, cores // 2) and worker + decided <= cores
    opt.host_windows.stop_worker()  # the worker stops and restarts within the run (as a resume with new settings does)
    _train(opt, model, steps=2, pools=pools)
    assert pools == [decided] * 10  # never changed across the worker's start, stop and restart
    reports = _reports(caplog)
    assert len(reports) == 1
    assert f"host worker {worker} thread(s), training thread {decided} (lowered from {cores}" in reports[0]
    assert "together" not in reports[0]
    opt.close()  # the end of the run
    assert torch.get_num_threads() == cores
    assert opt.host_windows.worker is None


def test_a_resumed_run_gets_the_fresh_runs_pool_before_its_first_forward(untouched_default_pool):
    """The same decision for a fresh and a resumed run, at every step (the rounding of a CPU forward/backward
    depends on the pool): the resumed optimizer is built, as the fresh one, before its first forward."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    fresh_pools: list[int] = []
    fresh = _zenflow(model)
    _train(fresh, model, steps=3, pools=fresh_pools)
    state = copy.deepcopy(fresh.state_dict())
    _train(fresh, model, steps=3, pools=fresh_pools)
    fresh.close()
    assert torch.get_num_threads() == untouched_default_pool  # between the runs: torch's own pool again
    resumed_pools: list[int] = []
    resumed = _zenflow(model)
    resumed.load_state_dict(state)
    _train(resumed, model, steps=3, pools=resumed_pools)
    resumed.close()
    assert len(set(fresh_pools)) == 1 and resumed_pools == fresh_pools[6:]


def test_a_later_run_after_close_claims_the_cores_before_its_first_forward(untouched_default_pool):
    """The Trainer closes the optimizer at the end of `train()` and calls `optimizer.train()` before every training
    step: a second `train()` gets the first one's pool from its first forward on."""
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model)
    decided = torch.get_num_threads()
    _train(opt, model)
    opt.close()
    assert torch.get_num_threads() == untouched_default_pool
    opt.drained_by = "this test"  # (what a Trainer's ZenFlowCallback sets before the first step)
    opt.train()  # (what the Trainer calls before each step's forward)
    pools: list[int] = []
    _train(opt, model, pools=pools)
    assert pools == [decided] * 6
    opt.close()


def test_omp_num_threads_is_a_ceiling_and_the_split_fits_the_cores(untouched_default_pool, monkeypatch, caplog):
    """A launcher's OMP_NUM_THREADS (accelerate on a CPU machine: the physical cores) is lowered like torch's
    default, so that the worker and the training thread fit the process's cores (not "together 3 > 2 cores")."""
    cores = untouched_default_pool
    caplog.set_level(logging.WARNING, logger="hf_zenflow")
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))  # torch's pool as such a launcher leaves it
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model)
    _train(opt, model)
    worker, training = _worker_threads(opt), torch.get_num_threads()
    assert worker + training <= cores
    opt.close()
    (report,) = _reports(caplog)
    assert f"lowered from {cores} (OMP_NUM_THREADS={cores})" in report and "together" not in report


def test_a_pool_the_user_chose_is_kept(untouched_default_pool, caplog):
    cores = untouched_default_pool
    caplog.set_level(logging.WARNING, logger="hf_zenflow")
    torch.set_num_threads(cores - 1)  # after import hf_zenflow: the user's choice
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model, cpu_threads=cores)
    _train(opt, model)
    assert torch.get_num_threads() == cores - 1
    opt.close()
    assert torch.get_num_threads() == cores - 1
    (report,) = _reports(caplog)
    assert "set with torch.set_num_threads, kept" in report and f"together {2 * cores - 1} > {cores}" in report


def test_inline_host_steps_leave_the_training_pool_alone(untouched_default_pool):
    cores = untouched_default_pool
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model, overlap_step=False)
    _train(opt, model)
    assert torch.get_num_threads() == cores  # no worker runs beside the training thread
    opt.close()


@pytest.mark.parametrize("why", ["below-min-offload-numel", "frozen", "topk-1"])
def test_nothing_offloaded_starts_no_worker_and_keeps_the_pool(untouched_default_pool, why, caplog):
    cores = untouched_default_pool
    caplog.set_level(logging.WARNING, logger="hf_zenflow")
    before = _host_threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 16))
    settings = {"below-min-offload-numel": dict(min_offload_numel=32 * 16 + 1), "topk-1": dict(topk_ratio=1.0),
                "frozen": {}}[why]
    if why == "frozen":
        model[0].weight.requires_grad_(False)  # a LoRA-like model: the large matrix is frozen, the rest stays put
        settings = dict(min_offload_numel=32 * 16)
    ref_model = copy.deepcopy(model)
    reference = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    opt = _zenflow(model, **settings)
    pools: list[int] = []
    for step in range(4):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        pools.append(torch.get_num_threads())
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        ref_model(x).square().sum().backward()
        reference.step()
        reference.zero_grad()
        assert _host_threads() <= before
    assert pools == [cores] * 4 and torch.get_num_threads() == cores
    assert opt.host_windows.worker is None or not opt.host_windows.worker.background
    assert not _reports(caplog)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)  # plain (fused) AdamW, bit for bit
    opt.close()


def test_something_offloaded_after_all_gets_a_worker_but_the_pool_stays(untouched_default_pool):
    """A matrix unfrozen after the optimizer was built is offloaded after all: a worker starts for it, and the pool,
    decided when the optimizer was built, does not change mid-run."""
    cores = untouched_default_pool
    model = torch.nn.Linear(32, 16)
    model.weight.requires_grad_(False)
    opt = _zenflow(model)
    _train(opt, model, steps=1)
    model.weight.requires_grad_(True)
    pools: list[int] = []
    _train(opt, model, steps=3, pools=pools)
    assert opt.host_windows.worker.background and opt.host_windows.worker._thread.is_alive()
    assert pools == [cores] * 6
    opt.close()


def test_ranks_on_a_node_share_its_cores_unless_the_launcher_pinned_them(monkeypatch):
    machine = set(range(8))
    affinity = {0: machine, os.getppid(): machine}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity[pid])
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a container's cpuset: 8 of the host's 64 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert hf_zenflow.settings.threads.rank_cpu_count() == 2  # the launcher's own affinity: 4 ranks share the 8 cores
    affinity[0] = {2, 3}  # pinned by the launcher (mpirun --bind-to, numactl per rank): its own cores
    assert hf_zenflow.settings.threads.rank_cpu_count() == 2
    affinity[0] = {0, 1, 2, 3}
    assert hf_zenflow.settings.threads.rank_cpu_count() == 4  # (not divided again)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    affinity[0] = machine
    assert hf_zenflow.settings.threads.rank_cpu_count() == 8


def test_one_core_per_rank_gives_one_thread_each_and_says_so(untouched_default_pool, monkeypatch, caplog):
    """torchrun with 2 ranks on 2 cores: each rank has 1 core; the worker and the training thread run 1 thread
    each (no OpenMP team to spin), and the report says it is the least an overlapped worker takes."""
    caplog.set_level(logging.WARNING, logger="hf_zenflow")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(untouched_default_pool))
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model)
    _train(opt, model)
    assert torch.get_num_threads() == 1 and _worker_threads(opt) == 1
    opt.close()
    (report,) = _reports(caplog)
    assert "1 core(s) for this process" in report and "one thread each on 1 core" in report


def test_a_release_run_by_garbage_collection_inside_a_claim_does_not_deadlock(monkeypatch):
    """Garbage collection may finalize an unreachable optimizer (its `__del__` closes it and releases its claim) on
    the thread that is inside another optimizer's claim, holding the pool's lock: the release must go through."""
    pool = hf_zenflow.settings.threads._TrainingPool()
    collected, built = object(), object()
    pool.claim(collected, 1)
    announce = pool._announce

    def announce_after_a_collection(threads: int, claimed: bool) -> None:
        pool.release(collected)  # (what the finalizer does when the announcement's allocations trigger the GC)
        announce(threads, claimed)

    monkeypatch.setattr(pool, "_announce", announce_after_a_collection)
    done = threading.Event()
    claimer = threading.Thread(target=lambda: (pool.claim(built, 1), done.set()), daemon=True)
    claimer.start()
    claimer.join(timeout=30)
    assert done.is_set(), "the claim deadlocked on the release made inside it"
    assert list(pool.claims) == [id(built)]
    pool.release(built)
    assert not pool.claims
