"""`ZenFlowTrainer` against a plain `Trainer` (`adamw_torch`) on a tiny Llama built from config."""

from __future__ import annotations

import copy
import math
import os
import threading

import pytest
import torch
from hf_helpers import SEQ_LEN, ByteLMDataset, logged, tiny_llama, zenflow_args
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig, ZenFlowTrainer, ZenFlowTrainingArguments
from hf_zenflow.hf.unwrap import unwrap_zenflow_optimizer


#: In every training log (`trainer_telemetry.EVERY_LOG` and the device utilisation).
TELEMETRY_KEYS = ("zenflow/critical_path_ms", "zenflow/cp_wait_ms", "zenflow/host_step_ms",
                  "zenflow/selected_fraction", "zenflow/bytes_to_host", "zenflow/device_utilization")


def reference_run(tmp_path, train_dataset, **overrides) -> Trainer:
    """A plain Trainer with torch's AdamW and the same data, schedule and clipping."""
    args = zenflow_args(tmp_path / "reference", zenflow=False, **overrides)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=train_dataset)
    trainer.train()
    return trainer


def zenflow_run(tmp_path, train_dataset, name="zenflow", model=None, resume=None, **overrides) -> ZenFlowTrainer:
    args = zenflow_args(tmp_path / name, **overrides)
    trainer = ZenFlowTrainer(model=model if model is not None else tiny_llama(), args=args,
                             train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_close_rel(actual, expected, rel):
    assert len(actual) == len(expected) > 0
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"step {i + 1}: {a} vs {e} (rel {abs(a - e) / abs(e):.2e} > {rel})"


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "no-clip"])
def test_topk_ratio_1_reproduces_adamw_torch(tmp_path, train_dataset, max_grad_norm):
    common = dict(weight_decay=0.01, max_grad_norm=max_grad_norm)
    ref = reference_run(tmp_path, train_dataset, **common)
    zen = zenflow_run(tmp_path, train_dataset, zenflow_topk_ratio=1.0, **common)  # U=4, overlap: the defaults
    assert isinstance(zen.zenflow_optimizer, ZenFlowAdamW)
    assert len(logged(zen)) == 30
    assert_close_rel(logged(zen), logged(ref), 1e-5)
    # The logged grad_norm is the true global norm (what torch.nn.utils.clip_grad_norm_ reports).
    assert_close_rel(logged(zen, "grad_norm"), logged(ref, "grad_norm"), 1e-5)
    assert logged(zen, "learning_rate") == logged(ref, "learning_rate")


def test_sequential_interval_1_reproduces_adamw_torch_at_topk_0_1(tmp_path, train_dataset):
    common = dict(weight_decay=0.01)
    ref = reference_run(tmp_path, train_dataset, **common)
    zen = zenflow_run(tmp_path, train_dataset, zenflow_topk_ratio=0.1, zenflow_update_interval=1,
                      zenflow_overlap_step=False, zenflow_host_state="fp32", **common)
    stats = zen.zenflow_optimizer.stats()
    assert 0.0 < stats["selected_fraction"] < 0.5  # the host path really is in use
    assert stats["windows"] == 30
    assert_close_rel(logged(zen), logged(ref), 1e-5)
    assert_close_rel(logged(zen, "grad_norm"), logged(ref, "grad_norm"), 1e-5)
    for name, value in weights(zen).items():
        torch.testing.assert_close(value, weights(ref)[name], rtol=1e-4, atol=1e-5, msg=name)


def _pretrained_tiny_llama(tmp_path, text):
    """The tiny Llama after 150 pretraining steps, and its fine-tuning and held-out sets."""
    pretrain = ByteLMDataset(text, num_samples=512)
    finetune = ByteLMDataset(text, num_samples=256, offset=512 * SEQ_LEN)
    held_out = ByteLMDataset(text, num_samples=64, offset=768 * SEQ_LEN)
    base = tiny_llama()
    Trainer(model=base, args=zenflow_args(tmp_path / "pretrain", zenflow=False, max_steps=150, logging_steps=50),
            train_dataset=pretrain).train()
    return base, finetune, held_out


