"""`ZenFlowTrainingArguments`: command-line parsing, validation naming the flag, serialisation, conflicts."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from transformers import HfArgumentParser, TrainingArguments

from hf_zenflow import ZenFlowConfig
from hf_zenflow.hf.training_args import ZenFlowTrainingArguments


BASE = ["--output_dir", "unused", "--use_cpu", "--report_to", "none"]


def parse(*flags: str) -> ZenFlowTrainingArguments:
    (args,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses([*BASE, *flags])
    return args


def make(**kwargs) -> ZenFlowTrainingArguments:
    return ZenFlowTrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **kwargs)


def test_defaults_match_zenflow_config():
    args = parse()
    assert args.zenflow is True
    assert args.zenflow_config() == ZenFlowConfig()
    assert args.zenflow_update_interval == 4 and isinstance(args.zenflow_update_interval, int)


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("AUTO", "auto"), ("4", 4), ("12", 12)])
def test_update_interval_parses_int_or_auto(value, expected):
    args = parse("--zenflow_update_interval", value)
    assert args.zenflow_update_interval == expected
    assert args.zenflow_config().update_interval == expected


def test_every_flag_parses_into_the_config():
    args = parse(
        "--zenflow_topk_ratio", "0.25", "--zenflow_update_interval", "auto", "--zenflow_select_strategy", "step",
        "--zenflow_select_interval", "50", "--zenflow_full_warm_up_rounds", "3", "--zenflow_overlap_step", "False",
        "--zenflow_cpu_threads", "2",
    )
    assert args.zenflow_config() == ZenFlowConfig(
        topk_ratio=0.25, update_interval="auto", select_strategy="step", select_interval=50, full_warm_up_rounds=3,
        overlap_step=False, cpu_threads=2,
    )
    assert parse("--no_zenflow_overlap_step").zenflow_overlap_step is False
    assert parse("--no_zenflow").zenflow is False


def test_help_renders():
    # argparse formats every help string (a bare % would raise here).
    text = HfArgumentParser(ZenFlowTrainingArguments).format_help()
    for flag in ("--zenflow_topk_ratio", "--zenflow_update_interval", "--zenflow_select_strategy",
                 "--zenflow_select_interval", "--zenflow_full_warm_up_rounds", "--zenflow_overlap_step",
                 "--zenflow_cpu_threads"):
        assert flag in text
    assert "10% of the columns" in " ".join(text.split())  # "%%" rendered as "%"


@pytest.mark.parametrize(
    ("flags", "flag_name"),
    [
        (["--zenflow_update_interval", "often"], "--zenflow_update_interval"),
        (["--zenflow_update_interval", "0"], "--zenflow_update_interval"),
        (["--zenflow_topk_ratio", "1.5"], "--zenflow_topk_ratio"),
        (["--zenflow_select_interval", "-2", "--zenflow_select_strategy", "step"], "--zenflow_select_interval"),
        (["--zenflow_full_warm_up_rounds", "-1"], "--zenflow_full_warm_up_rounds"),
        (["--zenflow_cpu_threads", "0"], "--zenflow_cpu_threads"),
        (["--zenflow_select_interval", "3"], "--zenflow_select_interval"),  # needs strategy step/epoch
    ],
)
def test_bad_values_name_the_flag(flags, flag_name):
    with pytest.raises(ValueError, match=flag_name):
        parse(*flags)


def test_bad_select_strategy_is_rejected_by_argparse():
    with pytest.raises(SystemExit):
        parse("--zenflow_select_strategy", "sometimes")
    with pytest.raises(ValueError, match="--zenflow_select_strategy"):
        make(zenflow_select_strategy="sometimes")


def test_to_dict_and_json_round_trip():
    args = make(zenflow_topk_ratio=0.2, zenflow_update_interval="auto", zenflow_overlap_step=False,
                zenflow_cpu_threads=3, zenflow_select_strategy="step", zenflow_select_interval="7",
                zenflow_host_step="zenflow", zenflow_min_offload_numel=4096, zenflow_host_state="lean",
                zenflow_layout="row")
    as_dict = args.to_dict()
    assert {k: v for k, v in as_dict.items() if k.startswith("zenflow")} == {
        "zenflow": True, "zenflow_topk_ratio": 0.2, "zenflow_update_interval": "auto",
        "zenflow_select_strategy": "step", "zenflow_select_interval": 7, "zenflow_full_warm_up_rounds": 0,
        "zenflow_overlap_step": False, "zenflow_cpu_threads": 3, "zenflow_host_step": "zenflow",
        "zenflow_min_offload_numel": 4096, "zenflow_host_state": "lean", "zenflow_layout": "row",
        "zenflow_auto_ratio": 0.99, "zenflow_from_deepspeed": None,
        "zenflow_resume_without_optimizer": False,
        "zenflow_device_memory_limit_bytes": None,
    }
    restored = ZenFlowTrainingArguments(**{**json.loads(args.to_json_string()), "hub_token": None})
    assert restored.zenflow_config() == args.zenflow_config()
    assert restored.to_dict() == as_dict


def test_layout_is_validated():
    with pytest.raises(ValueError, match=r"--zenflow_layout='columns' is invalid: allowed are 'auto', 'column'"):
        make(zenflow_layout="columns")


def test_zenflow_config_overrides():
    assert make().zenflow_config(topk_ratio=0.25).topk_ratio == 0.25


def test_deepspeed_conflict():
    with pytest.raises(ValueError, match="DeepSpeed"):
        make(deepspeed={"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}})


def test_deepspeed_from_accelerate_env(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="DeepSpeed"):
        make()


def test_fsdp2_is_accepted_from_the_arguments_and_from_accelerate(monkeypatch):
    assert make(fsdp=True, fsdp_config={"version": 2}).fsdp_plugin_args["fsdp_version"] == 2
    assert make(fsdp=True).fsdp_plugin_args["fsdp_version"] == 2  # transformers 5's default
    assert make(fsdp=True, fsdp_config={"fsdp_version": 2}).zenflow
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")  # what `accelerate launch` sets from fsdp_version: 2
    assert make().zenflow


@pytest.mark.parametrize("config", [{"version": 1}, {"fsdp_version": 1}])
def test_fsdp1_is_refused_naming_the_version_and_fsdp2(config):
    with pytest.raises(ValueError, match=r"--fsdp with fsdp_config version 1 \(FSDP1\): only FSDP2.*fsdp_version 2"):
        make(fsdp=True, fsdp_config=config)


@pytest.mark.parametrize(("version", "shown"), [(None, "FSDP_VERSION=1"), ("1", "FSDP_VERSION=1"),
                                               ("3", "FSDP_VERSION=3 \\(FSDP version 3\\)")])
def test_fsdp1_from_accelerate_env_is_refused(monkeypatch, version, shown):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate's plugin takes FSDP_VERSION, 1 when unset
    if version is None:
        monkeypatch.delenv("FSDP_VERSION", raising=False)
    else:
        monkeypatch.setenv("FSDP_VERSION", version)
    with pytest.raises(ValueError, match=rf"ACCELERATE_USE_FSDP with {shown}.*only FSDP2"):
        make()


def test_column_layout_is_refused_with_fsdp():
    with pytest.raises(ValueError, match=r"--zenflow_layout='column' cannot be combined with FSDP.*'auto' or 'row'"):
        make(fsdp=True, zenflow_layout="column")
    assert make(fsdp=True, zenflow_layout="auto").zenflow_layout == "auto"


def test_fp16_and_bf16_are_fine():
    assert make(fp16=True).fp16  # (the GradScaler: tests/engine/test_amp.py, tests/hf/test_trainer_fp16.py)
    assert make(bf16=True).bf16


def test_fp16_from_accelerate_env(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert make().mixed_precision == "fp16"


def test_unsupported_optim():
    with pytest.raises(ValueError, match="--optim sgd"):
        make(optim="sgd")
    assert make(optim="adamw_torch").zenflow
    assert make(optim="adamw_torch_fused").zenflow


def test_conflicts_ignored_when_zenflow_is_off():
    args = make(zenflow=False, optim="sgd")
    assert args.optim == "sgd"


def test_is_a_training_arguments():
    assert isinstance(make(), TrainingArguments)


@pytest.mark.parametrize(("text", "expected"), [("false", False), ("False", False), ("no", False), ("0", False),
                                                ("true", True), ("YES", True), ("1", True)])
def test_boolean_strings_from_python_are_parsed_like_the_command_line(text, expected):
    """``ZenFlowTrainingArguments(zenflow_resume_without_optimizer="false")`` (and ``zenflow="false"``) used to be
    truthy from Python: a run resumed with a fresh optimizer state. The command line parses the same text."""
    args = make(zenflow=text, zenflow_resume_without_optimizer=text, zenflow_overlap_step=text)
    assert args.zenflow is expected and args.zenflow_resume_without_optimizer is expected
    assert args.zenflow_overlap_step is expected
    (cli,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "--report_to", "none", "--zenflow", text,
         "--zenflow_resume_without_optimizer", text, "--zenflow_overlap_step", text])
    assert (cli.zenflow, cli.zenflow_resume_without_optimizer, cli.zenflow_overlap_step) == (expected,) * 3


def test_a_boolean_field_refuses_other_text_naming_the_field():
    with pytest.raises(ValueError, match=r"zenflow_resume_without_optimizer='maybe'.*true.*false"):
        make(zenflow_resume_without_optimizer="maybe")


def test_the_zenflow_fields_are_the_config_fields_with_their_defaults_help_and_types():
    """The `zenflow_<setting>` fields are written out (greppable), one per `ZenFlowConfig` field: they match the
    settings' names, command-line types, defaults, help and choices."""
    import typing

    from hf_zenflow.hf.training_args import ZenFlowSettingArguments
    from hf_zenflow.settings.flags import trainer_fields

    expected = trainer_fields("zenflow_")
    written = fields(ZenFlowSettingArguments)
    hints = typing.get_type_hints(ZenFlowSettingArguments)
    assert [f.name for f in written] == [name for name, _, _ in expected]
    for f, (name, annotation, spec) in zip(written, expected):
        assert hints[f.name] == annotation, name
        assert f.default == spec.default and dict(f.metadata) == dict(spec.metadata), name
