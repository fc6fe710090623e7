"""`host_step`: the one setting of the host AdamW step. ``"auto"`` stands for the project's measured rules,
``"zenflow"`` for ZenFlow's and DeepSpeed's schedule; the four rules behind it (`host_lr_scale`, `high_lr_rule`,
`host_step_guard`, `writeback_lag`) are `EngineRules`, no longer settings."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_zenflow import CheckpointError, ZenFlowAdamW, ZenFlowConfig, ZenFlowTrainingArguments
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.settings.rules import HOST_STEP_RULES, EngineRules


#: The rules behind the host step, and their values under each choice.
HOST_STEP_NAMES = ("host_lr_scale", "high_lr_rule", "host_step_guard", "writeback_lag")
AUTO = {"host_lr_scale": "auto", "high_lr_rule": "auto", "host_step_guard": "auto", "writeback_lag": "auto"}
ZENFLOW = {"host_lr_scale": 1.0, "high_lr_rule": "off", "host_step_guard": "off", "writeback_lag": None}


def _rules(config: ZenFlowConfig) -> dict:
    return {name: getattr(config.rules, name) for name in HOST_STEP_NAMES}


def test_each_choice_resolves_to_its_rules():
    assert ZenFlowConfig().host_step == "auto"
    assert _rules(ZenFlowConfig()) == AUTO == _rules(ZenFlowConfig(host_step="auto"))
    assert _rules(ZenFlowConfig(host_step="ZenFlow")) == ZENFLOW
    assert HOST_STEP_RULES == {"auto": AUTO, "zenflow": ZENFLOW}
    # (the other rules stay at their defaults)
    assert ZenFlowConfig(host_step="zenflow").rules.auto_max_interval == EngineRules().auto_max_interval
    with pytest.raises(ValueError, match=r'ZenFlowConfig.host_step=\'deepspeed\' is invalid: allowed is "auto" \| '
                                         r'"zenflow"'):
        ZenFlowConfig(host_step="deepspeed")


def test_a_changed_rule_is_kept_over_the_choice():
    config = ZenFlowConfig(host_step="zenflow").with_rules(writeback_lag=2)
    assert _rules(config) == {**ZENFLOW, "writeback_lag": 2}
    assert _rules(config.replace(topk_ratio=0.2)) == {**ZENFLOW, "writeback_lag": 2}
    assert ZenFlowConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("host_lr_scale", 0.0, 'a float > 0, "interval" or "auto"'),
    ("host_lr_scale", "twice", 'a float > 0, "interval" or "auto"'),
    ("high_lr_rule", "on", '"auto" | "off"'),
    ("host_step_guard", 1.0, 'a float > 1, "auto" or "off"'),
    ("host_step_guard", True, 'a float > 1, "auto" or "off"'),
    ("writeback_lag", 0, 'None (the next window boundary), "auto" or an integer >= 1'),
    ("writeback_lag", 1.5, 'None (the next window boundary), "auto" or an integer >= 1'),
    ("writeback_lag", 5, 'None (the next window boundary), "auto" or an integer from 1 to update_interval (4)'),
])
def test_the_rules_are_checked_as_the_settings_were(name, value, allowed):
    with pytest.raises(ValueError) as info:
        ZenFlowConfig(update_interval=4).with_rules(**{name: value})
    assert str(info.value) == f"EngineRules.{name}={value!r} is invalid: allowed is {allowed}."


def test_the_rules_read_text_as_the_settings_did():
    assert _rules(ZenFlowConfig().with_rules(host_lr_scale="2.5", high_lr_rule="OFF", host_step_guard="3",
                                             writeback_lag="None")) == {
        "host_lr_scale": 2.5, "high_lr_rule": "off", "host_step_guard": 3.0, "writeback_lag": None}
    assert ZenFlowConfig().with_rules(host_lr_scale=" Interval ", writeback_lag="2").rules.host_lr_scale == "interval"
    assert ZenFlowConfig().with_rules(writeback_lag="2").rules.writeback_lag == 2


def _run(config: ZenFlowConfig, lr: float = 1e-4, steps: int = 13) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = ZenFlowAdamW(model.parameters(), lr=lr, config=config, host_executor="inline")
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 24, generator=data)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.flush()
    opt.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_zenflow_is_the_run_with_its_four_rules_and_not_the_auto_run():
    """lr 1e-4 x U=4 under 5e-4: "auto" takes the window's multiplier (x4) and writes back one step late, "zenflow"
    x1 at the window boundary."""
    base = ZenFlowConfig(topk_ratio=0.25, update_interval=4, min_offload_numel=0, cpu_threads=1)
    zenflow = _run(base.replace(host_step="zenflow"))
    ruled = _run(base.with_rules(**ZENFLOW))
    auto = _run(base)
    for name, value in zenflow.items():
        assert torch.equal(value, ruled[name]), name
    assert max((zenflow[k] - auto[k]).abs().max().item() for k in auto) > 1e-5


@pytest.mark.parametrize("name", HOST_STEP_NAMES)
def test_a_host_step_rule_is_no_keyword(name):
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=rf"engine rule\(s\) \['{name}'\], which are not settings: .*"
                                         rf"with_rules\({name}=\.\.\.\)"):
        ZenFlowAdamW([w], **{name: AUTO[name]})
    with pytest.raises(TypeError):
        ZenFlowConfig(**{name: AUTO[name]})
    with pytest.raises(ValueError, match=f"the setting {name} no longer exists in this version"):
        ZenFlowConfig.from_dict({**ZenFlowConfig().to_dict(), name: AUTO[name]})
    with pytest.raises(TypeError):
        ZenFlowTrainingArguments(output_dir="unused", use_cpu=True, report_to="none", **{f"zenflow_{name}": "1"})


@pytest.mark.parametrize("name", HOST_STEP_NAMES)
def test_a_checkpoint_naming_a_host_step_setting_is_refused(name):
    lin = torch.nn.Linear(16, 8, bias=False)
    config = ZenFlowConfig(update_interval=2, min_offload_numel=0, cpu_threads=1)
    opt = ZenFlowAdamW([lin.weight], lr=1e-3, config=config, host_executor="inline")
    for _ in range(3):
        lin.weight.grad = torch.randn_like(lin.weight)
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    state["zenflow"]["config"][name] = AUTO[name]
    with pytest.raises(CheckpointError, match=f"its setting {name} no longer exists in this version"):
        opt.load_state_dict(seal(state))
    opt.close()


def test_from_deepspeed_takes_zenflows_host_step():
    config = ZenFlowConfig.from_deepspeed({"zero_optimization": {"zenflow": {"topk_ratio": 0.05,
                                                                             "overlap_step": True}}})
    assert config.host_step == "zenflow" and _rules(config) == ZENFLOW
    args = ZenFlowTrainingArguments.from_deepspeed({"update_interval": 4}, output_dir="unused",
                                                   use_cpu=True, report_to="none")
    assert args.zenflow_host_step == "zenflow" and _rules(args.zenflow_config()) == ZENFLOW