def test_a_high_learning_rate_fine_tune_with_the_defaults(tmp_path, text):
    """At lr 3e-3, the edge of stability for this model, the defaults stay within 10% of adamw_torch over 30
    fine-tuning steps: ``host_lr_scale="auto"`` takes 1.0-1.7 there (by the write-back lag ``"auto"`` chose), not
    "interval"'s 4, which overshoots (BENCHMARKS.md "Quality: the size of the host step")."""
    base, finetune, held_out = _pretrained_tiny_llama(tmp_path, text)
    ref = Trainer(model=copy.deepcopy(base), args=zenflow_args(tmp_path / "ref", zenflow=False),
                  train_dataset=finetune)
    start_loss = ref.evaluate(held_out)["eval_loss"]
    ref.train()
    zen = zenflow_run(tmp_path, finetune, model=copy.deepcopy(base))
    cfg = zen.zenflow_optimizer.config
    assert (cfg.topk_ratio, cfg.update_interval, cfg.overlap_step, cfg.host_step) == (0.1, 4, True, "auto")
    assert cfg.rules.host_lr_scale == "auto"
    assert 1.0 <= zen.zenflow_optimizer.stats()["host_lr_scale"] < 2.0
    ref_loss = ref.evaluate(held_out)["eval_loss"]
    zen_loss = zen.evaluate(held_out)["eval_loss"]
    assert ref_loss < start_loss - 0.05  # the reference learned something
    assert zen_loss < start_loss - 0.02  # so did ZenFlow
    assert abs(zen_loss - ref_loss) <= 0.10 * ref_loss, (zen_loss, ref_loss)
    # The training losses too: mean of the last 5 logged steps.
    assert abs(sum(logged(zen)[-5:]) - sum(logged(ref)[-5:])) <= 0.10 * sum(logged(ref)[-5:])


def test_the_defaults_fine_tune_closer_to_adamw_torch_than_one_step_per_window(tmp_path, text):
    """At a fine-tuning learning rate (3e-4) the defaults (``host_lr_scale="auto"``: 5/3 there, the multiplier
    whose host step reaches its cap 5e-4, ``writeback_lag="auto"``)
    end within 0.3% of adamw_torch's held-out loss, where ZenFlow's own rule (``host_step="zenflow"``: 1.0, written
    back at the next window boundary) is 0.4-0.5% above it (`git show 186c27e:BENCHMARKS.md` §4b: -0.20 and
    +0.45 %)."""
    base, finetune, held_out = _pretrained_tiny_llama(tmp_path, text)
    lr = dict(learning_rate=3e-4)
    ref = Trainer(model=copy.deepcopy(base), args=zenflow_args(tmp_path / "ref", zenflow=False, **lr),
                  train_dataset=finetune)
    ref.train()
    ref_loss = ref.evaluate(held_out)["eval_loss"]
    defaults = zenflow_run(tmp_path, finetune, "defaults", model=copy.deepcopy(base), **lr)
    rules = defaults.zenflow_optimizer.config.rules
    assert (rules.host_lr_scale, rules.writeback_lag) == ("auto", "auto")
    assert defaults.zenflow_optimizer.stats()["host_lr_scale"] == pytest.approx(5 / 3, rel=1e-15)  # 5e-4 / 3e-4
    one_step = zenflow_run(tmp_path, finetune, "one_step", model=copy.deepcopy(base), zenflow_host_step="zenflow",
                           **lr)
    defaults_gap = abs(defaults.evaluate(held_out)["eval_loss"] - ref_loss) / ref_loss
    one_step_gap = abs(one_step.evaluate(held_out)["eval_loss"] - ref_loss) / ref_loss
    assert defaults_gap <= 0.003 < 0.004 <= one_step_gap, (defaults_gap, one_step_gap)


