"""A host worker failure under `ZenFlowTrainer`: `train()` raises it and leaves no worker thread behind, and a second
`train(resume_from_checkpoint=True)` on the same Trainer resumes from the last checkpoint."""

from __future__ import annotations

import threading

import pytest
import torch
from hf_helpers import tiny_llama, zenflow_args
from transformers import TrainerCallback

import hf_zenflow.engine.windows as window_close
from hf_zenflow import HostWorkerError, ZenFlowTrainer


def _host_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "hf_zenflow-host" and t.is_alive()}


class _BreakAfterFirstSave(TrainerCallback):
    """From the first checkpoint on, every host AdamW fails."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def on_save(self, args, state, control, **kwargs):
        def broken(groups, *last):
            raise MemoryError("injected host failure")

        self.monkeypatch.setattr(window_close, "host_adamw_window", broken)
        return control


def test_a_worker_failure_ends_train_without_a_thread_and_a_resume_on_the_same_trainer_works(
        tmp_path, train_dataset, monkeypatch):
    """Repro: the host AdamW fails after the first checkpoint; `train()` raises `HostWorkerError` but its worker
    thread lived on, and `trainer.train(resume_from_checkpoint=True)` on the same Trainer re-raised the old error
    instead of resuming. Now the thread ends with `train()` and the resume loads the checkpoint's state into the
    optimizer and trains to the end, as a run resumed by a new Trainer does."""
    before = _host_threads()
    args = zenflow_args(tmp_path / "run", max_steps=8, save_strategy="steps", save_steps=3,
                        zenflow_update_interval=2)
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=train_dataset,
                             callbacks=[_BreakAfterFirstSave(monkeypatch)])
    with pytest.raises(HostWorkerError, match="injected host failure"):
        trainer.train()
    assert _host_threads() <= before  # no worker thread outlives the failed train()
    monkeypatch.undo()  # the fault is gone
    trainer.remove_callback(_BreakAfterFirstSave)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 8
    assert _host_threads() <= before

    fresh = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=train_dataset)
    fresh.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    for (name, p), q in zip(trainer.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(p, q), name
