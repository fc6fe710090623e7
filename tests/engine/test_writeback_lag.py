"""``writeback_lag="auto"``: the choice from the host columns' sizes at the first step (the same weights whatever
the machine's timing), the advice from measured times, and checkpoints that keep the choice."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import hf_zenflow.engine.host as host_module
from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine.schedule import auto_writeback_lag
from hf_zenflow.engine.writeback_lag import AUTO_LAG_HOST_ELEMENTS, auto_lag_from_sizes
from tests.conftest import (
    batches,
    linear_schedule,
    make_model,
    param_groups,
    roundtrip,
    train,
    zenflow_adamw,
    zenflow_config,
)


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


@pytest.mark.parametrize(("elements", "longest", "expected"), [
    (0, 4, 1), (1, 4, 1), (AUTO_LAG_HOST_ELEMENTS, 4, 1), (AUTO_LAG_HOST_ELEMENTS + 1, 4, 2),
    (int(0.9 * 7e9), 4, 3), (int(0.9 * 70e9), 4, 4), (int(0.9 * 70e9), 1, 1), (int(0.9 * 70e9), 16, 16),
])
def test_auto_decides_from_the_host_columns_sizes(elements, longest, expected):
    assert auto_lag_from_sizes(elements, longest) == expected


def _slowed_run(host_delay_s: float, pause_s: float, monkeypatch) -> tuple[list[torch.Tensor], ZenFlowAdamW]:
    window = host_module.host_adamw_window

    def slow_window(groups, *last):
        time.sleep(host_delay_s)
        window(groups, *last)

    monkeypatch.setattr("hf_zenflow.engine.windows.host_adamw_window", slow_window)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, update_interval=4, min_offload_numel=0, **OFF)
    _train(opt, model, 10, pause_s=pause_s)
    opt.flush()
    opt.close()
    return [p.detach().clone() for p in model.parameters()], opt


def test_auto_gives_the_same_weights_whatever_the_host_step_takes(monkeypatch, caplog):
    """Repro: ``writeback_lag="auto"`` (the default) chose from the first host step's measured time: a host step
    slower than the window (here slowed on purpose by 0.25 s, as a cold first step or a busy machine makes it) gave
    lag 4, a fast one lag 1, and the same script and seed trained different weights. Now the lag comes from the
    host columns' sizes (1 step for this model) and the measured times only advise, in the log."""
    fast, fast_opt = _slowed_run(0.0, 0.0, monkeypatch)
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        slow, slow_opt = _slowed_run(0.25, 0.02, monkeypatch)
    assert fast_opt.stats()["writeback_lag"] == slow_opt.stats()["writeback_lag"] == 1
    for p, q in zip(fast, slow):
        assert torch.equal(p, q)
    messages = [r.getMessage() for r in caplog.records]
    assert any('writeback_lag="auto" chose 1 step(s) of 4' in m for m in messages), messages
    # the measured times (a 250 ms host step, 20 ms steps) would allow a longer lag: said, not done
    assert any("would allow writeback_lag=4" in m for m in messages), messages


def test_a_checkpoint_keeps_the_chosen_lag_and_a_new_setting_replaces_it(monkeypatch):
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_lag_from_sizes", lambda elements, longest: 1)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, update_interval=4, writeback_lag="auto", min_offload_numel=0,
                        **OFF)
    train(model, opt, batches(10), linear_schedule(opt, 10))
    state = roundtrip(opt.state_dict())
    opt.close()
    assert (state["zenflow"]["writeback_lag"], state["zenflow"]["writeback_lag_pending"]) == (1, False)
    # the resumed run would choose 3 from its own sizes: it keeps the saved choice instead
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_lag_from_sizes", lambda elements, longest: 3)
    resumed = zenflow_adamw(param_groups(make_model()), lr=1e-2, update_interval=4, writeback_lag="auto",
                            min_offload_numel=0, **OFF)
    resumed.load_state_dict(state)
    assert resumed.stats()["writeback_lag"] == 1
    resumed.close()
    # an explicit setting on resume takes effect
    fixed = zenflow_adamw(param_groups(make_model()), lr=1e-2, update_interval=4, writeback_lag=2, min_offload_numel=0,
                          **OFF)
    fixed.load_state_dict(state)
    assert fixed.stats()["writeback_lag"] == 2
    fixed.close()


def test_the_rule_reads_auto_and_numbers_as_text():
    assert zenflow_config(writeback_lag=" Auto ").rules.writeback_lag == "auto"
    assert zenflow_config(writeback_lag="2").rules.writeback_lag == 2
    with pytest.raises(ValueError, match=r'writeback_lag=.soon.*"auto"'):
        zenflow_config(writeback_lag="soon")


def test_the_choice_is_made_at_the_first_step_and_the_advice_two_windows_after_the_warm_up(monkeypatch, caplog):
    """The lag is chosen before the first window closes (warm-up steps included); the measured times advise two
    overlapped windows after the warm-up (warm-up windows are synchronous: their times say nothing)."""
    calls: list[int] = []
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_lag_from_sizes",
                        lambda elements, longest: calls.append(elements) or 2)
    monkeypatch.setattr("hf_zenflow.engine.writeback_lag.auto_writeback_lag",
                        lambda host_ms, step_ms, longest: calls.append(-1) or 3)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-2, update_interval=4, writeback_lag="auto", full_warm_up_rounds=3,
                        min_offload_numel=0, **OFF)
    train(model, opt, batches(1), linear_schedule(opt, 20))
    host_elements = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    assert calls == [host_elements] and opt.stats()["writeback_lag"] == 2
    train(model, opt, batches(2 + 7), linear_schedule(opt, 20))
    assert calls == [host_elements]
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        train(model, opt, batches(1, seed=2), linear_schedule(opt, 20))  # the second window after the warm-up closes
    assert calls == [host_elements, -1] and opt.stats()["writeback_lag"] == 2
    assert "would allow writeback_lag=3" in caplog.text
    opt.close()