def test_defaults_train_from_scratch(tmp_path, train_dataset, eval_dataset):
    zen = zenflow_run(tmp_path, train_dataset)
    first = logged(zen)[0]  # ln(256) ~ 5.55 for the untrained byte model
    assert zen.evaluate(eval_dataset)["eval_loss"] < first - 0.5


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
def test_resume_mid_window_continues_exactly(tmp_path, train_dataset, overlap):
    common = dict(max_steps=12, zenflow_update_interval=4, zenflow_overlap_step=overlap)
    # Uninterrupted run, checkpointing at step 6 (mid-window: window 2 spans steps 5-8).
    full = zenflow_run(tmp_path, train_dataset, "full", save_strategy="steps", save_steps=6, **common)
    checkpoint = tmp_path / "full" / "checkpoint-6"
    assert (checkpoint / "optimizer.pt").is_file()
    # The same run without checkpoints: synchronising for the checkpoint does not change the schedule.
    plain = zenflow_run(tmp_path, train_dataset, "plain", **common)
    assert logged(plain) == logged(full)
    # Resume from step 6 in a fresh trainer with a freshly initialised (different) model.
    resumed = zenflow_run(tmp_path, train_dataset, "resumed", model=tiny_llama(seed=123), resume=str(checkpoint),
                          **common)
    assert resumed.state.global_step == 12
    # log_history comes back from the checkpoint's trainer_state.json: steps 1-6 restored, 7-12 trained again.
    assert len(logged(resumed)) == 12
    assert logged(resumed)[6:] == logged(full)[6:]  # bit for bit
    full_w, resumed_w = weights(full), weights(resumed)
    for name in full_w:
        assert torch.equal(full_w[name], resumed_w[name]), name


def test_gradient_accumulation_counts_optimizer_steps(tmp_path, train_dataset):
    common = dict(max_steps=8, zenflow_update_interval=4, zenflow_overlap_step=True, learning_rate=1e-3)
    accumulated = zenflow_run(tmp_path, train_dataset, "ga4", per_device_train_batch_size=2,
                              gradient_accumulation_steps=4, **common)
    stats = accumulated.zenflow_optimizer.stats()
    assert stats["steps"] == 8  # optimizer steps, not the 32 micro-batches
    assert stats["windows"] == 8 // 4  # windows close every U optimizer steps
    assert stats["update_interval"] == 4
    # Same samples per optimizer step as one batch of 8: same training, up to float summation order.
    big_batch = zenflow_run(tmp_path, train_dataset, "bs8", per_device_train_batch_size=8, **common)
    assert_close_rel(logged(accumulated), logged(big_batch), 1e-4)


def test_auto_interval_adapts_under_the_trainer(tmp_path, train_dataset):
    """Regression (issue 10.1): the Trainer measures the gradient norm before every step (`_clip_grad_norm` /
    `_get_grad_norm`), which left Zen-auto without votes: every window ran to `auto_max_interval` (16)."""
    for max_grad_norm in (1.0, 0.0):  # clipping, and measuring only
        trainer = zenflow_run(tmp_path, train_dataset, f"auto{max_grad_norm}", zenflow_update_interval="auto",
                              max_grad_norm=max_grad_norm, learning_rate=1e-3)
        stats = trainer.zenflow_optimizer.stats()
        intervals = logged(trainer, "zenflow/update_interval")
        assert stats["windows"] > 30 // 16 + 1, intervals
        assert min(intervals[-10:]) < 16, intervals


def test_load_best_model_at_end_resyncs_the_masters(tmp_path, train_dataset, eval_dataset):
    """Regression (issue 10.13): after `load_best_model_at_end` the optimizer's fp32 masters kept the last step's
    values, so the next write-back (or a saved optimizer) disagreed with the loaded weights."""
    args = zenflow_args(tmp_path / "best", max_steps=12, eval_strategy="steps", eval_steps=3, save_strategy="steps",
                        save_steps=3, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                        greater_is_better=True, learning_rate=3e-3)  # "best" = highest loss: an early checkpoint
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=train_dataset, eval_dataset=eval_dataset)
    trainer.train()
    assert trainer.state.best_global_step not in (None, 12)  # a checkpoint other than the last one was loaded
    opt = trainer.zenflow_optimizer
    for name, p in trainer.model.named_parameters():
        assert torch.equal(opt.master_weight(p).view(p.shape), p.detach()), name


