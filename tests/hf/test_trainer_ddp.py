"""`ZenFlowTrainer` and `ZenFlowPlugin` under `torchrun --nproc_per_node 2` (DDP on gloo, CPU), each rank a real
process (`hf_ddp_worker.py`): ranks agree bitwise, every rank saves and restores its own optimizer file (Trainer
checkpoints and the plugin's ``accelerator.save_state`` / ``load_state``), a resume
from a mid-window checkpoint equals the uninterrupted run bitwise, another world size is refused naming both, a
dead or silent rank ends the other with an error within the process group's timeout, and a model sharded with
`fully_shard` outside the Trainer (whose FSDP is off) is refused clearly (FSDP2 through the Trainer:
`test_trainer_fsdp.py`). The per-rank file logic itself is also tested without processes (`rank_checkpoint`)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from gloo_ranks import DEVICE, RANKS, several_ranks
from hf_ddp_worker import run_plugin
from hf_helpers import assert_rank_files, assert_same_weights, rank_results, tiny_llama, zenflow_args
from hf_helpers import torchrun as launch

from hf_zenflow import CheckpointError, ZenFlowPlugin, ZenFlowTrainer
from hf_zenflow.hf.rank_checkpoint import (
    ACCELERATE_OPTIMIZER_NAME,
    OPTIMIZER_NAME,
    load_rank_state,
    rank_file_name,
    rank_files_pointer,
    reshard_checkpoint,
    save_rank_state,
    saved_world_sizes,
)


WORKER = Path(__file__).with_name("hf_ddp_worker.py")


def torchrun(out: Path, *worker_args: str, nproc: int = RANKS, device: str = DEVICE) -> subprocess.CompletedProcess:
    return launch(WORKER, out, *worker_args, nproc=nproc, device=device)


def results(out: Path, proc: subprocess.CompletedProcess, nproc: int = RANKS) -> list[dict]:
    return rank_results(out, proc, nproc)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """12 steps on `RANKS` ranks (windows of 4 steps), checkpointing at step 6: mid-window."""
    out = tmp_path_factory.mktemp("ddp_full")
    return out, results(out, torchrun(out, "trainer", "--max-steps", "12", "--save-steps", "6"))


@pytest.mark.slow
def test_trainer_ddp_trains_and_ranks_agree_bitwise(full_run):
    _, (rank0, *others) = full_run
    for other in others:
        assert other["world_size"] == RANKS
        assert_same_weights(rank0["weights"], other["weights"])
        assert other["losses"] == rank0["losses"]
    assert rank0["world_size"] == RANKS and len(rank0["losses"]) == 12
    assert rank0["losses"][-1] < rank0["losses"][0] - 0.1
    # trained: far from the initial weights
    init = tiny_llama().state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(init[name], rank0["weights"][name])


@pytest.mark.slow
def test_trainer_ddp_checkpoint_has_one_optimizer_file_per_rank(full_run):
    out, _ = full_run
    checkpoint = out / "run" / "checkpoint-6"
    assert (checkpoint / "scheduler.pt").is_file()
    if RANKS == 1:  # one GPU: the Trainer's own optimizer.pt, as without torchrun
        assert (checkpoint / "optimizer.pt").is_file() and not saved_world_sizes(str(checkpoint))
        return
    assert not (checkpoint / "optimizer.pt").exists()  # the one-process file would hold one rank's state only
    assert_rank_files(checkpoint, RANKS)


@pytest.mark.slow
def test_trainer_ddp_resume_mid_window_equals_the_uninterrupted_run(full_run, tmp_path):
    out, (full0, _) = full_run
    proc = torchrun(tmp_path, "trainer", "--max-steps", "12", "--resume", str(out / "run" / "checkpoint-6"))
    resumed = results(tmp_path, proc)
    for rank in resumed:
        assert_same_weights(rank["weights"], full0["weights"])
    # log_history of steps 1-6 comes from the checkpoint; steps 7-12 were trained again
    assert resumed[0]["losses"] == full0["losses"]


@pytest.mark.slow
@several_ranks
def test_two_rank_checkpoint_is_refused_in_one_process(full_run, tmp_path, train_dataset):
    out, _ = full_run
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(tmp_path, max_steps=12),
                             train_dataset=train_dataset)
    with pytest.raises(CheckpointError, match=rf"saved by {RANKS} processes \(world size {RANKS}\).*world size 1"):
        trainer.train(resume_from_checkpoint=str(out / "run" / "checkpoint-6"))


@pytest.mark.slow
@several_ranks
def test_a_two_rank_checkpoint_resharded_for_one_process_resumes_there(full_run, tmp_path, train_dataset):
    out, _ = full_run
    checkpoint = tmp_path / "checkpoint-6"
    shutil.copytree(out / "run" / "checkpoint-6", checkpoint)
    reshard_checkpoint(str(checkpoint), 1, log=lambda *_: None)
    assert (checkpoint / OPTIMIZER_NAME).is_file() and saved_world_sizes(str(checkpoint)) == set()
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(tmp_path / "run", max_steps=12),
                             train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    # the optimizer continued the saved schedule: 6 steps from the merged state, 6 trained here
    assert trainer.state.global_step == 12 and trainer.zenflow_optimizer.stats()["steps"] == 12


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_dead_rank_ends_the_other_with_an_error(tmp_path, how):
    # "exit": rank 1 vanishes (gloo sees the connection close); "hang": rank 1 stays alive and silent, so only the
    # process group's timeout (--ddp_timeout 15, which transformers does not pass on under --use_cpu:
    # ZenFlowTrainingArguments does) can end rank 0's wait.
    proc = torchrun(tmp_path, "trainer", "--max-steps", "12", "--die-at-step", "3", "--die-how", how,
                    "--ddp-timeout", "15", nproc=2, device="cpu")
    assert proc.returncode != 0
    error = (tmp_path / "error_rank0.txt").read_text()
    assert "RuntimeError" in error
    if how == "hang":
        assert "Timed out" in error
    assert not (tmp_path / "rank0.pt").exists()


@pytest.mark.slow
def test_a_model_sharded_outside_the_trainer_is_refused_naming_the_fsdp2_flags(tmp_path):
    proc = torchrun(tmp_path, "fsdp2", nproc=1, device="cpu")
    assert proc.returncode != 0
    error = (tmp_path / "error_rank0.txt").read_text()
    assert "ValueError: ZenFlowTrainer: parameter" in error and "DTensor" in error
    assert "sharded (fully_shard) outside the Trainer" in error and "--fsdp_config" in error


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory) -> list[dict]:
    """A `ZenFlowPlugin` loop of 12 steps on `RANKS` ranks (windows of 4 steps)."""
    out = tmp_path_factory.mktemp("plugin")
    return results(out, torchrun(out, "plugin", "--max-steps", "12"))


@pytest.fixture(scope="module")
def plugin_saved_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The same loop with ``accelerator.save_state`` after step 6 (mid-window) to ``state-6``."""
    out = tmp_path_factory.mktemp("plugin_saved")
    return out, results(out, torchrun(out, "plugin", "--max-steps", "12", "--save-steps", "6"))


