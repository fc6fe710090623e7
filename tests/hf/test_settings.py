"""One source for the ZenFlow settings: every `ZenFlowConfig` field is a Trainer flag, a `ZenFlowPlugin` argument, an
``HF_ZENFLOW_<FIELD>`` variable and an example-script flag, read the same way everywhere, with help, true default
and choices taken from `ZenFlowConfig`; the docs list them all."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest
from hf_helpers import REPO_ROOT, tiny_llama, zenflow_args
from transformers import HfArgumentParser

from hf_zenflow import ZenFlowConfig, ZenFlowPlugin
from hf_zenflow.hf.accelerate_plugin import env_name
from hf_zenflow.hf.trainer import ZenFlowTrainer
from hf_zenflow.hf.training_args import ZENFLOW_FIELDS, ZenFlowTrainingArguments
from hf_zenflow.settings.config import REMOVED_SETTINGS
from hf_zenflow.settings.flags import SETTINGS, SETTINGS_BY_NAME, add_arguments, format_default


#: (setting, command-line / environment text, the value ZenFlowConfig must end up with, other settings it needs).
#: Every value differs from the default, so reaching the config proves the path works.
CASES = [
    ("topk_ratio", "0.25", 0.25, {}),
    ("update_interval", "Auto", "auto", {}),
    ("update_interval", "8", 8, {}),
    ("select_strategy", "STEP", "step", {}),
    ("select_interval", "7", 7, {"select_strategy": "step"}),
    ("full_warm_up_rounds", "3", 3, {}),
    ("overlap_step", "false", False, {}),
    ("auto_ratio", "0.5", 0.5, {}),
    ("host_step", "ZenFlow", "zenflow", {}),
    ("min_offload_numel", "12345", 12345, {}),
    ("host_state", "Lean", "lean", {}),
    ("device_memory_limit_bytes", "2000000", 2000000, {}),
    ("cpu_threads", "2", 2, {}),
]
BASE = ["--output_dir", "unused", "--use_cpu", "--report_to", "none"]


def test_the_table_covers_every_field():
    assert {name for name, *_ in CASES} == {f.name for f in fields(ZenFlowConfig)}, (
        "a ZenFlowConfig field has no row in CASES: add one")
    for name, _, value, _ in CASES:
        assert value != getattr(ZenFlowConfig(), name)


def test_every_field_is_a_flag_and_no_removed_setting_is():
    assert set(ZENFLOW_FIELDS.values()) == {f.name for f in fields(ZenFlowConfig)}
    flags = HfArgumentParser(ZenFlowTrainingArguments)._option_string_actions
    assert all(f"--{arg}" in flags for arg in ZENFLOW_FIELDS)
    assert not [name for name in REMOVED_SETTINGS if f"--zenflow_{name}" in flags]


def _from_trainer_flags(name, text, needs):
    flags = [f"--zenflow_{name}", text]
    for other, value in needs.items():
        flags += [f"--zenflow_{other}", value]
    (args,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses([*BASE, *flags])
    return args.zenflow_config()


def _from_env(monkeypatch, name, text, needs):
    for setting in SETTINGS:
        monkeypatch.delenv(env_name(setting.name), raising=False)
    monkeypatch.setenv(env_name(name), text)
    for other, value in needs.items():
        monkeypatch.setenv(env_name(other), value)
    return ZenFlowPlugin().to_config()


def _from_script_flags(name, text, needs):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = [f"--{name}", text, *[item for other, value in needs.items() for item in (f"--{other}", value)]]
    args = parser.parse_args(flags)
    return ZenFlowPlugin(**{s.name: getattr(args, s.name) for s in SETTINGS}).to_config()


@pytest.mark.parametrize(("name", "text", "expected", "needs"), CASES, ids=[f"{c[0]}={c[1]}" for c in CASES])
def test_every_path_gives_the_same_config(monkeypatch, name, text, expected, needs):
    paths = {
        # (a plugin argument of None means "not given": None itself is spelled as text there, as in a flag)
        "plugin arguments": ZenFlowPlugin(**{name: text if expected is None else expected, **needs}).to_config(),
        "HF_ZENFLOW_* environment": _from_env(monkeypatch, name, text, needs),
        "example-script flags": _from_script_flags(name, text, needs),
        "ZenFlowConfig from text": ZenFlowConfig(**{name: text, **needs}) if SETTINGS_BY_NAME[name].kind in (
            "text", "choice") else ZenFlowConfig(**{name: expected, **needs}),
    }
    paths["Trainer flags"] = _from_trainer_flags(name, text, needs)
    reference = ZenFlowConfig(**{name: expected, **needs})
    for path, config in paths.items():
        assert config == reference, path
        assert getattr(config, name) == expected and type(getattr(config, name)) is type(expected), path


def test_flags_carry_the_help_true_default_and_choices():
    actions = HfArgumentParser(ZenFlowTrainingArguments)._option_string_actions
    defaults = ZenFlowConfig()
    for arg, name in ZENFLOW_FIELDS.items():
        action = actions[f"--{arg}"]
        setting = SETTINGS_BY_NAME[name]
        assert action.default == getattr(defaults, name), arg
        assert " ".join(setting.help.split()[:4]) in action.help, arg  # the config's own text
        assert action.choices == (list(setting.choices) if setting.choices else None), arg
    assert actions["--zenflow_select_strategy"].choices == ["auto", "step", "epoch"]
    assert actions["--zenflow_host_state"].choices == ["auto", "fp32", "lean"]


def test_choices_are_case_insensitive_everywhere():
    assert ZenFlowConfig(select_strategy=" STEP", select_interval=3, host_state="FP32").select_strategy == "step"
    args = ZenFlowTrainingArguments(output_dir="unused", use_cpu=True, report_to="none",
                                    zenflow_select_strategy="Step", zenflow_select_interval="3",
                                    zenflow_update_interval="AUTO", zenflow_host_state="Lean",
                                    zenflow_layout="COLUMN")
    assert (args.zenflow_select_strategy, args.zenflow_update_interval, args.zenflow_host_state,
            args.zenflow_layout) == ("step", "auto", "lean", "column")
    (parsed,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses(
        [*BASE, "--zenflow_select_strategy", "EPOCH", "--zenflow_host_state", "FP32", "--zenflow_layout", "Row"])
    assert (parsed.zenflow_select_strategy, parsed.zenflow_host_state, parsed.zenflow_layout) == (
        "epoch", "fp32", "row")
    plugin = ZenFlowPlugin(select_strategy="STEP", update_interval="Auto", host_state="LEAN")
    assert (plugin.to_config().select_strategy, plugin.to_config().update_interval,
            plugin.to_config().host_state) == ("step", "auto", "lean")


def test_bad_choice_names_the_flag_and_what_is_allowed():
    with pytest.raises(ValueError,
                       match=r"--zenflow_host_state='small' is invalid: allowed is \"auto\" \| \"fp32\" \| \"lean\""):
        ZenFlowTrainingArguments(output_dir="unused", use_cpu=True, report_to="none", zenflow_host_state="small")


def test_zen_auto_settings_reach_the_optimizer(tmp_path, train_dataset):
    (args,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses(
        [*BASE, "--zenflow_update_interval", "auto", "--zenflow_auto_ratio", "0.5"])
    args = zenflow_args(tmp_path, max_steps=2, **{k: v for k, v in vars(args).items() if k.startswith("zenflow_")})
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=train_dataset)
    trainer.train()
    config = trainer.zenflow_optimizer.config
    assert (config.update_interval, config.auto_ratio, config.rules.auto_max_interval) == ("auto", 0.5, 16)


@pytest.mark.parametrize("rule", ["auto_max_interval", "host_lr_scale", "high_lr_rule", "host_step_guard",
                                  "writeback_lag"])
def test_an_engine_rule_is_no_flag(rule):
    with pytest.raises(ValueError, match=f"not used by the HfArgumentParser: \\['--zenflow_{rule}'"):
        HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses([*BASE, f"--zenflow_{rule}", "1"])


@pytest.mark.parametrize("name", ["accumulate_on", "host_moment_dtype", "host_sum_dtype", "host_sum_columns",
                                  "host_writeback", "free_gradients_in_backward"])
def test_the_host_state_rules_are_no_flags(name):
    with pytest.raises(ValueError, match=f"not used by the HfArgumentParser: \\['--zenflow_{name}'"):
        HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses([*BASE, f"--zenflow_{name}", "auto"])


def _doc_entries(doc: str) -> dict[str, str]:
    """``name (type, *optional*, defaults to `x`):`` -> ``x``."""
    return dict(re.findall(r"^\s*(zenflow\w*) \(.*?, \*optional\*, defaults to `(.*?)`\):$", doc, re.MULTILINE))


def test_training_arguments_docstring_lists_every_zenflow_field_with_its_default():
    entries = _doc_entries(ZenFlowTrainingArguments.__doc__)
    documented = {f.name: f for f in fields(ZenFlowTrainingArguments) if f.name.startswith("zenflow")}
    assert set(entries) == set(documented)
    for name, f in documented.items():
        assert entries[name] == format_default(f.default), name
    text = " ".join(ZenFlowTrainingArguments.__doc__.split())
    assert "> Parameters that control ZenFlow" in text
    for arg, name in ZENFLOW_FIELDS.items():
        assert " ".join(SETTINGS_BY_NAME[name].help.split()[-4:]) in text, arg


def test_plugin_docstring_lists_every_setting_and_its_variable():
    text = " ".join(ZenFlowPlugin.__doc__.split())
    for setting in SETTINGS:
        assert f"{setting.name}: ``{env_name(setting.name)}``;" in text
        assert " ".join(setting.help.split()[-4:]) in text


def test_docs_settings_table_lists_every_field_with_its_default():
    table = (REPO_ROOT / "docs" / "settings.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.MULTILINE))
    for f in fields(ZenFlowConfig):
        assert f.name in rows, f"docs/settings.md: the settings table has no row for {f.name}"
        assert rows[f.name].strip().strip("`") == format_default(f.default), f.name