# peft's get_peft_model reads transformers' deprecated `is_gradient_checkpointing` itself (peft_model.py), not our code
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_with_the_default_settings_is_adamw_torch(tmp_path, train_dataset):
    """Regression (issue 10.3): with `min_offload_numel=0` (the old default) every LoRA matrix went through the host
    path (`lora_B` [out, 8]: one device column) and the LoRA run learned about half as fast as adamw_torch. With the
    default threshold the adapters stay on the device: the run is adamw_torch's."""
    peft = pytest.importorskip("peft")

    def lora_model():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(tiny_llama(), config)

    common = dict(max_steps=20, learning_rate=1e-2, weight_decay=0.01)
    ref = Trainer(model=lora_model(), args=zenflow_args(tmp_path / "ref", zenflow=False, **common),
                  train_dataset=train_dataset)
    ref.train()
    default = ZenFlowConfig().min_offload_numel  # (the helper splits every matrix of the tiny model)
    zen = ZenFlowTrainer(model=lora_model(), args=zenflow_args(tmp_path / "zen", zenflow_min_offload_numel=default,
                                                               **common), train_dataset=train_dataset)
    zen.train()
    assert zen.zenflow_optimizer.stats()["selected_fraction"] == 1.0  # nothing offloaded
    assert_close_rel(logged(zen), logged(ref), 1e-5)


# peft's get_peft_model reads transformers' deprecated `is_gradient_checkpointing` itself (peft_model.py), not our code
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_only_adapters_change(tmp_path, train_dataset):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                              lora_dropout=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = zenflow_run(tmp_path, train_dataset, model=model, max_steps=20, learning_rate=1e-2)
    opt = trainer.zenflow_optimizer
    optimized = {id(p) for g in opt.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert optimized == trainable and trainable
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed), sorted(changed)
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    losses = logged(trainer)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05  # it trains
    trainer.save_model()
    assert (tmp_path / "zenflow" / "adapter_model.safetensors").is_file()
    card = (tmp_path / "zenflow" / "README.md").read_text()
    assert "## ZenFlow" in card and "library_name: peft" in card


def test_activation_checkpointing_gives_the_same_run(tmp_path, train_dataset):
    common = dict(max_steps=10, zenflow_update_interval=2)
    base = zenflow_run(tmp_path, train_dataset, "base", **common)
    checkpointed = zenflow_run(tmp_path, train_dataset, "ckpt", activation_checkpointing=True, **common)
    assert checkpointed.model.is_activation_checkpointing
    assert_close_rel(logged(checkpointed), logged(base), 1e-5)


def test_telemetry_in_logs_and_model_card(tmp_path, train_dataset):
    # (high_lr_rule="off": the configured windows of 4 at the helpers' lr 3e-3, which the rule would shorten to 1)
    trainer = zenflow_run(tmp_path, train_dataset, max_steps=8, logging_steps=4,
                          rules={"high_lr_rule": "off"})
    step_logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(step_logs) == 2
    for entry in step_logs:
        for key in TELEMETRY_KEYS:
            assert key in entry and math.isfinite(entry[key]), key
        assert 0.0 < entry["zenflow/selected_fraction"] < 1.0
        assert entry["zenflow/bytes_to_host"] > 0
        assert 0.0 <= entry["zenflow/device_utilization"] <= 1.0
    first = step_logs[0]  # the run's settings and state, logged once (then where they change)
    assert first["zenflow/update_interval"] == 4
    assert 0.0 < first["zenflow/selected_grad_share"] <= 1.0  # columns were chosen from a gradient
    # the device's peak: more than the weights (gradients, selected columns' state), less than weights + gradients +
    # fp32 AdamW state, as the gradients leave the device in backward under the Trainer
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    params = sum(p.numel() for p in trainer.model.parameters())
    assert weights < first["zenflow/peak_device_bytes"] < weights + 12 * params
    assert first["zenflow/peak_device_bytes_per_param"] > 0
    assert 0.0 < first["zenflow/offloaded_params_fraction"] <= 1.0
    summary = trainer.state.log_history[-1]
    assert "train_loss" in summary and summary["zenflow/steps"] == 8
    assert summary["zenflow/bytes_to_device"] > 0  # a window was written back
    assert summary["zenflow/update_interval"] == 4
    trainer.save_model()
    card = (tmp_path / "zenflow" / "README.md").read_text()
    assert "- hf_zenflow" in card.split("---")[1]  # tag in the YAML front matter
    assert "## ZenFlow" in card and "### ZenFlow settings" in card and "### Measured during training" in card
    assert "| `topk_ratio` | 0.1 |" in card and "| `update_interval` | 4 |" in card
    assert "| optimizer steps | 8 |" in card and "critical path per step" in card
    assert (tmp_path / "zenflow" / "model.safetensors").is_file()


