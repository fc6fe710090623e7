"""The reference tests of DDP with the host work split across ranks, under an NCCL-like process group
(`nccl_double`): every collective the optimizer issues must take tensors on the collective device, as NCCL requires,
while the ranks still train like one process on the global batch and agree bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import DEVICE, run_in_group, spawn_ranks
from nccl_double import HostTensorRefused, install, uninstall
from test_ddp import (
    LIKE_ONE_PROCESS,
    PER_RANK,
    RANKS,
    SETTINGS,
    STEPS,
    _data,
    _ddp,
    _model,
    _reference,
    _step,
    _train,
    _weights,
)

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.transport import CopyTransport


# the double stands in for NCCL on CPU machines; on a GPU machine the real NCCL runs (scripts/gpu_check.sh)
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="a CPU stand-in for NCCL")


def _rank_run(rank: int, init_file: str, out_dir: str) -> None:
    run_in_group(rank, init_file, _rank_run_body, out_dir, ranks=RANKS)


def _rank_run_body(rank: int, out_dir: str) -> None:
    model = _model()
    wrapped, opt = _ddp(model)
    double = install([opt])
    try:
        windows: list = []
        _train(rank, range(STEPS), wrapped, opt, windows)
        final = _weights(model)
        stats = opt.stats()
        opt.flush()  # (a collective: the last write-back)
    finally:
        uninstall(double)
    torch.save({"windows": windows, "final": final, "flushed": _weights(model), "stats": stats,
                "checked": double.checked, "refusals": double.refusals}, os.path.join(out_dir, f"rank{rank}.pt"))
    opt.close()


@pytest.mark.timeout(240)
def test_two_ddp_ranks_through_a_reselection_use_device_tensors_only(tmp_path):
    spawn_ranks(_rank_run, str(tmp_path), ranks=RANKS)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(RANKS))
    for run in (rank0, rank1):
        assert run["refusals"] == [] and run["checked"] > 0
        assert run["stats"]["reselections"] >= 2  # re-selections (the device-column all-gather) inside the run
    assert len(rank0["windows"]) == len(rank1["windows"]) > 0
    for w0, w1 in zip(rank0["windows"], rank1["windows"]):
        assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert all(torch.equal(a, b) for a, b in zip(rank0["flushed"], rank1["flushed"]))
    model, opt = _reference()
    try:
        for mine, ref in zip(rank0["final"], model.parameters()):
            assert ((mine - ref.detach()).norm() / ref.detach().norm()).item() < LIKE_ONE_PROCESS
    finally:
        opt.close()


def test_the_double_refuses_host_state_and_what_is_computed_from_it():
    model = _model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **{**SETTINGS, "full_warm_up_rounds": 0})
    x, y = (torch.randint(0, 24, (PER_RANK, 6)) for _ in range(2))
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
    opt.step()  # one process: no collective; the host state now exists
    double = install([opt])
    try:
        master = next(s.host.master for s in opt.host_windows.splits.values() if s.host is not None)
        assert master.device != model.up.weight.device  # the host is not the device
        for host in (master, master.index_select(1, torch.tensor([0, 1])).float(), torch.zeros(3)):
            with pytest.raises(HostTensorRefused):
                dist.all_reduce(host)
        with pytest.raises(Exception) as raised:  # a device tensor gets through to gloo (no group here)
            dist.all_reduce(torch.zeros(3, device=model.up.weight.device))
        assert not isinstance(raised.value, HostTensorRefused)
        assert dist.get_backend() == "nccl"
    finally:
        uninstall(double)
        opt.close()
    assert len(double.refusals) == 3


def _rank_copying(rank: int, init_file: str, out_dir: str) -> None:
    """DDP on a transport that copies gradients to the host (CUDA's schedule without streams): the backward hooks
    start copies there, as on a GPU."""
    import hf_zenflow.transport as transport_package

    transport_package.transport_for = lambda device: CopyTransport()
    run_in_group(rank, init_file, _rank_copying_body, out_dir, ranks=RANKS)


def _rank_copying_body(rank: int, out_dir: str) -> None:
    model = _model()
    wrapped, opt = _ddp(model)
    double = install([opt])
    steps = []
    try:
        data = _data()
        for i in range(STEPS):
            x, y = data[i]
            part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            _step(wrapped, opt, x[part], y[part])
            share = sum(s.host_part(s.param).numel() * s.param.element_size()
                        for s in opt.host_windows.splits.values() if s.host is not None)
            steps.append((opt.stats()["bytes_to_host"], share))
        final = _weights(model)
        opt.flush()
    finally:
        uninstall(double)
    assert type(opt.host_windows.transport_of(next(iter(opt.host_windows.splits.values())))) is CopyTransport
    torch.save({"steps": steps, "final": final, "flushed": _weights(model), "refusals": double.refusals},
               os.path.join(out_dir, f"copy{rank}.pt"))
    opt.close()


@pytest.mark.timeout(240)
def test_under_ddp_each_gradient_crosses_to_the_host_once(tmp_path):
    """The backward hooks fire before DDP's all-reduce rewrites the gradient: a copy started there is thrown away
    and made again after the sync (twice the device->host traffic). Each step moves one copy of this rank's share
    of every offloaded matrix, and the ranks still train like one process."""
    spawn_ranks(_rank_copying, str(tmp_path), ranks=RANKS)
    rank0, rank1 = (torch.load(tmp_path / f"copy{r}.pt", weights_only=True) for r in range(RANKS))
    for run in (rank0, rank1):
        assert run["refusals"] == []
        moved = [(sent, share) for sent, share in run["steps"] if sent > 0]
        assert len(moved) >= STEPS // 2, run["steps"]
        for sent, share in moved:
            assert sent == share, run["steps"]  # one copy of this rank's share, not two
    assert all(torch.equal(a, b) for a, b in zip(rank0["flushed"], rank1["flushed"]))
    model, opt = _reference()
    try:
        for mine, ref in zip(rank0["final"], model.parameters()):
            assert ((mine - ref.detach()).norm() / ref.detach().norm()).item() < LIKE_ONE_PROCESS
    finally:
        opt.close()


def _rank_fsdp2(rank: int, init_file: str, out_dir: str) -> None:
    run_in_group(rank, init_file, _rank_fsdp2_body, out_dir, ranks=RANKS)


def _rank_fsdp2_body(rank: int, out_dir: str) -> None:
    import test_fsdp

    model = test_fsdp._shard(test_fsdp._model())
    opt = test_fsdp._zenflow(model)
    double = install([opt], roles=False)
    try:
        test_fsdp._train(model, opt, range(test_fsdp.STEPS))
        opt.flush()
    finally:
        uninstall(double)
    torch.save({"final": test_fsdp._full(model), "checked": double.checked, "refusals": double.refusals,
                "reselections": opt.stats()["reselections"]}, os.path.join(out_dir, f"fsdp{rank}.pt"))
    opt.close()


@pytest.mark.timeout(240)
def test_fsdp2_ranks_hand_no_host_state_to_a_collective(tmp_path, monkeypatch):
    import test_fsdp

    spawn_ranks(_rank_fsdp2, str(tmp_path), ranks=RANKS)
    rank0, rank1 = (torch.load(tmp_path / f"fsdp{r}.pt", weights_only=True) for r in range(RANKS))
    for run in (rank0, rank1):
        assert run["refusals"] == [] and run["checked"] > 0 and run["reselections"] >= 2
    model, opt, _ = test_fsdp._reference(monkeypatch)
    try:
        assert max(test_fsdp._relative_errors(rank0["final"], model)) < 1e-5
        assert all(torch.equal(a, b) for a, b in zip(rank0["final"], rank1["final"]))
    finally:
        opt.close()
