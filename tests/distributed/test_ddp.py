"""DDP with the host work split across ranks (`hf_zenflow.distributed.sharding`), in two real gloo processes.

Two ranks with a per-rank batch of B train like one process with a batch of 2B (same ZenFlow settings: overlap on,
Zen-auto windows, a re-selection inside the run), keep bitwise identical weights after every window, hold about half
the host state each, save and resume exactly per rank, refuse a state saved under another world size, and a
collective that times out raises instead of hanging."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import assert_each_rank_holds_at_most, assert_resumed_bitwise, run_in_group, spawn_ranks

from hf_zenflow import CheckpointError, ZenFlowAdamW, ZenFlowConfig, column_major_
from hf_zenflow.distributed.sharding import RankGroup, ShardCollectiveError, Share
from tests.conftest import zenflow_adamw


SETTINGS = dict(topk_ratio=0.25, update_interval="auto", full_warm_up_rounds=2,
                select_strategy="step", select_interval=8, min_offload_numel=0, cpu_threads=1, overlap_step=True)
#: the longest Zen-auto window of these runs, an engine rule (`ZenFlowConfig.with_rules`)
AUTO_MAX_INTERVAL = 4
#: (the write-back lag fixed: the reference runs compare against this schedule; the write-back from a buffer, as
#: ranks that share the host state keep it, so that one process's host state is what the ranks split)
RULES = ZenFlowConfig().with_rules(auto_max_interval=AUTO_MAX_INTERVAL, writeback_lag=1, host_writeback="buffer")
STEPS, PER_RANK, RANKS = 20, 4, 2
#: How close ranks that split the global batch come to one process on it (relative to each weight's norm): the
#: all-reduced gradients differ from one process's in their last bits, and the bf16 host moments, rounded
#: stochastically, take such a difference into one element's rounding about as often as it is a share of a bf16 step
#: (where rounding to nearest, whose stored moments stop moving, took it almost never); measured 3e-5 after 20 steps.
#: Random bits of the wrong elements (a share misplaced in the whole matrix) give 1e-4 to 1e-3, a misplaced share
#: of the weights 1e-2.
LIKE_ONE_PROCESS = 1e-4


class Net(torch.nn.Module):
    """Odd sizes (33 output features do not divide by 2 ranks) and a column-major weight (a strided share)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(24, 20)
        self.up = torch.nn.Linear(20, 33)
        self.norm = torch.nn.LayerNorm(33)
        self.down = torch.nn.Linear(33, 24, bias=False)
        column_major_(self.up)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.nn.functional.gelu(self.up(self.embed(tokens)))))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 24, (RANKS * PER_RANK, 6), generator=g),
             torch.randint(0, 24, (RANKS * PER_RANK, 6), generator=g)) for _ in range(STEPS)]


def _step(model: torch.nn.Module, opt: ZenFlowAdamW, x: torch.Tensor, y: torch.Tensor) -> None:
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(rank: int, steps: range, model: torch.nn.Module, opt: ZenFlowAdamW, windows: list | None = None) -> None:
    data = _data()
    for i in steps:
        x, y = data[i]
        part = slice(rank * PER_RANK, (rank + 1) * PER_RANK) if dist.is_initialized() else slice(None)
        before = opt.stats()["windows"]
        _step(model, opt, x[part], y[part])
        if windows is not None and opt.stats()["windows"] > before:
            windows.append(_weights(model))


def _ddp(model: torch.nn.Module) -> tuple[torch.nn.Module, ZenFlowAdamW]:
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = zenflow_adamw(model.parameters(), lr=1e-2, config=RULES, **SETTINGS)
    opt.name_parameters(model)
    return wrapped, opt


#: A write-back all-gather bucket that holds the embedding's and the up projection's shares together, not the down
#: projection's too (1920 + 2720 + 3168 bytes): two buckets per write-back.
BUCKET_BYTES = 6000


