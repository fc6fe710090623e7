"""`ZenFlowCallback` on the `optimizers=(ZenFlowAdamW(...), None)` route of a plain `Trainer` and of trl's
`SFTTrainer`: the saved model holds every host update, and no worker thread outlives `train()`; without the callback
the first training step fails, naming it."""

from __future__ import annotations

import threading

import pytest
import torch
from hf_helpers import ByteLMDataset, tiny_llama, zenflow_args
from safetensors.torch import load_file
from sft_helpers import sft_values, text_dataset, word_tokenizer
from transformers import Trainer

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.hf.callback import ZenFlowCallback
from hf_zenflow.hf.trainer import ZenFlowTrainer


WORKER_THREAD = "hf_zenflow-host"  # worker.HostAdamWorker's thread name


#: a constant learning rate: a linear decay would reach 0 at the last step, and a host step at lr 0 changes nothing
CONSTANT = dict(lr_scheduler_type="constant")


def zenflow_optimizer(model) -> ZenFlowAdamW:
    # 10 steps, windows of 4 with overlap: the end of training has an open window and an unapplied host result
    return ZenFlowAdamW(model.parameters(), lr=3e-3, topk_ratio=0.25, update_interval=4, cpu_threads=1,
                        min_offload_numel=0)


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER_THREAD and t.is_alive()]


def assert_saved_model_is_flushed(trainer, opt: ZenFlowAdamW, folder) -> None:
    """The saved model equals the weights after `opt.flush()`: flushing again changes nothing (without the
    end-of-training flush it writes the open window and the pending host result into the weights)."""
    trainer.save_model(str(folder))
    saved = load_file(str(folder / "model.safetensors"))
    opt.flush()
    opt.close()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(saved[name], p.detach()), name


def plain_trainer(tmp_path, train_dataset, callbacks, name="plain"):
    model = tiny_llama()
    opt = zenflow_optimizer(model)
    args = zenflow_args(tmp_path / name, zenflow=False, max_steps=10, max_grad_norm=0.0, **CONSTANT)
    return Trainer(model=model, args=args, train_dataset=train_dataset, optimizers=(opt, None),
                   callbacks=callbacks), opt


def test_plain_trainer_with_the_callback(tmp_path, train_dataset):
    trainer, opt = plain_trainer(tmp_path, train_dataset, [ZenFlowCallback()])
    trainer.train()
    assert not worker_threads()
    assert_saved_model_is_flushed(trainer, opt, tmp_path / "saved")
    # The reference: ZenFlowTrainer with the same user-built optimizer (it flushes and closes by itself).
    model = tiny_llama()
    ref_opt = zenflow_optimizer(model)
    ref = ZenFlowTrainer(model=model, args=zenflow_args(tmp_path / "ref", max_steps=10, max_grad_norm=0.0, **CONSTANT),
                         train_dataset=train_dataset, optimizers=(ref_opt, None))
    ref.train()
    ours, theirs = trainer.model.state_dict(), ref.model.state_dict()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_checkpoints_wait_for_the_worker(tmp_path, text, monkeypatch, strategy):
    events = []
    for method in ("step", "synchronize"):
        original = getattr(ZenFlowAdamW, method)
        monkeypatch.setattr(ZenFlowAdamW, method, lambda self, *a, _o=original, _m=method, **k: (
            events.append(_m), _o(self, *a, **k))[1])
    original_save = Trainer._save_checkpoint
    monkeypatch.setattr(Trainer, "_save_checkpoint",
                        lambda self, *a: (events.append("save"), original_save(self, *a))[1])
    model = tiny_llama()
    args = zenflow_args(tmp_path / "ck", zenflow=False, max_steps=-1, num_train_epochs=2, save_strategy=strategy,
                        save_steps=3)
    Trainer(model=model, args=args, train_dataset=ByteLMDataset(text, num_samples=12),  # 3 steps per epoch
            optimizers=(zenflow_optimizer(model), None), callbacks=[ZenFlowCallback()]).train()
    saves = [i for i, e in enumerate(events) if e == "save"]
    assert len(saves) == 2
    for i in saves:  # the host worker was waited for after the last step before each checkpoint
        last_step = max(j for j in range(i) if events[j] == "step")
        assert "synchronize" in events[last_step:i], events


def test_without_the_callback_the_first_step_fails_naming_it(tmp_path, train_dataset):
    """A Trainer given a `ZenFlowAdamW` through ``optimizers=`` and no `ZenFlowCallback` would leave the last
    window out of the weights and the worker running: its first training step fails, before any forward."""
    trainer, opt = plain_trainer(tmp_path, train_dataset, None)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"callbacks=\[ZenFlowCallback\(\)\]"):
        trainer.train()
    assert opt.stats()["steps"] == 0
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())
    opt.close()


def test_the_callback_marks_the_optimizer_drained(tmp_path, train_dataset):
    trainer, opt = plain_trainer(tmp_path, train_dataset, [ZenFlowCallback()])
    assert opt.drained_by is None
    trainer.train()
    assert opt.drained_by == "ZenFlowCallback" and opt.stats()["steps"] == 10


def test_zenflow_trainer_needs_no_callback(tmp_path, train_dataset):
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(tmp_path / "z", max_steps=2),
                             train_dataset=train_dataset)
    trainer.train()
    assert not any(isinstance(cb, ZenFlowCallback) for cb in trainer.callback_handler.callbacks)
    assert trainer.zenflow_optimizer.drained_by == "ZenFlowTrainer" and trainer.zenflow_optimizer.stats()["steps"] == 2


def test_sft_trainer_with_the_callback(tmp_path):
    trl = pytest.importorskip("trl")
    model = tiny_llama()
    opt = zenflow_optimizer(model)
    args = trl.SFTConfig(**sft_values(tmp_path / "sft", max_steps=10, max_grad_norm=0.0, **CONSTANT))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=text_dataset(), processing_class=word_tokenizer(),
                             optimizers=(opt, None), callbacks=[ZenFlowCallback()])
    trainer.train()
    assert sum(isinstance(cb, ZenFlowCallback) for cb in trainer.callback_handler.callbacks) == 1
    assert not worker_threads()
    assert opt.stats()["windows"] >= 2
    assert_saved_model_is_flushed(trainer, opt, tmp_path / "saved")


def test_load_best_model_at_end_keeps_the_best_checkpoint(tmp_path, train_dataset, eval_dataset):
    # The open window belongs to the discarded trajectory: the loaded best weights stay as saved.
    model = tiny_llama()
    opt = zenflow_optimizer(model)
    args = zenflow_args(tmp_path / "best", zenflow=False, max_steps=6, max_grad_norm=0.0, eval_strategy="steps",
                        eval_steps=3, save_strategy="steps", save_steps=3, load_best_model_at_end=True, **CONSTANT)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      optimizers=(opt, None), callbacks=[ZenFlowCallback()])
    trainer.train()
    assert not worker_threads()
    best = load_file(str(tmp_path / "best" / trainer.state.best_model_checkpoint.split("/")[-1]
                         / "model.safetensors"))
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), best[name]), name