@pytest.mark.slow
def test_plugin_under_ddp_ranks_agree_bitwise(plugin_run):
    rank0, *others = plugin_run
    assert rank0["world_size"] == RANKS
    for other in others:
        assert other["first_batch"] != rank0["first_batch"]  # each rank saw its own data: agreement comes from DDP
        assert_same_weights(rank0["weights"], other["weights"])
        assert other["losses"] == rank0["losses"]
    assert rank0["losses"][-1] < rank0["losses"][0] - 0.1


# -- the per-rank files without processes -------------------------------------------------------------------------
class FakeOptimizer:
    def __init__(self, value: float) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"state": {0: {"x": torch.full((3,), self.value)}}, "param_groups": []}


def test_rank_files_round_trip_per_rank(tmp_path):
    for rank in range(2):
        save_rank_state(FakeOptimizer(float(rank)), str(tmp_path), rank, 2)
    assert sorted(os.listdir(tmp_path)) == [rank_file_name(0, 2), rank_file_name(1, 2)]  # no temporary left
    for rank in range(2):
        assert torch.equal(load_rank_state(str(tmp_path), rank, 2)["state"][0]["x"], torch.full((3,), float(rank)))


def test_rank_files_of_another_world_size_are_refused_naming_both(tmp_path):
    for rank in range(2):
        save_rank_state(FakeOptimizer(0.0), str(tmp_path), rank, 2)
    with pytest.raises(CheckpointError, match=r"saved by 2 processes \(world size 2\).*world size 4"):
        load_rank_state(str(tmp_path), 3, 4)


def test_a_missing_rank_file_says_the_checkpoint_is_incomplete(tmp_path):
    save_rank_state(FakeOptimizer(0.0), str(tmp_path), 0, 2)
    with pytest.raises(CheckpointError, match="incomplete"):
        load_rank_state(str(tmp_path), 1, 2)


def test_a_renamed_rank_file_is_refused(tmp_path):
    path = save_rank_state(FakeOptimizer(0.0), str(tmp_path), 0, 2)
    os.replace(path, tmp_path / rank_file_name(1, 2))
    with pytest.raises(CheckpointError, match="rank 0 of world size 2, not rank 1 of 2"):
        load_rank_state(str(tmp_path), 1, 2)


