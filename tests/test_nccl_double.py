"""The reference tests of DDP with the host work split across ranks, under an NCCL-like process group
(`nccl_double`): every collective the optimizer issues must take tensors on the collective device, as NCCL requires,
while the ranks still train like one process on the global batch and agree bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import init_ranks, spawn_ranks
from nccl_double import HostTensorRefused, install, uninstall
from test_ddp import PER_RANK, RANKS, SETTINGS, STEPS, _ddp, _model, _reference, _train, _weights

from hf_zenflow import ZenFlowAdamW


def _rank_run(rank: int, init_file: str, out_dir: str) -> None:
    init_ranks(rank, init_file, RANKS)
    try:
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
    finally:
        dist.destroy_process_group()


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
            assert ((mine - ref.detach()).norm() / ref.detach().norm()).item() < 1e-5
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
        master = next(s.host.master for s in opt._host.splits.values() if s.host is not None)
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
