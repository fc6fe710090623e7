"""`ZenFlowConfig`: validation names the field, the value and what is allowed; DeepSpeed blocks move over."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig
from hf_zenflow.settings.config import DEFAULT_SELECT_STEPS, available_cpu_count


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("topk_ratio", 1.5),
        ("topk_ratio", -0.1),
        ("topk_ratio", "0.1"),
        ("topk_ratio", float("nan")),
        ("update_interval", 0),
        ("update_interval", "sometimes"),
        ("update_interval", 2.5),
        ("select_strategy", "batch"),
        ("select_interval", 0),
        ("full_warm_up_rounds", -1),
        ("full_warm_up_rounds", 1.5),
        ("overlap_step", "yes"),
        ("auto_ratio", 0.0),
        ("auto_ratio", 1.2),
        ("min_offload_numel", -1),
        ("host_state", "small"),
        ("cpu_threads", 0),
    ],
)
def test_invalid_values_name_the_field_and_the_value(field, value):
    kwargs = {field: value}
    if field == "select_interval":
        kwargs["select_strategy"] = "step"
    with pytest.raises(ValueError) as info:
        ZenFlowConfig(**kwargs)
    message = str(info.value)
    assert f"ZenFlowConfig.{field}=" in message
    assert repr(value) in message or str(value) in message
    assert "allowed" in message


#: Every setting of ZenFlowConfig that takes a choice of strings (its metadata's "choices").
CHOICE_FIELDS = [f.name for f in fields(ZenFlowConfig) if f.metadata.get("choices")]


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("field", CHOICE_FIELDS + ["update_interval", "select_interval", "topk_ratio",
                                                   "auto_ratio"])
def test_a_bool_is_refused_where_a_choice_or_a_number_is_expected(field, value):
    """Regression: a bool was taken for a choice field's "on"."""
    kwargs = {field: value, **({"select_strategy": "step"} if field == "select_interval" else {})}
    with pytest.raises(ValueError, match=rf"ZenFlowConfig\.{field}={value!r} is invalid: allowed is"):
        ZenFlowConfig(**kwargs)


def test_optimizer_rejects_bad_settings_at_construction():
    import torch

    with pytest.raises(ValueError, match="topk_ratio"):
        ZenFlowAdamW([torch.nn.Parameter(torch.zeros(2, 2))], topk_ratio=2.0)
    with pytest.raises(ValueError, match="unknown argument"):
        ZenFlowAdamW([torch.nn.Parameter(torch.zeros(2, 2))], top_k=0.1)
    with pytest.raises(ValueError, match="betas"):
        ZenFlowAdamW([torch.nn.Parameter(torch.zeros(2, 2))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="host_executor"):
        ZenFlowAdamW([torch.nn.Parameter(torch.zeros(2, 2))], host_executor="process")


def test_strings_from_a_command_line_parse():
    cfg = ZenFlowConfig(update_interval="8", select_strategy="step", select_interval="AUTO")
    assert cfg.update_interval == 8 and cfg.select_interval == "auto"
    assert ZenFlowConfig(update_interval="auto").is_auto_interval


def test_integer_interval_with_auto_strategy_is_rejected():
    with pytest.raises(ValueError, match='select_interval=5.*select_strategy="auto"'):
        ZenFlowConfig(select_interval=5)


@pytest.mark.parametrize(
    ("strategy", "interval", "steps_per_epoch", "period"),
    [
        ("step", 7, None, 7),
        ("step", "auto", None, DEFAULT_SELECT_STEPS),
        ("epoch", 2, 30, 60),
        ("epoch", "auto", 30, 30),
        ("auto", "auto", 30, 30),
        ("auto", "auto", None, DEFAULT_SELECT_STEPS),
    ],
)
def test_select_period(strategy, interval, steps_per_epoch, period):
    cfg = ZenFlowConfig(select_strategy=strategy, select_interval=interval)
    assert cfg.select_period(steps_per_epoch) == period


def test_the_epoch_strategy_needs_the_epoch_length():
    with pytest.raises(ValueError, match="needs the epoch length.*steps_per_epoch=N"):
        ZenFlowConfig(select_strategy="epoch", select_interval=1).select_period(None)


def test_cpu_threads_default_follows_affinity():
    assert ZenFlowConfig().resolved_cpu_threads == max(1, available_cpu_count() // 2)
    assert ZenFlowConfig(cpu_threads=1).resolved_cpu_threads == 1


def test_cpu_threads_above_the_affinity_cores_warn_and_clamp():
    cores = available_cpu_count()
    config = ZenFlowConfig(cpu_threads=cores + 5)  # valid: the same settings may run on a bigger machine
    with pytest.warns(UserWarning, match=rf"cpu_threads={cores + 5} is more than the {cores} core"):
        assert config.resolved_cpu_threads == cores


def test_from_deepspeed_whole_config_and_block():
    ds = {
        "train_batch_size": 8,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "zenflow": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 10,
                        "update_interval": 4, "full_warm_up_rounds": 2, "overlap_step": True},
        },
    }
    cfg = ZenFlowConfig.from_deepspeed(ds)
    assert (cfg.topk_ratio, cfg.update_interval, cfg.select_interval, cfg.full_warm_up_rounds, cfg.overlap_step) == (
        0.05, 4, 10, 2, True)
    # DeepSpeed's defaults for missing keys, so a moved-over run behaves as it did there
    block = ZenFlowConfig.from_deepspeed({"topk_ratio": 0.2})
    assert block.update_interval == "auto" and block.overlap_step is False