def test_each_log_carries_the_essentials_and_what_changed(tmp_path, train_dataset):
    """Regression: every training log carried 24 `zenflow/*` keys. Each carries the essentials; the settings and
    state the run is in come in the first log and then only where they changed (here the re-selection count, every
    4 steps); the end-of-training summary carries every figure."""
    from hf_zenflow.hf.trainer_telemetry import LAST_STATS, MEAN_STATS, WHEN_CHANGED

    trainer = zenflow_run(tmp_path, train_dataset, max_steps=12, logging_steps=1, rules={"high_lr_rule": "off"},
                          zenflow_select_strategy="step", zenflow_select_interval=4)
    step_logs = [e for e in trainer.state.log_history if "loss" in e]
    zenflow_keys = [{k for k in e if k.startswith("zenflow/")} for e in step_logs]
    # (the first step's wall time holds the set-up: no device utilisation for a log of that step alone)
    assert set(TELEMETRY_KEYS) - {"zenflow/device_utilization"} <= zenflow_keys[0]
    assert all(set(TELEMETRY_KEYS) <= keys for keys in zenflow_keys[1:]), zenflow_keys
    assert len(zenflow_keys[0]) > len(TELEMETRY_KEYS) + 5  # the first log: the settings and state too
    assert max(len(keys) for keys in zenflow_keys[1:]) <= len(TELEMETRY_KEYS) + 3, zenflow_keys
    assert zenflow_keys[-1] - set(TELEMETRY_KEYS) < {f"zenflow/{k}" for k in WHEN_CHANGED}
    # a value is logged again only where it differs from the one logged before it
    for key in (f"zenflow/{k}" for k in WHEN_CHANGED):
        values = [e[key] for e in step_logs if key in e]
        assert all(a != b for a, b in zip(values, values[1:])), f"{key} {values}"
    assert len(logged(trainer, "zenflow/reselections")) >= 2  # re-selections happened and were logged as they did
    summary = trainer.state.log_history[-1]
    assert "train_loss" in summary
    assert {f"zenflow/{k}" for k in (*MEAN_STATS, *LAST_STATS)} <= set(summary), set(summary)
    assert summary["zenflow/steps"] == 12


def test_high_lr_rule_in_logs_and_model_card(tmp_path, train_dataset):
    """At the helpers' lr 3e-3 (x update_interval 4 > 5e-3) the default high_lr_rule engages: one-step windows and
    host beta1 0.4 (write-back lag 1); the logs and the card's measured figures say so."""
    trainer = zenflow_run(tmp_path, train_dataset, max_steps=4, logging_steps=2)
    step_logs = [e for e in trainer.state.log_history if "loss" in e]
    assert all(e["zenflow/high_lr_window"] == 1 and e["zenflow/update_interval"] == 1 for e in step_logs[:1])
    assert all(e["zenflow/host_beta1"] == pytest.approx(0.4) for e in step_logs[:1])
    assert logged(trainer, "zenflow/high_lr_window") == [1, 1]  # the first log, and the summary
    trainer.save_model()
    card = (tmp_path / "zenflow" / "README.md").read_text()
    assert '| high_lr_rule="auto": window steps (0 = not engaged) | 1 |' in card
    assert "| host AdamW beta1 | 0.4" in card and "| `host_step` | auto |" in card


