"""A DeepSpeed ZenFlow config moves over to `ZenFlowTrainingArguments` in one step, by path, dict or flag: the zenflow
block, the AdamW parameters, clipping, bf16 and batch sizes; "auto" keeps the TrainingArguments value; what cannot
move over is named in one warning; values given on both sides must agree."""

from __future__ import annotations

import json
import warnings

import pytest
from hf_helpers import REPO_ROOT
from transformers import HfArgumentParser

from hf_zenflow.hf.training_args import ZenFlowTrainingArguments
from hf_zenflow.settings.config import available_cpu_count
from hf_zenflow.settings.deepspeed_config import training_values


ZF_CONFIG = REPO_ROOT / "tests" / "data" / "zf_config.json"  # shaped like DeepSpeedExamples' ZenFlow fine-tune
COMMON = dict(use_cpu=True, report_to="none")


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def moved(source=ZF_CONFIG, **kwargs) -> tuple[ZenFlowTrainingArguments, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        args = ZenFlowTrainingArguments.from_deepspeed(source, output_dir="unused", **COMMON, **kwargs)
    return args, [str(w.message) for w in seen if "not moved over" in str(w.message)]


def expected_cpu_threads() -> int:
    n = available_cpu_count()
    return n if n == 1 else n - -(-n // 2)  # pt_reserved_cores_perc 0.5 keeps half the cores for training


def test_the_published_example_moves_over_by_path():
    args, dropped = moved()
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (
        2e-5, 0.9, 0.999, 1e-8, 0.01)
    assert (args.max_grad_norm, args.bf16) == (1.0, True)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)  # train_batch_size 8, 1 rank
    config = args.zenflow_config()
    assert (config.topk_ratio, config.update_interval, config.full_warm_up_rounds, config.overlap_step) == (
        0.1, 4, 0, True)
    assert (config.select_strategy, config.select_interval) == ("auto", "auto")
    assert config.cpu_threads == expected_cpu_threads()
    # stage 2 + CPU optimizer offload with pinned memory is what ZenFlowAdamW does itself: not reported
    assert len(dropped) == 1 and "wall_clock_breakdown" in dropped[0]
    for covered in ("stage", "offload_optimizer", "pin_memory", "zero_allow_untested_optimizer", "gradient_clipping"):
        assert covered not in dropped[0]


def test_the_flag_gives_the_same_arguments():
    with pytest.warns(UserWarning, match="not moved over.*wall_clock_breakdown"):
        (args,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", "unused", "--use_cpu", "--report_to", "none", "--zenflow_from_deepspeed", str(ZF_CONFIG)])
    reference, _ = moved()
    names = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm", "bf16",
             "per_device_train_batch_size", "gradient_accumulation_steps")
    assert {n: getattr(args, n) for n in names} == {n: getattr(reference, n) for n in names}
    assert args.zenflow_config() == reference.zenflow_config()


def test_train_batch_size_is_split_over_the_world_size():
    # (the mapping alone: WORLD_SIZE=2 in this process would make accelerate set up a process group)
    config = json.loads(ZF_CONFIG.read_text())
    values, _ = training_values(config, world_size=2)
    assert (values["per_device_train_batch_size"][1], values["gradient_accumulation_steps"][1]) == (4, 1)
    values, _ = training_values({**config, "gradient_accumulation_steps": 2}, world_size=2)
    assert (values["per_device_train_batch_size"][1], values["gradient_accumulation_steps"][1]) == (2, 2)
    values, _ = training_values({**config, "train_micro_batch_size_per_gpu": 2}, world_size=2)
    assert (values["per_device_train_batch_size"][1], values["gradient_accumulation_steps"][1]) == (2, 2)


def test_auto_values_keep_the_training_arguments():
    config = json.loads(ZF_CONFIG.read_text())
    config.update({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                   "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}})
    config["optimizer"]["params"] = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
    args, _ = moved(config, learning_rate=1e-4, per_device_train_batch_size=2, max_grad_norm=0.5)
    assert (args.learning_rate, args.per_device_train_batch_size, args.max_grad_norm, args.bf16) == (
        1e-4, 2, 0.5, False)
    assert (args.adam_beta1, args.weight_decay, args.gradient_accumulation_steps) == (0.9, 0.0, 1)  # the defaults
    assert args.zenflow_update_interval == 4  # the zenflow block still moves over


def test_no_gradient_clipping_means_no_clipping_as_under_deepspeed():
    config = json.loads(ZF_CONFIG.read_text())
    del config["gradient_clipping"]
    args, _ = moved(config)
    assert args.max_grad_norm == 0.0


def test_a_value_given_on_both_sides_must_agree():
    with pytest.raises(ValueError, match=r"optimizer.params.lr=2e-05 but learning_rate=0.0001 was given"):
        moved(learning_rate=1e-4)
    with pytest.raises(ValueError, match=r"zenflow.update_interval=4 but zenflow_update_interval='?8'? was given"):
        moved(zenflow_update_interval=8)
    args, _ = moved(learning_rate=2e-5, zenflow_update_interval="4")  # the same values: fine
    assert args.zenflow_update_interval == 4


def test_what_would_change_the_training_fails():
    config = json.loads(ZF_CONFIG.read_text())
    with pytest.raises(ValueError, match="optimizer.type='Lamb'"):
        moved({**config, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    with pytest.raises(ValueError, match="train_batch_size=8 is not"):
        moved({**config, "train_micro_batch_size_per_gpu": 3})


def test_unmapped_settings_are_named_in_one_warning():
    config = json.loads(ZF_CONFIG.read_text())
    config["zero_optimization"].update({"stage": 3, "overlap_comm": True, "reduce_bucket_size": 5e8})
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    _, dropped = moved(config)
    assert len(dropped) == 1
    for key in ("zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size", "stage=3",
                "scheduler (set lr_scheduler_type and warmup_steps)", "wall_clock_breakdown"):
        assert key in dropped[0]


def test_the_zenflow_block_alone_sets_only_zenflow():
    args, dropped = moved({"topk_ratio": 0.05, "update_interval": 2})
    assert (args.zenflow_topk_ratio, args.zenflow_update_interval, args.zenflow_overlap_step) == (0.05, 2, False)
    assert (args.max_grad_norm, args.learning_rate) == (1.0, 5e-5) and not dropped


def test_round_trip_through_to_dict():
    args, _ = moved()
    with pytest.warns(UserWarning, match="not moved over"):  # the config is applied again: same values, no conflict
        restored = ZenFlowTrainingArguments(**{**json.loads(args.to_json_string()), "hub_token": None})
    assert restored.to_dict() == args.to_dict()


def test_deepspeed_conflict_points_to_the_flag():
    with pytest.raises(ValueError, match="--zenflow_from_deepspeed"):
        ZenFlowTrainingArguments(output_dir="unused", deepspeed=str(ZF_CONFIG), **COMMON)


def test_fp16_moves_over_and_its_loss_scale_settings_are_named():
    config = {**json.loads(ZF_CONFIG.read_text()), "bf16": {"enabled": False},
              "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}}
    args, dropped = moved(config)
    assert (args.fp16, args.bf16) == (True, False)
    assert "fp16.loss_scale" in dropped[0] and "fp16.initial_scale_power" in dropped[0]
