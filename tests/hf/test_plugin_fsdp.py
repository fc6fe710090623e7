"""`ZenFlowPlugin` in a plain accelerate loop under accelerate's FSDP2 (``FullyShardedDataParallelPlugin(
fsdp_version=2)``; `torchrun --nproc_per_node 2`, gloo, CPU through `hf_helpers.fsdp_on_cpu`; the plugin mode of
`hf_ddp_worker.py`): the optimizer works on the DTensor shards, ``accelerator.save_state`` writes one ZenFlow file
per rank next to accelerate's FSDP model checkpoint (no torch DCP optimizer checkpoint), and a fresh pair of
processes that ``load_state`` a mid-window save ends bitwise where the saving run, which trained on, ended. That
the hooks' saving leaves a run unchanged is tested under DDP (`test_trainer_ddp.py`); what FSDP adds, accelerate's
DCP optimizer checkpoint, would take an extra ZenFlow step (asserted absent here: 12 steps counted). FSDP1 is refused
without processes (`test_accelerate_plugin.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gloo_ranks import DEVICE, RANKS
from hf_helpers import assert_rank_files, assert_same_weights, assert_trained_on_shards, rank_results, torchrun

from hf_zenflow.hf.rank_checkpoint import rank_file_name


WORKER = Path(__file__).with_name("hf_ddp_worker.py")


def run(out: Path, *worker_args: str) -> list[dict]:
    proc = torchrun(WORKER, out, "plugin", "--fsdp-version", "2", "--max-steps", "12", *worker_args, nproc=RANKS,
                    device=DEVICE)
    return rank_results(out, proc, RANKS)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """12 steps (windows of 4 steps), ``save_state`` before step 7 (mid-window) to ``state-6``, then on to 12."""
    out = tmp_path_factory.mktemp("plugin_fsdp2")
    return out, run(out, "--save-steps", "6")


@pytest.mark.slow
def test_plugin_fsdp2_trains_with_zenflow_on_the_shards(saved_run):
    _, results = saved_run
    assert results[0]["world_size"] == RANKS
    assert_trained_on_shards(results, RANKS)
    # save_state took no ZenFlow step of its own (accelerate's torch DCP optimizer checkpoint would have)
    assert results[0]["stats"]["steps"] == 12
    for other in results[1:]:  # each rank trained on its own batches
        assert other["first_batch"] != results[0]["first_batch"]


@pytest.mark.slow
def test_plugin_fsdp2_save_state_writes_one_zenflow_file_per_rank(saved_run):
    out, _ = saved_run
    state = out / "state-6"
    assert (state / "pytorch_model_fsdp_0").is_dir()  # accelerate's FSDP model checkpoint
    # neither accelerate's optimizer.bin nor its torch DCP optimizer folder (optimizer_0): ZenFlow's rank files only
    assert not [name for name in os.listdir(state) if name.startswith("optimizer")]
    assert_rank_files(state, RANKS)
    for rank in range(RANKS):
        zenflow = torch.load(state / rank_file_name(rank, RANKS), weights_only=True)["optimizer"]["zenflow"]
        assert (zenflow["steps"], zenflow["fsdp_ranks"], zenflow["fsdp_rank"]) == (6, RANKS, rank)


@pytest.mark.slow
def test_plugin_fsdp2_load_state_mid_window_equals_the_uninterrupted_run(saved_run, tmp_path):
    out, (saved0, _) = saved_run
    for rank, result in enumerate(run(tmp_path, "--resume", str(out / "state-6"))):
        assert result["loaded"] == {"steps": 6, "fsdp_ranks": RANKS, "fsdp_rank": rank}  # its own shard's state
        assert result["losses"] == saved0["losses"][6:]
        assert_same_weights(result["weights"], saved0["weights"])
