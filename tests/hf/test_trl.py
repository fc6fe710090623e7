"""trl with ZenFlow: `hf_zenflow.trl` (`ZenFlowSFTConfig`, `ZenFlowSFTTrainer`) and `ZenFlowTrainer` mixed into
trl's `SFTTrainer`; a tiny Llama and a text dataset built in memory."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys

import pytest
import torch
from hf_helpers import tiny_llama
from sft_helpers import ZENFLOW_VALUES, sft_values, text_dataset, word_tokenizer


trl = pytest.importorskip("trl")

from trl import DPOConfig, SFTConfig, SFTTrainer  # noqa: E402

from hf_zenflow import ZenFlowAdamW  # noqa: E402
from hf_zenflow.hf.args_upgrade import upgrade_training_arguments  # noqa: E402
from hf_zenflow.hf.trainer import ZenFlowTrainer  # noqa: E402
from hf_zenflow.hf.training_args import ZenFlowTrainingArguments  # noqa: E402
from hf_zenflow.trl import ZenFlowSFTConfig, ZenFlowSFTTrainer  # noqa: E402


def sft(output_dir, model=None, resume=None, **overrides) -> ZenFlowSFTTrainer:
    args = ZenFlowSFTConfig(**sft_values(output_dir, **{**ZENFLOW_VALUES, **overrides}))
    trainer = ZenFlowSFTTrainer(model=model if model is not None else tiny_llama(), args=args,
                                train_dataset=text_dataset(), processing_class=word_tokenizer())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_import_hf_zenflow_does_not_import_trl():
    code = "import sys, hf_zenflow, hf_zenflow.hf; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_zenflow_sft_config_keeps_every_sft_default(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    ours, theirs = ZenFlowSFTConfig(**common), SFTConfig(**common)
    for f in dataclasses.fields(SFTConfig):
        assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    assert (ours.learning_rate, ours.logging_steps, ours.gradient_checkpointing, ours.bf16) == (2e-5, 10, True, True)
    assert ours.zenflow and ours.zenflow_config() == ZenFlowTrainingArguments(**common).zenflow_config()

    # Why SFTConfig comes first: the other order takes TrainingArguments' defaults again.
    @dataclasses.dataclass
    class WrongOrder(ZenFlowTrainingArguments, SFTConfig):
        pass

    wrong = WrongOrder(**common)
    assert (wrong.learning_rate, wrong.logging_steps, wrong.gradient_checkpointing, wrong.bf16) == (
        5e-5, 500, False, False)


def test_any_training_arguments_subclass_is_upgraded(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    sft_args = upgrade_training_arguments(SFTConfig(**common, max_length=7))
    assert type(sft_args) is ZenFlowSFTConfig and sft_args.max_length == 7 and sft_args.zenflow
    dpo = DPOConfig(**common, beta=0.3)
    dpo_args = upgrade_training_arguments(dpo)
    assert isinstance(dpo_args, DPOConfig) and isinstance(dpo_args, ZenFlowTrainingArguments)
    assert dpo_args.beta == 0.3 and dpo_args.learning_rate == dpo.learning_rate  # DPOConfig's own default, 1e-6
    assert dpo_args.zenflow_update_interval == ZenFlowTrainingArguments(**common).zenflow_update_interval
    # The Trainer pickles its arguments into every checkpoint (training_args.bin).
    again = pickle.loads(pickle.dumps(dpo_args))
    assert type(again) is type(dpo_args) and again.to_dict() == dpo_args.to_dict()
    # A ZenFlowSFTTrainer given plain TrainingArguments gets SFTConfig's fields (SFTTrainer would rebuild them).
    plain = upgrade_training_arguments(ZenFlowTrainingArguments(**common), SFTConfig)
    assert type(plain) is ZenFlowSFTConfig and plain.max_length == SFTConfig(**common).max_length


def test_sft_trains_with_zenflow_adamw(tmp_path):
    model = tiny_llama()
    before = weights_of(model)
    trainer = sft(tmp_path / "sft", model=model)
    opt = trainer.zenflow_optimizer
    assert isinstance(opt, ZenFlowAdamW) and trainer.state.global_step == 4
    # 4 steps of one-step windows: at lr 3e-3, high_lr_rule="auto" shortens update_interval=2 to floor(5e-3 / lr) = 1
    assert opt.stats()["windows"] == 4 and opt.stats()["high_lr_window"] == 1
    summary = trainer.state.log_history[-1]
    assert summary["zenflow/steps"] == 4
    assert len(losses(trainer)) == 4 and all(torch.isfinite(torch.tensor(losses(trainer))))
    after = weights(trainer)
    assert all(not torch.equal(before[k], after[k]) for k in after if "proj" in k)  # every matrix trained
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing  # trl's defaults in force


def weights_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_topk_ratio_1_sft_reproduces_sft_with_adamw_torch(tmp_path):
    # ZenFlow with every column selected is AdamW: the SFT run of trl with torch's AdamW is the reference.
    values = sft_values(tmp_path / "ref", max_steps=4, bf16=False, weight_decay=0.01)
    ref = SFTTrainer(model=tiny_llama(), args=SFTConfig(**values), train_dataset=text_dataset(),
                     processing_class=word_tokenizer())
    ref.train()
    zen = sft(tmp_path / "zen", bf16=False, weight_decay=0.01, zenflow_topk_ratio=1.0)
    assert isinstance(zen.zenflow_optimizer, ZenFlowAdamW)
    # Different summation order of the same AdamW arithmetic (fused host/device kernels vs torch's foreach).
    torch.testing.assert_close(torch.tensor(losses(zen)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)


def test_mixin_accepts_an_sft_config(tmp_path):
    class MyTrainer(ZenFlowTrainer, SFTTrainer):
        pass

    args = SFTConfig(**sft_values(tmp_path / "mixin"))
    trainer = MyTrainer(model=tiny_llama(), args=args, train_dataset=text_dataset(),
                        processing_class=word_tokenizer())
    assert isinstance(trainer.args, SFTConfig) and isinstance(trainer.args, ZenFlowTrainingArguments)
    assert trainer.args.max_length == 16 and trainer.args.learning_rate == 3e-3  # the user's values kept
    trainer.train()
    assert isinstance(trainer.zenflow_optimizer, ZenFlowAdamW) and trainer.state.global_step == 4
    assert {"trl", "sft", "hf_zenflow"} <= set(trainer.model.model_tags)


def test_resume_mid_window_is_exact(tmp_path):
    common = dict(max_steps=6, zenflow_update_interval=2)
    # checkpoint at step 3: the middle of window 2 (steps 3-4)
    full = sft(tmp_path / "full", save_strategy="steps", save_steps=3, **common)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed = sft(tmp_path / "resumed", model=tiny_llama(seed=123), resume=str(checkpoint), **common)
    assert resumed.state.global_step == 6
    assert losses(resumed)[3:] == losses(full)[3:]
    full_w, resumed_w = weights(full), weights(resumed)
    for name in full_w:
        assert torch.equal(full_w[name], resumed_w[name]), name


def test_model_card_carries_tags_and_settings(tmp_path):
    trainer = sft(tmp_path / "card")
    trainer.save_model()
    card = (tmp_path / "card" / "README.md").read_text()
    front = card.split("---")[1]
    for tag in ("hf_zenflow", "trl", "sft"):
        assert f"- {tag}\n" in front, tag
    assert "### ZenFlow settings" in card and "| `topk_ratio` | 0.25 |" in card and "| `update_interval` | 2 |" in card
    assert "| optimizer steps | 4 |" in card and "ZenFlowSFTTrainer" in card
