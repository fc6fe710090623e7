"""A resumed optimizer state must be the one saved with the Trainer's state, whether or not the folder has a
manifest: an optimizer file copied in from another step is refused naming both step counts; one from a run that
clipped at another `max_grad_norm` is named in a warning (the new value takes effect)."""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_helpers import tiny_llama, zenflow_args
from transformers import Trainer

from hf_zenflow import CheckpointError, ZenFlowAdamW, ZenFlowTrainer
from hf_zenflow.checkpoint import SavedProgress
from hf_zenflow.hf.callback import ZenFlowCallback
from hf_zenflow.hf.checkpoint_manifest import MANIFEST_NAME, write_manifest
from hf_zenflow.hf.resume import check_resumed_optimizer


SAVES = dict(max_steps=6, zenflow_update_interval=2, save_strategy="steps", save_steps=3)


def zenflow_run(out, train_dataset, resume=None, **overrides) -> ZenFlowTrainer:
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(out, **{**SAVES, **overrides}),
                             train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def plain_run(out, train_dataset, resume=None) -> Trainer:
    """A plain Trainer given a ZenFlowAdamW with its callback: its checkpoints have no manifest."""
    model = tiny_llama()
    opt = ZenFlowAdamW(model.parameters(), lr=3e-3, topk_ratio=0.25, update_interval=2, cpu_threads=1,
                       min_offload_numel=0)
    args = zenflow_args(out, zenflow=False, **SAVES)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, optimizers=(opt, None),
                      callbacks=[ZenFlowCallback()])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory, train_dataset):
    """Checkpoints at steps 3 and 6: of a ZenFlowTrainer run, of one clipping at max_grad_norm 0.5 (the others clip
    at the default 1.0), and of a plain Trainer with the callback."""
    tmp = tmp_path_factory.mktemp("runs")
    torch.set_num_threads(1)
    zenflow_run(tmp / "zenflow", train_dataset)
    zenflow_run(tmp / "clip", train_dataset, max_grad_norm=0.5)
    plain_run(tmp / "plain", train_dataset)
    return tmp


def swapped(runs, tmp_path, run: str, source: str, manifest: str):
    """A copy of `run` whose checkpoint-6/optimizer.pt is `source` (relative to the runs), its manifest rewritten
    over the swapped file (it vouches for whole files, not for files of one save) or removed from every folder."""
    copy = tmp_path / "run"
    shutil.copytree(runs / run, copy)
    shutil.copyfile(runs / source, copy / "checkpoint-6" / "optimizer.pt")
    for step in (3, 6):
        folder = copy / f"checkpoint-{step}"
        if manifest == "removed" and (folder / MANIFEST_NAME).exists():
            (folder / MANIFEST_NAME).unlink()
        elif manifest == "rewritten" and step == 6:
            write_manifest(folder)
    return copy


@pytest.mark.parametrize("resume", ["newest", "named"])
@pytest.mark.parametrize("manifest", ["rewritten", "removed"])
def test_an_optimizer_file_from_another_step_is_refused_naming_both_counts(runs, tmp_path, train_dataset,
                                                                           manifest, resume):
    """Regression: checkpoint-3/optimizer.pt copied into checkpoint-6 resumed without a word, and the run ended with
    every weight different from the uninterrupted run's."""
    copy = swapped(runs, tmp_path, "zenflow", "zenflow/checkpoint-3/optimizer.pt", manifest)
    target = True if resume == "newest" else str(copy / "checkpoint-6")
    with pytest.raises(CheckpointError, match=r"checkpoint-6/optimizer\.pt: the optimizer state has taken 3 "
                                              r"optimizer step\(s\), but .*global_step=6"):
        zenflow_run(copy, train_dataset, resume=target)


def test_a_plain_trainer_resume_with_an_optimizer_file_from_another_step_is_refused(runs, tmp_path, train_dataset):
    copy = swapped(runs, tmp_path, "plain", "plain/checkpoint-3/optimizer.pt", "removed")
    with pytest.raises(CheckpointError, match=r"taken 3 optimizer step\(s\), but .*global_step=6"):
        plain_run(copy, train_dataset, resume=str(copy / "checkpoint-6"))


def test_a_plain_trainer_resume_of_its_own_files_goes_on(runs, tmp_path, train_dataset):
    copy = tmp_path / "run"
    shutil.copytree(runs / "plain", copy)
    trainer = plain_run(copy, train_dataset, resume=str(copy / "checkpoint-3"))
    assert trainer.state.global_step == 6


def test_an_optimizer_file_of_a_run_with_another_max_grad_norm_is_named(runs, tmp_path, train_dataset, caplog):
    """The same step, another clipping: the file may be from another run, or max_grad_norm was changed for the
    resume (which the files cannot tell apart): the warning names both values, and the Trainer's takes effect."""
    copy = swapped(runs, tmp_path, "zenflow", "clip/checkpoint-6/optimizer.pt", "rewritten")
    with caplog.at_level("WARNING", logger="hf_zenflow"):
        trainer = zenflow_run(copy, train_dataset, resume=True, max_steps=8)
    told = [r.getMessage() for r in caplog.records if "max_grad_norm" in r.getMessage()]
    assert len(told) == 1 and "clipped at max_grad_norm=0.5; this run clips at 1" in told[0], told
    assert "checkpoint-6/optimizer.pt" in told[0]
    assert trainer.zenflow_optimizer.engine_state.state()["max_grad_norm"] == 1.0
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_zenflow"):  # its own file: nothing to say
        zenflow_run(tmp_path / "again", train_dataset, resume=str(runs / "zenflow" / "checkpoint-3"))
    assert not [r for r in caplog.records if "max_grad_norm" in r.getMessage()]


def test_a_torch_adamw_state_may_have_fewer_steps_than_the_trainer():
    """A `torch.optim.AdamW` state does not count the steps a GradScaler skipped: fewer steps than the Trainer's is
    what such a run saves; more is another checkpoint's."""
    check_resumed_optimizer(SavedProgress(5, exact=False), 6, "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"taken 7 optimizer step\(s\), but .*global_step=6"):
        check_resumed_optimizer(SavedProgress(7, exact=False), 6, "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"taken 5 optimizer step\(s\)"):
        check_resumed_optimizer(SavedProgress(5, exact=True), 6, "optimizer.pt")


@pytest.mark.parametrize("output", ["empty", "missing"])
def test_resume_true_without_any_checkpoint_is_a_checkpoint_error(tmp_path, train_dataset, output):
    """Regression: `resume_from_checkpoint=True` with no checkpoint raised transformers' bare ValueError ("No valid
    checkpoint found"), not the CheckpointError every other resume refusal is."""
    out = tmp_path / "run"
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(out, **SAVES), train_dataset=train_dataset)
    if output == "missing" and out.exists():  # (the Trainer may have created it)
        out.rmdir()
    where = "has no checkpoint-N folder" if output == "empty" else "does not exist"
    with pytest.raises(CheckpointError, match=rf"resume_from_checkpoint=True: {out} {where}: there is nothing"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0
