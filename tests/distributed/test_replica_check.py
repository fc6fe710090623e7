"""More than one process: each process is told once how the host work is shared: split across the ranks (the
default), or replicated in every process (a process group of one rank), with a warning.

A real 2-process gloo group checks the once-per-process rule itself; the calls from `ZenFlowPlugin` and
`ZenFlowTrainer` are checked in this process under torch's fake 2-rank process group (building optimizers and
importing transformers in two fresh processes takes many seconds on a small machine)."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_zenflow.distributed import replica_check as distributed_check
from hf_zenflow.distributed.replica_check import ReplicatedHostStateWarning, note_host_split, warn_if_replicated


def _replication_warnings(build, times: int) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(times):
            build().close()
    return [str(w.message) for w in seen if issubclass(w.category, ReplicatedHostStateWarning)]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            split = [note_host_split(2) for _ in range(3)]  # the default: shared by both ranks, nothing to warn
            distributed_check._warned = False
            said = [note_host_split(1) for _ in range(3)]  # a group of one rank: replicated
        messages = [str(w.message) for w in seen if issubclass(w.category, ReplicatedHostStateWarning)]
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{split} {said} {len(messages)}\n{messages[0] if messages else ''}")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_gloo_processes_warn_once_each(tmp_path):
    # the rendezvous file lives outside pytest's numbered temp folders, which a concurrent pytest session may prune
    rendezvous = tempfile.mkdtemp(prefix="hf_zenflow_pg_")
    try:
        mp.spawn(_worker, args=(os.path.join(rendezvous, "pg_init"), str(tmp_path)), nprocs=2, join=True)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)
    for rank in (0, 1):
        counts, message = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        # three calls each, said once; one warning, for the replicated case, in each process
        assert counts == "[True, False, False] [True, False, False] 1"
        assert f"under 2 processes (rank {rank})" in message and "2x the host memory" in message


@pytest.fixture
def two_rank_group(monkeypatch):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setattr(distributed_check, "_warned", False)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_plugin_does_not_warn_under_two_ranks(two_rank_group):
    # its optimizer shares the host work across the default group's ranks: nothing is replicated
    from hf_zenflow.hf.accelerate_plugin import ZenFlowPlugin

    seen = _replication_warnings(
        lambda: ZenFlowPlugin(cpu_threads=1).create_optimizer(torch.nn.Linear(8, 8).parameters()), times=3)
    assert seen == []


def test_trainer_does_not_warn_under_two_ranks(two_rank_group, tmp_path):
    from transformers import TrainingArguments

    from hf_zenflow.hf.trainer import ZenFlowTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")

    def build():
        trainer = ZenFlowTrainer(model=torch.nn.Linear(8, 8), args=args)
        trainer.create_optimizer()
        return trainer.zenflow_optimizer

    assert _replication_warnings(build, times=2) == []


def test_no_warning_without_a_process_group():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_replicated() is False