def test_from_deepspeed_maps_reserved_cores_and_rejects_unknown_keys():
    cfg = ZenFlowConfig.from_deepspeed({"pt_reserved_cores_perc": 0.5})
    n = available_cpu_count()
    assert cfg.cpu_threads == (n if n == 1 else n - -(-n // 2))
    with pytest.raises(ValueError, match="unknown zenflow key"):
        ZenFlowConfig.from_deepspeed({"topk": 0.1})
    with pytest.raises(ValueError, match="no zero_optimization.zenflow"):
        ZenFlowConfig.from_deepspeed({"zero_optimization": {"stage": 2}})
    with pytest.warns(UserWarning, match="offload"):
        ZenFlowConfig.from_deepspeed({"offload": True})


def test_dict_round_trip():
    cfg = ZenFlowConfig(topk_ratio=0.2, update_interval="auto")
    assert ZenFlowConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        ZenFlowConfig.from_dict({"topk": 1})


ZF_CONFIG = Path(__file__).parents[1] / "data" / "zf_config.json"  # shaped like DeepSpeedExamples' ZenFlow fine-tune


def test_from_deepspeed_takes_a_json_file_path():
    for source in (ZF_CONFIG, str(ZF_CONFIG), ZF_CONFIG.read_text()):
        cfg = ZenFlowConfig.from_deepspeed(source)
        assert (cfg.topk_ratio, cfg.update_interval, cfg.full_warm_up_rounds, cfg.overlap_step) == (0.1, 4, 0, True)
        assert cfg.select_strategy == "auto" and cfg.select_interval == "auto"  # DeepSpeed's defaults
        n = available_cpu_count()
        assert cfg.cpu_threads == (n if n == 1 else n - -(-n // 2))  # pt_reserved_cores_perc 0.5


def test_from_deepspeed_bad_sources_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ZenFlowConfig.from_deepspeed(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        ZenFlowConfig.from_deepspeed(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="dict, a JSON file path or JSON text"):
        ZenFlowConfig.from_deepspeed(42)


def test_writeback_lag_is_bounded_by_the_window():
    assert ZenFlowConfig(update_interval=4).with_rules(writeback_lag=4).rules.writeback_lag == 4
    auto = ZenFlowConfig(update_interval="auto").with_rules(writeback_lag=8, auto_max_interval=8)
    assert auto.rules.writeback_lag == 8
    with pytest.raises(ValueError, match=r'EngineRules.writeback_lag=9 .*the longest "auto" window \(8\)'):
        ZenFlowConfig(update_interval="auto").with_rules(writeback_lag=9, auto_max_interval=8)
    with pytest.raises(ValueError, match=r"EngineRules.writeback_lag=4 .*update_interval \(2\)"):
        ZenFlowConfig(update_interval=4).with_rules(writeback_lag=4).replace(update_interval=2)


REMOVED = ("host_grad_dtype", "device_memory_budget_bytes", "steps_per_epoch")


def test_the_removed_settings_are_gone_and_a_use_of_one_names_it():
    """`host_grad_dtype`, `device_memory_budget_bytes` (`device_memory_limit_bytes` gives the room) and
    `steps_per_epoch` (the data's, passed to the optimizer) are no settings: a dataclass field, a keyword of
    `ZenFlowConfig` or of `ZenFlowAdamW`, or an entry of a settings dict that names one fails, naming it."""
    import torch

    from hf_zenflow.settings.config import REMOVED_SETTINGS

    names = {f.name for f in fields(ZenFlowConfig)}
    assert not names & set(REMOVED) and set(REMOVED) <= set(REMOVED_SETTINGS)
    for name in ("host_grad_dtype", "device_memory_budget_bytes"):
        with pytest.raises(TypeError, match=name):
            ZenFlowConfig(**{name: None})
        with pytest.raises(ValueError, match=rf"setting {name} no longer exists in this version of hf_zenflow"):
            ZenFlowAdamW([torch.nn.Parameter(torch.zeros(2, 2))], **{name: None})
    with pytest.raises(TypeError, match="steps_per_epoch"):
        ZenFlowConfig(steps_per_epoch=3)
    with pytest.raises(ValueError, match=r"settings device_memory_budget_bytes, host_grad_dtype no longer exist in "
                                         r"this version of hf_zenflow"):
        ZenFlowConfig.from_dict({**ZenFlowConfig().to_dict(), "host_grad_dtype": "auto",
                                 "device_memory_budget_bytes": None})