def _rank_run(rank: int, init_file: str, out_dir: str) -> None:
    run_in_group(rank, init_file, _rank_run_body, out_dir)


def _rank_run_body(rank: int, out_dir: str) -> None:
    import hf_zenflow.distributed.sharding as sharding

    sharding.GATHER_BUCKET_BYTES = BUCKET_BYTES
    model = _model()
    wrapped, opt = _ddp(model)
    windows: list = []
    _train(rank, range(STEPS), wrapped, opt, windows)
    stats = opt.stats()
    # the same run saved after 10 steps (mid-window) and resumed in a fresh model and optimizer
    first = _model()
    wrapped_a, opt_a = _ddp(first)
    _train(rank, range(10), wrapped_a, opt_a)
    saved_opt = opt_a.state_dict()
    path = os.path.join(out_dir, f"optimizer_rank{rank}.pt")
    torch.save(saved_opt, path)
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    if rank == 0:
        torch.save(saved_model, os.path.join(out_dir, "model_saved.pt"))
    opt_a.close()
    second = _model()
    second.load_state_dict(saved_model)
    wrapped_b, opt_b = _ddp(second)
    opt_b.load_state_dict(torch.load(path, weights_only=True))
    _train(rank, range(10, STEPS), wrapped_b, opt_b)
    torch.save({"windows": windows, "final": _weights(model), "stats": stats, "resumed": _weights(second),
                "flushed": _flushed(opt, model)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    opt.close()
    opt_b.close()


def _flushed(opt: ZenFlowAdamW, model: torch.nn.Module) -> list[torch.Tensor]:
    opt.flush()  # a collective (the last write-back): every rank calls it
    return _weights(model)


def _spawn(fn, *args) -> None:
    spawn_ranks(fn, *args, ranks=RANKS)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[dict, dict, str]:
    out = tmp_path_factory.mktemp("ddp")
    _spawn(_rank_run, str(out))
    return (torch.load(out / "rank0.pt", weights_only=True), torch.load(out / "rank1.pt", weights_only=True),
            str(out))


def _reference() -> tuple[Net, ZenFlowAdamW]:
    model = _model()
    opt = zenflow_adamw(model.parameters(), lr=1e-2, config=RULES, **SETTINGS)
    _train(0, range(STEPS), model, opt)
    return model, opt


@pytest.mark.timeout(240)
def test_two_ranks_train_like_one_process_on_the_global_batch(ddp_run):
    rank0, rank1, _ = ddp_run
    model, opt = _reference()
    try:
        stats = opt.stats()
        assert stats["reselections"] >= 2  # re-selections inside the run
        # more windows than warm-up plus the Zen-auto bound alone would close: some closed on Zen-auto's votes
        assert stats["windows"] > 2 + (STEPS - 2) // AUTO_MAX_INTERVAL
        for mine, ref in zip(rank0["final"], model.parameters()):
            rel = ((mine - ref.detach()).norm() / ref.detach().norm()).item()
            assert rel < LIKE_ONE_PROCESS, rel
        assert len(rank0["windows"]) == len(rank1["windows"]) == stats["windows"] > 0
        for w0, w1 in zip(rank0["windows"], rank1["windows"]):
            assert all(torch.equal(a, b) for a, b in zip(w0, w1))  # bitwise, after every window
        assert all(torch.equal(a, b) for a, b in zip(rank0["flushed"], rank1["flushed"]))
    finally:
        opt.close()


@pytest.mark.timeout(240)
def test_each_rank_holds_about_half_the_host_state(ddp_run):
    rank0, rank1, _ = ddp_run
    _, opt = _reference()
    try:
        single = opt.stats()["host_state_bytes"]
        assert opt.stats()["ranks"] == 1
    finally:
        opt.close()
    assert_each_rank_holds_at_most(0.55, [rank0["stats"], rank1["stats"]], single)
    for stats in (rank0["stats"], rank1["stats"]):  # the write-back's all-gather buffer: one bucket's, not all
        assert 0 < stats["gather_buffer_bytes"] <= BUCKET_BYTES


@pytest.mark.timeout(240)
def test_each_rank_resumes_exactly_from_its_own_share(ddp_run):
    rank0, rank1, _ = ddp_run
    assert_resumed_bitwise([rank0, rank1])


@pytest.mark.timeout(240)
def test_a_share_saved_under_two_ranks_does_not_load_in_one_process(ddp_run):
    _, _, out = ddp_run
    state = torch.load(os.path.join(out, "optimizer_rank0.pt"), weights_only=True)
    assert state["zenflow"]["ranks"] == 2 and state["zenflow"]["rank"] == 0
    opt = zenflow_adamw(_model().parameters(), lr=1e-2, config=RULES, **SETTINGS)
    try:
        with pytest.raises(CheckpointError, match=r"world size 2.*world size 1"):
            opt.load_state_dict(state)
    finally:
        opt.close()


@pytest.mark.timeout(240)
def test_the_ranks_shares_merged_resume_in_one_process(ddp_run):
    from hf_zenflow.checkpoint.reshard import merge_rank_states

    rank0, _, out = ddp_run
    merged = merge_rank_states([torch.load(os.path.join(out, f"optimizer_rank{r}.pt"), weights_only=True)
                                for r in range(RANKS)])
    assert "ranks" not in merged["zenflow"]
    model = _model()
    model.load_state_dict(torch.load(os.path.join(out, "model_saved.pt"), weights_only=True))
    opt = zenflow_adamw(model.parameters(), lr=1e-2, config=RULES, **SETTINGS)
    try:
        opt.load_state_dict(merged)
        assert opt.stats()["host_state_bytes"] > 0
        _train(0, range(10, STEPS), model, opt)
    finally:
        opt.close()
    for mine, ref in zip(_weights(model), rank0["final"]):
        assert ((mine - ref).norm() / ref.norm()).item() < 1e-5


def _rank_timeout(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=3))
    model = _model()
    opt = zenflow_adamw(model.parameters(), lr=1e-2, config=RULES, **{**SETTINGS, "full_warm_up_rounds": 0})
    data = _data()
    try:
        # no DDP: the ranks' first collective is the optimizer's own (the selection at step 0), which rank 1 never
        # joins: it stays alive and idle past the timeout
        if rank == 1:
            time.sleep(8)
            return
        try:
            _step(model, opt, *data[0])
            outcome = "no error"
        except ShardCollectiveError as exc:
            outcome = f"ShardCollectiveError: {exc}"
        with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
            f.write(outcome)
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_a_collective_that_times_out_raises_in_the_training_process(tmp_path):
    _spawn(_rank_timeout, str(tmp_path))
    outcome = (tmp_path / "rank0.txt").read_text()
    assert outcome.startswith("ShardCollectiveError") and "across 2 ranks failed on rank 0" in outcome, outcome


def test_shares_cover_every_index_once_with_padding():
    for size in (1, 2, 5, 33):
        for ranks in (1, 2, 3, 4):
            seen = []
            for rank in range(ranks):
                share = Share(0, size, ranks, rank)
                assert share.padded == -(-size // ranks) and 0 <= share.length <= share.padded
                seen += range(share.start, share.start + share.length)
            assert seen == list(range(size))


def test_one_rank_without_a_process_group():
    group = RankGroup.of(None)
    assert (group.ranks, group.rank) == (1, 0)
    t = torch.arange(6.0).view(2, 3)
    assert group.share(0, 2).local(t) is t
    group.all_reduce_sum([t])  # nothing to sum with
    assert torch.equal(t, torch.arange(6.0).view(2, 3))


# A second run: a one-process checkpoint resumed under two ranks (each takes its share), windows summed on the device,
# an embedding split by rows (its share is a range of hidden columns), sequential write-backs.
OTHER = dict(topk_ratio=0.25, update_interval=3, full_warm_up_rounds=1, select_strategy="step", select_interval=4,
             min_offload_numel=0, cpu_threads=1, overlap_step=False, accumulate_on="device")
#: (windows of 3 at lr 1e-2: the high-lr rule would shorten them to 1)
OTHER_RULES = ZenFlowConfig().with_rules(high_lr_rule="off")
HALF = STEPS // 2


def _other(model: Net) -> ZenFlowAdamW:
    rest = [p for n, p in model.named_parameters() if n != "embed.weight"]
    return zenflow_adamw([{"params": [model.embed.weight], "select_rows": True}, {"params": rest}], lr=1e-2,
                         config=OTHER_RULES, **OTHER)


def _rank_resume_one_process_state(rank: int, init_file: str, out_dir: str) -> None:
    run_in_group(rank, init_file, _rank_resume_one_process_state_body, out_dir)


def _rank_resume_one_process_state_body(rank: int, out_dir: str) -> None:
    saved = torch.load(os.path.join(out_dir, "single.pt"), weights_only=True)
    model = _model()
    model.load_state_dict(saved["model"])
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = _other(model)
    opt.load_state_dict(saved["optimizer"])
    windows: list = []
    _train(rank, range(HALF, STEPS), wrapped, opt, windows)
    host_bytes = opt.stats()["host_state_bytes"]
    torch.save({"windows": windows, "final": _weights(model), "host_bytes": host_bytes},
               os.path.join(out_dir, f"rank{rank}.pt"))
    opt.close()


@pytest.mark.timeout(240)
def test_a_one_process_state_resumes_under_two_ranks(tmp_path):
    model = _model()
    opt = _other(model)
    try:
        _train(0, range(HALF), model, opt)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "single.pt")
        assert opt.state_dict()["zenflow"]["window_steps"] > 0  # saved mid-window: its sum is re-sharded too
        _train(0, range(HALF, STEPS), model, opt)
        single_bytes = opt.stats()["host_state_bytes"]
    finally:
        opt.close()
    _spawn(_rank_resume_one_process_state, str(tmp_path))
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(RANKS))
    for mine, ref in zip(rank0["final"], model.parameters()):
        assert ((mine - ref.detach()).norm() / ref.detach().norm()).item() < 1e-5
    assert len(rank0["windows"]) == len(rank1["windows"]) > 0
    for w0, w1 in zip(rank0["windows"], rank1["windows"]):
        assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert rank0["host_bytes"] <= 0.6 * single_bytes and rank1["host_bytes"] <= 0.6 * single_bytes


