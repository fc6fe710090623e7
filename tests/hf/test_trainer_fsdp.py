"""`ZenFlowTrainer` under `torchrun --nproc_per_node 2` with the Trainer's own FSDP2 (``--fsdp --fsdp_config
'{"version": 2}'``, gloo, CPU; `hf_fsdp_worker.py`): it trains with ZenFlow on the DTensor shards, a checkpoint
holds one ZenFlow optimizer file per rank next to the model's FSDP checkpoint, and a resume from a mid-window
checkpoint equals the uninterrupted run bitwise (the full weights, gathered from the shards), and the run agrees
with the same run under DDP. What is refused with
FSDP (FSDP1, the column layout) is tested without processes in `test_training_args.py`."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from gloo_ranks import DEVICE, RANKS
from hf_helpers import (
    assert_rank_files,
    assert_same_weights,
    assert_trained_on_shards,
    rank_results,
    tiny_llama,
    torchrun,
)

from hf_zenflow.hf.rank_checkpoint import rank_file_name


WORKER = Path(__file__).with_name("hf_fsdp_worker.py")
FP32_MOMENTS = ("--host-state", "fp32")
def run(out: Path, *worker_args: str, worker: Path = WORKER) -> list[dict]:
    proc: subprocess.CompletedProcess = torchrun(worker, out, *worker_args, nproc=RANKS, device=DEVICE)
    return rank_results(out, proc, RANKS)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """12 steps (windows of 4 steps), checkpointing at step 6: mid-window. fp32 host moments: the comparison with
    DDP below holds the two runs to fp32 rounding (bf16 moments would turn their last-bit differences into whole bf16
    steps of the moments)."""
    out = tmp_path_factory.mktemp("fsdp_full")
    return out, run(out, "--max-steps", "12", "--save-steps", "6", *FP32_MOMENTS)


@pytest.mark.slow
def test_trainer_fsdp2_trains_with_zenflow_on_the_shards(full_run):
    _, results = full_run
    assert results[0]["fsdp"] and results[0]["world_size"] == RANKS
    losses = results[0]["losses"]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert_trained_on_shards(results, RANKS)


@pytest.mark.slow
def test_trainer_fsdp2_checkpoint_has_one_zenflow_optimizer_file_per_rank(full_run):
    out, _ = full_run
    checkpoint = out / "run" / "checkpoint-6"
    assert (checkpoint / "scheduler.pt").is_file()
    assert (checkpoint / "pytorch_model_fsdp.bin").is_file()  # the model's FSDP checkpoint, which resume loads
    # neither the one-process file nor accelerate's FSDP optimizer files (torch DCP's per-parameter format)
    assert not [name for name in os.listdir(checkpoint) if name.startswith("optimizer")]
    assert_rank_files(checkpoint, RANKS)
    # the parameters are named although accelerate swapped them for the DTensors after the optimizer was built
    names = set(dict(tiny_llama().named_parameters()))
    for rank in range(RANKS):
        state = torch.load(checkpoint / rank_file_name(rank, RANKS), weights_only=True)["optimizer"]["state"]
        assert {entry.get("name") for entry in state.values()} == names


@pytest.mark.slow
def test_trainer_fsdp2_resume_mid_window_equals_the_uninterrupted_run(full_run, tmp_path):
    out, (full0, _) = full_run
    resumed = run(tmp_path, "--max-steps", "12", "--resume", str(out / "run" / "checkpoint-6"), *FP32_MOMENTS)
    for rank in resumed:
        assert_same_weights(rank["weights"], full0["weights"])
    assert resumed[0]["losses"] == full0["losses"]  # steps 1-6 from the checkpoint's log, 7-12 trained again


@pytest.mark.slow
def test_trainer_fsdp2_trains_like_ddp(full_run, tmp_path):
    # The same run under DDP (hf_ddp_worker.py): every rank the whole matrices, the host work split by rows. FSDP2
    # reduces the gradients with a reduce-scatter instead of an all-reduce, so the two agree closely, not bitwise.
    _, (fsdp0, _) = full_run
    ddp0 = run(tmp_path, "trainer", "--max-steps", "12", *FP32_MOMENTS, worker=WORKER.with_name("hf_ddp_worker.py"))[0]
    assert ddp0["losses"] == pytest.approx(fsdp0["losses"], rel=1e-5)
    for name, weight in ddp0["weights"].items():
        torch.testing.assert_close(fsdp0["weights"][name], weight, rtol=0, atol=1e-6, msg=name)
