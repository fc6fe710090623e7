"""Re-sharding optimizer states between world sizes (`hf_zenflow.checkpoint.reshard`, `hf-zenflow
reshard-checkpoint`), on state dicts of a real one-process run: the cuts of N ranks merge back to the very state, for
DDP shares (row-major, column-major and row-selected matrices) and FSDP2 rows alike, and a checkpoint folder of 2
ranks is rewritten for 3 ranks and for one process. (Training across a re-shard:
tests/distributed/test_ddp.py, tests/distributed/test_fsdp.py.)"""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import CheckpointError, ZenFlowAdamW, ZenFlowConfig, column_major_
from hf_zenflow.checkpoint.reshard import ddp_share_of, fsdp_rows_of, merge_rank_states, reshard_states
from hf_zenflow.cli import main as cli
from hf_zenflow.hf.rank_checkpoint import load_rank_state, rank_file_name, reshard_checkpoint, save_rank_state


SETTINGS = dict(topk_ratio=0.25, update_interval=3, full_warm_up_rounds=1, select_strategy="step", select_interval=4,
                min_offload_numel=0, cpu_threads=1, overlap_step=True)
RULES = ZenFlowConfig().with_rules(writeback_lag=1, high_lr_rule="off")


def _state(layout: str) -> dict:
    """A one-process state saved mid-window: an embedding (rows selected when `layout` is "rows"), a 33-feature
    matrix (column-major when `layout` is "column"), a 1-row matrix."""
    torch.manual_seed(0)
    embed, up, gate = torch.nn.Embedding(24, 20), torch.nn.Linear(20, 33), torch.nn.Linear(33, 1, bias=False)
    if layout == "column":
        column_major_(up)
    groups = [{"params": [embed.weight], "select_rows": layout == "rows"}, {"params": [up.weight, up.bias]},
              {"params": [gate.weight]}]
    opt = ZenFlowAdamW(groups, lr=1e-2, config=RULES, **SETTINGS)
    try:
        for step in range(7):
            tokens = torch.randint(0, 24, (4, 6), generator=torch.Generator().manual_seed(step))
            gate(torch.nn.functional.gelu(up(embed(tokens)))).square().mean().backward()
            opt.step()
            opt.zero_grad()
        state = opt.state_dict()
        assert state["zenflow"]["window_steps"] > 0
        return state
    finally:
        opt.close()


def _same(a: dict, b: dict) -> None:
    assert a["zenflow"] == b["zenflow"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        other = b["state"][index]
        assert entry.keys() == other.keys(), index
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[key]), (index, key)
            else:
                assert value == other[key], (index, key)


class _Saved:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