def test_checkpoint_writes_model_card_and_drains(tmp_path, train_dataset, monkeypatch):
    calls = []
    original = ZenFlowAdamW.synchronize

    def spy(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(ZenFlowAdamW, "synchronize", spy)
    args = zenflow_args(tmp_path / "out", max_steps=4, save_strategy="steps", save_steps=2)
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=train_dataset)
    seen = []
    original_save = Trainer._save_checkpoint

    def save(self, model, trial):
        seen.append(len(calls))
        return original_save(self, model, trial)

    monkeypatch.setattr(Trainer, "_save_checkpoint", save)
    trainer.train()
    assert seen and all(n > 0 for n in seen)  # synchronised before each checkpoint
    assert (tmp_path / "out" / "checkpoint-2" / "optimizer.pt").is_file()
    assert "hf_zenflow" in (tmp_path / "out" / "README.md").read_text()


def test_final_weights_contain_every_host_update(tmp_path, train_dataset):
    # 10 steps with U=4 and overlap: without the end-of-training flush, windows 2 and 3 would be missing.
    trainer = zenflow_run(tmp_path, train_dataset, max_steps=10, zenflow_update_interval=4)
    opt = trainer.zenflow_optimizer
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.detach().float(), opt.master_weight(p).view(p.shape), rtol=0, atol=0,
                                   msg=name)


def test_evaluate_mid_training(tmp_path, train_dataset, eval_dataset):
    args = zenflow_args(tmp_path / "out", max_steps=6, eval_strategy="steps", eval_steps=3)
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=train_dataset, eval_dataset=eval_dataset)
    trainer.train()
    assert len(logged(trainer, "eval_loss")) == 2


def test_plain_training_arguments_are_upgraded(tmp_path, train_dataset):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, use_cpu=True, report_to="none",
                             learning_rate=5e-4, hub_token="secret", seed=3)
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=train_dataset)
    assert isinstance(trainer.args, ZenFlowTrainingArguments)
    assert trainer.args.zenflow and trainer.args.learning_rate == 5e-4 and trainer.args.seed == 3
    assert trainer.args.hub_token == "secret"
    assert trainer.args.zenflow_config().update_interval == 4


def test_unsupported_optim_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="adamw_torch"):
        ZenFlowTrainer(model=tiny_llama(), args=TrainingArguments(output_dir=str(tmp_path), optim="sgd",
                                                                 use_cpu=True, report_to="none"))
    args = ZenFlowTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", zenflow=False,
                                    optim="adafactor")
    args.zenflow = True  # switched on after validation: the trainer still refuses
    with pytest.raises(ValueError, match="--optim adafactor"):
        ZenFlowTrainer.get_optimizer_cls_and_kwargs(args)


def test_zenflow_off_is_a_plain_trainer(tmp_path, train_dataset):
    trainer = zenflow_run(tmp_path, train_dataset, max_steps=3, zenflow=False)
    assert trainer.zenflow_optimizer is None
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW)
    assert not any(k.startswith("zenflow/") for e in trainer.state.log_history for k in e)


def test_user_built_zenflow_optimizer(tmp_path, train_dataset):
    model = tiny_llama()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.5, update_interval=2, cpu_threads=1)
    trainer = ZenFlowTrainer(model=model, args=zenflow_args(tmp_path / "o", max_steps=4), train_dataset=train_dataset,
                             optimizers=(opt, None))
    trainer.train()
    assert trainer.zenflow_optimizer is opt
    assert opt.stats()["windows"] == 2 and opt.steps_per_epoch == 64  # 256 samples / batch 4
    assert "zenflow/critical_path_ms" in trainer.state.log_history[0]


def test_tags_added_to_model(tmp_path, train_dataset):
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(tmp_path / "o", max_steps=1),
                             train_dataset=train_dataset)
    assert "hf_zenflow" in trainer.model.model_tags
    assert os.fspath(tmp_path / "o") == trainer.args.output_dir


