"""The thread split between the training thread and the host worker (README, Threads; `hf_zenflow.threads`)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import hf_zenflow.threads
from hf_zenflow import ZenFlowAdamW


#: torch's own pool size, as `import hf_zenflow` found it (before any test fixture changes it).
TORCH_DEFAULT_THREADS = torch.get_num_threads()


def _zenflow(model: torch.nn.Module, **settings) -> ZenFlowAdamW:
    return ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=2, min_offload_numel=0,
                        **settings)


def _train(opt: ZenFlowAdamW, model: torch.nn.Module, steps: int = 3) -> None:
    for _ in range(steps):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()


def _worker_threads(opt: ZenFlowAdamW) -> int:
    seen: list[int] = []
    opt._worker.wait(opt._worker.submit("probe", lambda: seen.append(torch.get_num_threads())))
    return seen[0]


@pytest.fixture
def untouched_default_pool(monkeypatch):
    """A process whose training thread is at torch's default pool on as many cores, no OMP_NUM_THREADS, and no
    split reported yet."""
    if TORCH_DEFAULT_THREADS < 2:
        pytest.skip("needs torch's default pool to have 2 threads or more")
    cores = TORCH_DEFAULT_THREADS
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hf_zenflow.threads, "_POOL", hf_zenflow.threads._TrainingPool())
    torch.set_num_threads(cores)
    return cores


def test_worker_and_training_pool_fit_the_cores_and_the_split_is_reported_once(untouched_default_pool, caplog):
    cores = untouched_default_pool
    caplog.set_level(logging.WARNING, logger="hf_zenflow")
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model)
    _train(opt, model)
    worker, training = _worker_threads(opt), torch.get_num_threads()
    assert worker == max(1, cores // 2)
    assert worker + training <= cores
    second = _zenflow(model)
    _train(second, model)
    second.close()
    opt.close()
    _train(opt, model, steps=1)  # restarts the worker: same split
    opt.close()
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_zenflow threads")]
    assert len(reports) == 1
    assert f"host worker {worker} thread(s), training thread {training} (lowered from {cores}" in reports[0]
    assert torch.get_num_threads() == cores  # given back once no worker runs


def test_a_pool_the_user_chose_is_left_alone(untouched_default_pool, monkeypatch, caplog):
    cores = untouched_default_pool
    caplog.set_level(logging.WARNING, logger="hf_zenflow")
    model = torch.nn.Linear(32, 16)
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))
    opt = _zenflow(model)
    _train(opt, model)
    assert torch.get_num_threads() == cores
    opt.close()
    assert any(f"OMP_NUM_THREADS={cores}, left alone" in r.getMessage() for r in caplog.records)
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(cores - 1)  # after import hf_zenflow: the user's choice
    opt = _zenflow(model, cpu_threads=cores)
    _train(opt, model)
    assert torch.get_num_threads() == cores - 1
    opt.close()


def test_inline_host_steps_leave_the_training_pool_alone(untouched_default_pool):
    cores = untouched_default_pool
    model = torch.nn.Linear(32, 16)
    opt = _zenflow(model, overlap_step=False)
    _train(opt, model)
    assert torch.get_num_threads() == cores  # no worker runs beside the training thread
    opt.close()