def _auto_lag_run(rank: int, init_file: str, out_dir: str) -> None:
    run_in_group(rank, init_file, _auto_lag_body, out_dir)


def _auto_lag_body(rank: int, out_dir: str) -> None:
    """Each rank would choose another lag (stubbed: 1 on rank 0, 3 on rank 1): both must take the largest, 3."""
    import hf_zenflow.engine.writeback_lag as auto_lag

    auto_lag.auto_lag_from_sizes = lambda elements, longest: 1 + 2 * rank
    model = _model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = zenflow_adamw(model.parameters(), lr=1e-2, config=RULES.with_rules(writeback_lag="auto", high_lr_rule="off"),
                        **{**SETTINGS, "update_interval": 4})
    _train(rank, range(14), wrapped, opt)
    lag = opt.stats()["writeback_lag"]
    torch.save({"lag": lag, "weights": _flushed(opt, model)}, os.path.join(out_dir, f"auto{rank}.pt"))
    opt.close()


@pytest.mark.timeout(240)
def test_the_auto_write_back_lag_is_agreed_across_ranks(tmp_path):
    _spawn(_auto_lag_run, str(tmp_path))
    a, b = (torch.load(tmp_path / f"auto{r}.pt", weights_only=True) for r in range(RANKS))
    assert a["lag"] == b["lag"] == 3
    for p, q in zip(a["weights"], b["weights"]):
        assert torch.equal(p, q)