@pytest.mark.parametrize("layout", ["auto", "row"])
def test_layout_of_linear_weights(tmp_path, train_dataset, layout):
    """`--zenflow_layout auto` (the default) gives a model on the CPU column-major Linear weights before the
    optimizer is built (every other test here trains that way); "row" leaves the model alone."""
    zen = zenflow_run(tmp_path, train_dataset, name=layout, zenflow_layout=layout, max_steps=4)
    q_proj = zen.model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.t().is_contiguous() == (layout == "auto") == (not q_proj.is_contiguous())
    assert zen.model.model.embed_tokens.weight.is_contiguous()  # embeddings stay row-major


class _WorkerThreads(TrainerCallback):
    """The host worker threads seen during training."""

    def __init__(self) -> None:
        self.seen: list[threading.Thread] = []

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        worker = unwrap_zenflow_optimizer(optimizer).host_windows.worker
        if worker is not None and worker._thread is not None and worker._thread not in self.seen:
            self.seen.append(worker._thread)


def _host_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "hf_zenflow-host"}


def test_no_host_thread_outlives_train_and_a_second_train_restarts_it(tmp_path, train_dataset):
    before = _host_threads()
    workers = _WorkerThreads()
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(tmp_path, max_steps=6), train_dataset=train_dataset,
                             callbacks=[workers])
    trainer.train()
    assert len(workers.seen) == 1 and not workers.seen[0].is_alive()
    assert _host_threads() <= before  # no thread of this run is left
    trainer.train()  # trains on: a new worker
    assert len(workers.seen) == 2 and not workers.seen[1].is_alive()
    assert trainer.state.global_step == 6 and trainer.zenflow_optimizer.stats()["steps"] == 12
    assert _host_threads() <= before


# ---- resuming from incomplete checkpoints (issue 22) --------------------------------------------------------------
RESUME = dict(max_steps=6, zenflow_update_interval=2, save_strategy="steps", save_steps=3)


def test_a_checkpoint_without_the_optimizer_state_is_refused_by_name(tmp_path, train_dataset, caplog):
    """Regression: with optimizer.pt missing (a partial copy, save_only_model) the resume started a fresh optimizer
    without a word: moments and schedule lost."""
    from hf_zenflow import CheckpointError

    zenflow_run(tmp_path, train_dataset, "full", **RESUME)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    (checkpoint / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint-3.*optimizer\.pt.*zenflow_resume_without_optimizer"):
        zenflow_run(tmp_path, train_dataset, "refused", resume=str(checkpoint), **RESUME)
    # asked for: it resumes with a fresh optimizer state, and says so
    with caplog.at_level("WARNING", logger="hf_zenflow"):
        resumed = zenflow_run(tmp_path, train_dataset, "asked", resume=str(checkpoint),
                              zenflow_resume_without_optimizer=True, **RESUME)
    assert resumed.state.global_step == 6
    assert "optimizer.pt" in caplog.text and "fresh optimizer state" in caplog.text


@pytest.mark.parametrize("broken", ["trainer_state.json", "optimizer.pt", "model.safetensors"])
def test_resume_true_skips_an_incomplete_newest_checkpoint(tmp_path, train_dataset, broken, caplog):
    """Regression: after a kill during a save, resume_from_checkpoint=True picked the partial newest folder and
    failed (FileNotFoundError ... trainer_state.json) although a complete older checkpoint existed."""
    full = zenflow_run(tmp_path, train_dataset, "full", **RESUME)
    run = tmp_path / "run"
    (run / "checkpoint-3").mkdir(parents=True)
    for item in (tmp_path / "full" / "checkpoint-3").iterdir():
        (run / "checkpoint-3" / item.name).write_bytes(item.read_bytes())
    partial = run / "checkpoint-6"
    partial.mkdir()
    for item in (tmp_path / "full" / "checkpoint-6").iterdir():
        if item.name != broken:
            (partial / item.name).write_bytes(item.read_bytes())
    with caplog.at_level("WARNING", logger="hf_zenflow"):
        resumed = zenflow_run(tmp_path, train_dataset, "run", resume=True, **RESUME)
    assert "checkpoint-6" in caplog.text and broken in caplog.text and "checkpoint-3" in caplog.text
    assert logged(resumed)[3:] == logged(full)[3:]  # steps 4-6 trained again from checkpoint-3, as uninterrupted
