"""`host_state`: one public choice among the host-memory rules (`EngineRules`), whose names are no longer settings.

References: each preset's rules as docs/host-memory.md states them; a run under a preset is the run with those rules
set one by one through `with_rules` (the same weights bit for bit); the host bytes each preset holds, measured from
the host tensors (`stats()["host_bytes_per_param"]`), ordered as the presets promise.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow import CheckpointError, ZenFlowAdamW, ZenFlowConfig
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.engine.host import HostLayout
from hf_zenflow.estimate.fits import FIT_SCHEDULES
from hf_zenflow.estimate.memory import HOST_STATE_RULES
from hf_zenflow.settings.config import REMOVED_SETTINGS
from hf_zenflow.transport import CopyTransport
from tests.conftest import DEVICE, batches, make_model, param_groups, roundtrip, train, zenflow_adamw, zenflow_config


#: The six former settings, now the rules `host_state` stands for.
HOST_STATE_NAMES = ("accumulate_on", "host_moment_dtype", "host_sum_dtype", "host_sum_columns", "host_writeback",
                    "free_gradients_in_backward")
#: The rules each preset stands for (docs/host-memory.md).
PRESETS = {
    "auto": dict(accumulate_on="auto", host_moment_dtype="bfloat16", host_sum_dtype="bfloat16",
                 host_sum_columns="unselected", host_writeback="auto", free_gradients_in_backward="auto"),
    "fp32": dict(accumulate_on="auto", host_moment_dtype="float32", host_sum_dtype="float32", host_sum_columns="all",
                 host_writeback="auto", free_gradients_in_backward="auto"),
    "lean": dict(accumulate_on="auto", host_moment_dtype="int8", host_sum_dtype="bfloat16",
                 host_sum_columns="unselected", host_writeback="master", free_gradients_in_backward="auto"),
}
SPLIT = dict(topk_ratio=0.25, update_interval=3, overlap_step=True, writeback_lag=1, select_strategy="step",
             select_interval=4, min_offload_numel=0, cpu_threads=1, high_lr_rule="off")


@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_resolves_to_its_rules(preset):
    rules = ZenFlowConfig(host_state=preset).rules
    assert {name: getattr(rules, name) for name in HOST_STATE_NAMES} == PRESETS[preset]
    assert ZenFlowConfig(host_state=preset.upper()).host_state == preset  # (a choice, in any case)
    # the estimate's row of the preset holds the same rules (one function resolves the preset for both)
    row = FIT_SCHEDULES["zenflow" if preset == "auto" else f"zenflow_{preset}"][1]
    assert row == {name: PRESETS[preset][name] for name in HOST_STATE_RULES}


def test_the_default_is_auto_and_a_changed_rule_wins_over_the_preset():
    assert ZenFlowConfig().host_state == "auto" and ZenFlowConfig().rules == ZenFlowConfig(host_state="auto").rules
    config = ZenFlowConfig(host_state="lean").with_rules(host_moment_dtype="bfloat16")
    assert (config.rules.host_moment_dtype, config.rules.host_sum_dtype) == ("bfloat16", "bfloat16")
    assert config.replace(host_state="fp32").rules.host_moment_dtype == "bfloat16"  # (kept by replace)
    with pytest.raises(ValueError, match=r"ZenFlowConfig.host_state='small' is invalid: allowed is "
                                         r"\"auto\" \| \"fp32\" \| \"lean\""):
        ZenFlowConfig(host_state="small")


def test_the_rules_are_checked_with_their_own_names():
    with pytest.raises(ValueError, match=r"EngineRules.host_moment_dtype='float16' is invalid: allowed is "
                                         r"\"float32\" \| \"bfloat16\" \| \"int8\""):
        ZenFlowConfig().with_rules(host_moment_dtype="float16")
    with pytest.raises(ValueError, match=r"EngineRules.free_gradients_in_backward=True is invalid"):
        ZenFlowConfig().with_rules(free_gradients_in_backward=True)
    # a preset's dtype of host sums gives way to sums on the device (its columns stay: the accumulator a device sum
    # lands in keeps them); both dtypes set at once contradict each other
    for preset in ("auto", "lean"):
        rules = ZenFlowConfig(host_state=preset).with_rules(accumulate_on="Device").rules
        assert (rules.accumulate_on, rules.host_sum_dtype, rules.host_sum_columns) == ("device", "float32",
                                                                                      "unselected")
    with pytest.raises(ValueError, match=r"EngineRules.host_sum_dtype='bfloat16' is invalid with "
                                         r"accumulate_on='device'"):
        ZenFlowConfig().with_rules(accumulate_on="device", host_sum_dtype="bfloat16")
    assert ZenFlowConfig().with_rules(host_sum_columns="Unselected").rules.host_sum_columns == "unselected"


def _run(config: ZenFlowConfig, steps: int = 10) -> tuple[torch.nn.Module, ZenFlowAdamW, dict]:
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=1e-2, config=zenflow_config(config, **SPLIT))
    train(model, opt, batches(steps))
    opt.flush()
    stats = opt.stats()
    opt.close()
    return model, opt, stats


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the host bytes of a CPU device (one process, no pinned buffers)")
def test_a_preset_is_its_rules_and_the_lean_state_is_the_smallest():
    lean, opt, lean_stats = _run(ZenFlowConfig(host_state="lean"))
    assert all(s.host.writes_back_master for s in opt.engine_state.splits.values() if s.host is not None)
    ruled, _, ruled_stats = _run(ZenFlowConfig().with_rules(**PRESETS["lean"]))
    assert all(torch.equal(p, q) for p, q in zip(lean.parameters(), ruled.parameters()))
    assert lean_stats["host_bytes_per_param"] == ruled_stats["host_bytes_per_param"]
    _, _, auto_stats = _run(ZenFlowConfig())
    _, _, fp32_stats = _run(ZenFlowConfig(host_state="fp32"))
    assert (lean_stats["host_bytes_per_param"] < auto_stats["host_bytes_per_param"]
            < fp32_stats["host_bytes_per_param"])


def test_the_lean_preset_keeps_the_buffer_where_the_master_cannot_be_read_without_a_warning(caplog):
    layout = HostLayout.of(ZenFlowConfig(host_state="lean"))
    assert layout.writeback_from_master
    host_module._warned_writeback = False
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        assert layout.on_link(CopyTransport(), 2).writeback_from_master is False  # (ranks sharing the host state)
    said = [r for r in caplog.records if "host_writeback" in r.message]
    assert [r.levelno for r in said] == [logging.INFO]
    pinned = CopyTransport()
    pinned.pins_host_memory = True  # (asynchronous copies: through the pinned ring)
    assert layout.on_link(CopyTransport(), 1) == layout == layout.on_link(pinned, 1)


@pytest.mark.parametrize("name", HOST_STATE_NAMES)
def test_the_rules_are_no_keywords(name):
    w = torch.nn.Parameter(torch.randn(4, 4))
    value = PRESETS["auto"][name]
    with pytest.raises(ValueError, match=rf"engine rule\(s\) \['{name}'\], which are not settings: .*"
                                         rf"with_rules\({name}=\.\.\.\)"):
        ZenFlowAdamW([w], **{name: value})
    with pytest.raises(TypeError):
        ZenFlowConfig(**{name: value})


def test_a_checkpoint_whose_settings_name_them_is_refused_naming_them():
    assert set(HOST_STATE_NAMES) <= set(REMOVED_SETTINGS)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, **SPLIT)
    train(model, opt, batches(2))
    saved = roundtrip(opt.state_dict())
    old = dict(saved["zenflow"]["config"])
    del old["host_state"]
    old.update(accumulate_on="host", host_moment_dtype="float32")  # (as an earlier version wrote them)
    with pytest.raises(ValueError, match=r"the settings accumulate_on, host_moment_dtype no longer exist in this "
                                         r"version"):
        ZenFlowConfig.from_dict(old)
    saved["zenflow"]["config"] = old
    saved = seal(saved)  # (a checkpoint written so, whole)
    with pytest.raises(CheckpointError, match=r"its settings accumulate_on, host_moment_dtype no longer exist in "
                                              r"this version"):
        opt.load_state_dict(saved)
    opt.close()


def test_the_preset_is_kept_by_a_checkpoint():
    config = ZenFlowConfig(host_state="lean")
    assert config.to_dict()["host_state"] == "lean" and "rules" not in config.to_dict()
    assert ZenFlowConfig.from_dict(config.to_dict()).rules == config.rules
    assert dataclasses.asdict(config.rules) != dataclasses.asdict(ZenFlowConfig().rules)


class _Stack(torch.nn.Module):
    """Twelve 2048 x 2048 linear layers: 50.4 M parameters, every matrix above the default `min_offload_numel`."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False, dtype=dtype) for _ in range(12)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the host bytes of a CPU device (one process, no pinned buffers)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_host_state_holds_at_most_10_bytes_and_the_lean_one_8_on_a_50m_model(dtype):
    """The defaults of a plain optimizer on a CPU device (nothing set but the learning rate) and `host_state="lean"`,
    measured from the host tensors of a 50 M-parameter model after two windows."""
    measured = {}
    for preset in ("auto", "lean"):
        model = _Stack(dtype)
        assert sum(p.numel() for p in model.parameters()) >= 50_000_000
        opt = ZenFlowAdamW(model.parameters(), lr=1e-4, host_state=preset, cpu_threads=1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(8):
            x = torch.randn(8, 2048, generator=gen, dtype=dtype)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        stats = opt.stats()
        opt.close()
        assert stats["windows"] >= 1 and stats["host_state_bytes"] > 0.8 * 50e6 * 7
        measured[preset] = stats["host_bytes_per_param"]
    assert measured["auto"] <= 10.0
    assert measured["lean"] <= 8.0
