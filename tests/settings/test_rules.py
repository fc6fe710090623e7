"""`EngineRules`: the rules behind the settings' choices, reachable by tests and studies through
`ZenFlowConfig.with_rules`, never as settings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig
from hf_zenflow.settings.rules import AUTO_MAX_INTERVAL, EngineRules


def test_the_defaults_are_the_measured_constants():
    assert ZenFlowConfig().rules == EngineRules() and EngineRules().auto_max_interval == AUTO_MAX_INTERVAL
    assert not set(EngineRules.names()) & {f.name for f in dataclasses.fields(ZenFlowConfig)}


def test_a_changed_rule_is_checked_like_a_setting():
    assert ZenFlowConfig().with_rules(auto_max_interval=3).rules.auto_max_interval == 3
    with pytest.raises(ValueError, match=r"EngineRules.auto_max_interval=0 is invalid: allowed is an integer >= 1"):
        ZenFlowConfig().with_rules(auto_max_interval=0)
    with pytest.raises(ValueError, match=r"unknown rule\(s\) \['window'\]: allowed are \[.*'auto_max_interval'"):
        ZenFlowConfig().with_rules(window=3)


def test_changed_rules_survive_replace_and_the_round_trip_through_a_dict():
    config = ZenFlowConfig(update_interval="auto").with_rules(auto_max_interval=5)
    replaced = config.replace(topk_ratio=0.2)
    assert (replaced.topk_ratio, replaced.rules.auto_max_interval) == (0.2, 5)
    assert config.to_dict()["rules"] == {"auto_max_interval": 5} and "rules" not in ZenFlowConfig().to_dict()
    assert ZenFlowConfig.from_dict(config.to_dict()) == config
    assert config != ZenFlowConfig(update_interval="auto")  # the rule is part of what the config says


def test_a_rule_is_no_keyword_of_the_optimizer():
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"engine rule\(s\) \['auto_max_interval'\], which are not settings: .*"
                                         r"with_rules\(auto_max_interval=\.\.\.\)"):
        ZenFlowAdamW([w], auto_max_interval=4)
    with pytest.raises(TypeError):
        ZenFlowConfig(auto_max_interval=4)


def test_the_optimizer_runs_under_a_changed_rule_and_its_checkpoint_keeps_it():
    lin = torch.nn.Linear(32, 8, bias=False)
    config = ZenFlowConfig(update_interval="auto", auto_ratio=1.0, min_offload_numel=0).with_rules(auto_max_interval=2)
    opt = ZenFlowAdamW([lin.weight], lr=1e-2, config=config, host_executor="inline")
    for _ in range(6):  # no matrix ever votes to close (the host mass stays small): every window runs to the bound
        lin.weight.grad = torch.zeros_like(lin.weight)
        lin.weight.grad[:, :4] = 1.0
        opt.step()
    assert opt.stats()["windows"] == 3  # (16 steps, the rule's default, would have closed none)
    saved = opt.state_dict()
    assert saved["zenflow"]["config"]["rules"] == {"auto_max_interval": 2}
    opt.close()
