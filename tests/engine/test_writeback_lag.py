"""``writeback_lag="auto"``: the rule, the choice from measured times at the second window close, and checkpoints
that keep the choice."""

from __future__ import annotations

import time

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine.schedule import auto_writeback_lag
from tests.conftest import batches, linear_schedule, make_model, param_groups, roundtrip, train


#: (windows of 4 steps at lr 1e-2: `high_lr_rule="auto"` would shorten them to one; its tests: test_high_lr_rule.py)
OFF = {"high_lr_rule": "off"}


@pytest.mark.parametrize(
    ("host_ms", "step_ms", "longest", "expected"),
    [
        (30.0, 2400.0, 4, 1),  # a small model: the host step is done long before the next step ends
        (800.0, 1000.0, 4, 1),  # exactly 80 % of one step still fits
        (801.0, 1000.0, 4, 2),
        (2000.0, 1000.0, 4, 3),  # 2000 / 0.8 = 2500 ms: three steps
        (5000.0, 1000.0, 4, 4),  # longer than the window: the next boundary, as with None
        (5000.0, 1000.0, 16, 7),  # Zen-auto: bounded by auto_max_interval instead
        (10.0, 0.0, 4, 4),  # no step time measured: the next boundary
    ],
)
def test_the_lag_is_the_smallest_whose_device_time_holds_the_host_step(host_ms, step_ms, longest, expected):
    assert auto_writeback_lag(host_ms, step_ms, longest) == expected


def _train(opt: ZenFlowAdamW, model: torch.nn.Module, steps: int, pause_s: float) -> None:
    """`steps` training steps, each with `pause_s` of "device" time between backward and the optimizer step."""
    train(model, opt, batches(steps), linear_schedule(opt, steps), hook=lambda i: time.sleep(pause_s))


@pytest.mark.timing
@pytest.mark.parametrize(("host_delay_s", "expected"), [(0.0, 1), (0.25, 4)])
def test_auto_chooses_from_the_measured_host_step(host_delay_s, expected, monkeypatch):
    """A fast host step is written back one step into the next window; one slower than the window (slowed on purpose
    here) keeps the next boundary. Margins are wide (a 60 ms step; a host step of ~0 ms or > 250 ms)."""
    window = host_module.host_adamw_window

    def slow_window(groups, *last):
        time.sleep(host_delay_s)
        window(groups, *last)

    monkeypatch.setattr("hf_zenflow.engine.window_close.host_adamw_window", slow_window)
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=1e-2, update_interval=4, writeback_lag="auto", min_offload_numel=0,
                       **OFF)
    _train(opt, model, 7, pause_s=0.06)
    assert opt._schedule.writeback_lag_pending  # one window closed: nothing chosen yet, 1 step meanwhile
    assert opt.stats()["writeback_lag"] == 1
    _train(opt, model, 2, pause_s=0.06)  # the second window closes at step 8
    assert (opt._schedule.writeback_lag, opt._schedule.writeback_lag_pending) == (expected, False)
    assert opt.stats()["writeback_lag"] == expected
    opt.close()


def test_a_checkpoint_keeps_the_chosen_lag_and_a_new_setting_replaces_it(monkeypatch):
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_writeback_lag", lambda host_ms, step_ms, longest: 1)
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=1e-2, update_interval=4, writeback_lag="auto", min_offload_numel=0,
                       **OFF)
    train(model, opt, batches(10), linear_schedule(opt, 10))
    state = roundtrip(opt.state_dict())
    opt.close()
    assert (state["zenflow"]["writeback_lag"], state["zenflow"]["writeback_lag_pending"]) == (1, False)
    # the resumed run would choose 3 from its own timing: it keeps the saved choice instead
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_writeback_lag", lambda host_ms, step_ms, longest: 3)
    resumed = ZenFlowAdamW(param_groups(make_model()), lr=1e-2, update_interval=4, writeback_lag="auto",
                           min_offload_numel=0, **OFF)
    resumed.load_state_dict(state)
    assert resumed.stats()["writeback_lag"] == 1
    resumed.close()
    # an explicit setting on resume takes effect
    fixed = ZenFlowAdamW(param_groups(make_model()), lr=1e-2, update_interval=4, writeback_lag=2, min_offload_numel=0,
                         **OFF)
    fixed.load_state_dict(state)
    assert fixed.stats()["writeback_lag"] == 2
    fixed.close()


def test_auto_is_a_setting_everywhere():
    from hf_zenflow import ZenFlowConfig

    assert ZenFlowConfig(writeback_lag=" Auto ").writeback_lag == "auto"
    assert ZenFlowConfig(writeback_lag="2").writeback_lag == 2
    with pytest.raises(ValueError, match=r'writeback_lag=.soon.*"auto"'):
        ZenFlowConfig(writeback_lag="soon")


def test_the_choice_waits_for_two_windows_after_the_warm_up(monkeypatch):
    """Warm-up steps close a synchronous window each: the choice comes two overlapped windows after them."""
    calls: list[int] = []
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_writeback_lag",
                        lambda host_ms, step_ms, longest: calls.append(1) or 2)
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=1e-2, update_interval=4, writeback_lag="auto", full_warm_up_rounds=3,
                       min_offload_numel=0, **OFF)
    train(model, opt, batches(3 + 7), linear_schedule(opt, 20))
    assert calls == [] and opt._schedule.writeback_lag_pending
    train(model, opt, batches(1, seed=2), linear_schedule(opt, 20))  # the second window after the warm-up closes
    assert calls == [1] and opt.stats()["writeback_lag"] == 2
    opt.close()