def test_an_accelerate_pointer_without_its_rank_files_says_they_were_not_copied(tmp_path):
    torch.save(rank_files_pointer(2), tmp_path / ACCELERATE_OPTIMIZER_NAME)
    with pytest.raises(CheckpointError, match="rank files of world size 2.*not copied"):
        load_rank_state(str(tmp_path), 0, 2, one_process_name=ACCELERATE_OPTIMIZER_NAME)


def test_a_pointer_loaded_outside_load_state_is_refused():
    accelerator = Accelerator(cpu=True)
    _, optimizer = ZenFlowPlugin(topk_ratio=0.1).prepare(accelerator, tiny_llama())
    with pytest.raises(CheckpointError, match="pointer to per-rank files.*accelerator.load_state"):
        optimizer.load_state_dict(rank_files_pointer(2))


def test_a_one_process_checkpoint_loads_on_every_rank(tmp_path):
    torch.save(FakeOptimizer(7.0).state_dict(), tmp_path / "optimizer.pt")
    for rank in range(2):
        assert torch.equal(load_rank_state(str(tmp_path), rank, 2)["state"][0]["x"], torch.full((3,), 7.0))
    assert load_rank_state(str(tmp_path / "nothing"), 0, 2) is None


@pytest.mark.slow
def test_plugin_save_state_writes_every_ranks_optimizer_file(plugin_saved_run, plugin_run):
    out, saved = plugin_saved_run
    for rank in saved:  # saving mid-window left the run as it was
        assert_same_weights(rank["weights"], plugin_run[0]["weights"])
    state = out / "state-6"
    pointer = torch.load(state / ACCELERATE_OPTIMIZER_NAME, weights_only=True)
    if RANKS == 1:  # one GPU: accelerate's own optimizer.bin holds the whole state
        assert pointer["zenflow"] is not None and not saved_world_sizes(str(state))
        return
    assert pointer == rank_files_pointer(RANKS)  # not rank 0's share: that one is in its rank file
    assert saved_world_sizes(str(state)) == {RANKS}
    for rank in range(RANKS):
        payload = torch.load(state / rank_file_name(rank, RANKS), weights_only=True)
        assert (payload["rank"], payload["world_size"]) == (rank, RANKS)
        zenflow = payload["optimizer"]["zenflow"]
        assert (zenflow["steps"], zenflow["ranks"], zenflow["rank"]) == (6, RANKS, rank)


@pytest.mark.slow
def test_plugin_load_state_mid_window_equals_the_uninterrupted_run(plugin_saved_run, plugin_run, tmp_path):
    out, (saved0, *_) = plugin_saved_run
    resumed = results(tmp_path, torchrun(tmp_path, "plugin", "--max-steps", "12", "--resume", str(out / "state-6")))
    for rank, result in enumerate(resumed):
        ranks = (RANKS, rank) if RANKS > 1 else (None, None)
        assert result["loaded"] == {"steps": 6, "ranks": ranks[0], "rank": ranks[1]}  # its own share
        assert result["losses"] == saved0["losses"][6:]
        assert_same_weights(result["weights"], saved0["weights"])
        assert_same_weights(result["weights"], plugin_run[0]["weights"])


@pytest.mark.slow
@several_ranks
def test_plugin_checkpoint_of_several_ranks_is_refused_in_one_process(plugin_saved_run):
    out, _ = plugin_saved_run
    accelerator = Accelerator(cpu=True)
    ZenFlowPlugin(topk_ratio=0.1, update_interval=4, cpu_threads=1, min_offload_numel=0).prepare(
        accelerator, tiny_llama(), lr=3e-3)
    with pytest.raises(CheckpointError, match=rf"saved by {RANKS} processes \(world size {RANKS}\).*world size 1"):
        accelerator.load_state(str(out / "state-6"))


@pytest.mark.slow
def test_plugin_one_process_checkpoint_loads_on_two_ranks(tmp_path):
    one = tmp_path / "one"  # the worker's loop in this process: one process, no torchrun
    run_plugin(argparse.Namespace(out=str(one), device="cpu", max_steps=4, save_steps=3, resume=None,
                                  fsdp_version=0))
    two = tmp_path / "two"  # steps 4 and 5: across the window boundary after step 4
    rank0, rank1 = results(two, torchrun(two, "plugin", "--max-steps", "5", "--resume", str(one / "state-3"),
                                         nproc=2, device="cpu"), nproc=2)
    # each rank took its share of the one-process state, at the step it was saved
    assert rank0["loaded"] == {"steps": 3, "ranks": 2, "rank": 0}
    assert rank1["loaded"] == {"steps": 3, "ranks": 2, "rank": 1}
    assert_same_weights(rank0["weights"], rank1["weights"])