@pytest.mark.parametrize("layout", ["row", "column", "rows"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_shares_merge_back_to_the_one_process_state(layout, ranks):
    state = _state(layout)
    shares = [ddp_share_of(state, ranks, r) for r in range(ranks)]
    host = next(e for e in shares[0]["state"].values() if "share" in e)
    assert host["host_exp_avg"].numel() < state["state"][0]["host_exp_avg"].numel()  # a share, not a copy
    _same(merge_rank_states(shares[::-1]), state)


@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp2_rows_merge_back_to_the_one_process_state(ranks):
    state = _state("row")
    parts = [fsdp_rows_of(state, ranks, r) for r in range(ranks)]
    assert [p["state"][3]["shape"][0] for p in parts] == [1] + [0] * (ranks - 1)  # the 1-row matrix
    assert sum(p["state"][1]["shape"][0] for p in parts) == 33
    _same(merge_rank_states(parts), state)


def test_states_of_missing_ranks_or_of_several_runs_are_refused():
    state = _state("row")
    with pytest.raises(CheckpointError, match=r"world size 3 needs the states of ranks 0..2; got ranks \[0, 2\]"):
        merge_rank_states([ddp_share_of(state, 3, 0), ddp_share_of(state, 3, 2)])
    with pytest.raises(CheckpointError, match="different runs or world sizes"):
        merge_rank_states([ddp_share_of(state, 2, 0), fsdp_rows_of(state, 2, 1)])
    with pytest.raises(ValueError, match="parallel='zero3' is invalid"):
        reshard_states([state], 2, "zero3")


def test_a_two_rank_checkpoint_folder_is_rewritten_for_three_ranks_and_for_one(tmp_path, capsys):
    state = _state("column")
    for rank in range(2):
        save_rank_state(_Saved(ddp_share_of(state, 2, rank)), str(tmp_path), rank, 2)
    assert cli(["reshard-checkpoint", str(tmp_path), "--world-size", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / f"{rank_file_name(0, 2)}.before_reshard").is_file()
    three = [load_rank_state(str(tmp_path), r, 3) for r in range(3)]
    assert [s["zenflow"]["rank"] for s in three] == [0, 1, 2]
    _same(merge_rank_states(three), state)
    written = reshard_checkpoint(str(tmp_path), 1, log=lambda *_: None)
    assert written == [str(tmp_path / "optimizer.pt")]
    _same(torch.load(tmp_path / "optimizer.pt", weights_only=True), state)
    assert load_rank_state(str(tmp_path), 0, 1) is not None  # one process resumes it
    assert cli(["reshard-checkpoint", str(tmp_path / "nothing"), "--world-size", "2"]) == 2


def test_repeated_reshards_keep_every_earlier_backup(tmp_path):
    """Regression: a second `reshard-checkpoint` run overwrote the first run's .before_reshard backups (the
    original files were lost)."""
    state = _state("row")
    torch.save(state, tmp_path / "optimizer.pt")
    original = (tmp_path / "optimizer.pt").read_bytes()
    reshard_checkpoint(str(tmp_path), 2, log=lambda *_: None)
    reshard_checkpoint(str(tmp_path), 1, log=lambda *_: None)
    second_one_process = (tmp_path / "optimizer.pt").read_bytes()
    reshard_checkpoint(str(tmp_path), 2, log=lambda *_: None)
    backups = sorted(p.name for p in tmp_path.iterdir() if ".before_reshard" in p.name)
    assert (tmp_path / "optimizer.pt.before_reshard").read_bytes() == original
    assert [p for p in backups if p.startswith("optimizer.pt.")] == ["optimizer.pt.before_reshard",
                                                                      "optimizer.pt.before_reshard.2"]
    assert (tmp_path / "optimizer.pt.before_reshard.2").read_bytes() == second_one_process
    assert f"{rank_file_name(0, 2)}.before_reshard" in backups  # the 2-rank files the second run replaced


def test_a_reshard_that_fails_while_writing_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch):
    """Regression: the old files were renamed to their backups before the new ones were written: a run killed
    while writing left no optimizer file under its name, and a re-run said "no ZenFlow optimizer file ... to
    re-shard" without a word about the backups."""
    torch.save(_state("row"), tmp_path / "optimizer.pt")
    original = (tmp_path / "optimizer.pt").read_bytes()
    calls, save = [], torch.save

    def dies_on_the_second_file(payload, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        save(payload, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_on_the_second_file)
    with pytest.raises(OSError):
        reshard_checkpoint(str(tmp_path), 2, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt"]
    assert (tmp_path / "optimizer.pt").read_bytes() == original


def test_a_rerun_after_an_interrupted_reshard_names_the_backups(tmp_path):
    torch.save(_state("row"), tmp_path / "optimizer.pt.before_reshard")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt\.before_reshard.*mv .*optimizer\.pt\.before_reshard "
                                              r".*optimizer\.pt\b"):
        reshard_checkpoint(str(tmp_path), 2, log=lambda *_: None)


def test_more_ranks_than_the_longest_dimension_are_refused(tmp_path, capsys):
    """Regression: `hf-zenflow reshard-checkpoint CKPT --world-size 1000000000` printed "reading ..." and never
    ended (it cut a state for every rank). The longest dimension of these parameters is 33: 33 ranks are cut, 34
    refused, by the function and by the command on a folder without weights (the command refuses a folder with
    weights before reading anything: tests/compare/test_cli_inputs.py)."""
    state = _state("row")
    assert len(reshard_states([state], 33, "fsdp2")) == 33
    with pytest.raises(ValueError, match="world_size=34 is invalid: allowed is at most 33"):
        reshard_states([state], 34)
    torch.save(state, tmp_path / "optimizer.pt")
    assert cli(["reshard-checkpoint", str(tmp_path), "--world-size", "1000000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world_size=1000000000 is invalid: allowed is at most 33" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt"]
