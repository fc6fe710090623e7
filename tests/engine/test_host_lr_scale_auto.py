"""`host_lr_scale="auto"`: the rule's resolution (table-driven), and a run under "auto" is bit for bit the run with the
multiplier it picked given explicitly, reports it in `stats()`, logs it once, and resumes exactly. With the configured
windows (`high_lr_rule="off"`): the rule that shortens them at high rates is tests/engine/test_high_lr_rule.py's."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_zenflow.engine.host_lr import auto_host_lr_scale, host_lr_scale, window_lag
from hf_zenflow.engine.schedule import WindowSchedule
from tests.conftest import batches, linear_schedule, make_model, param_groups, roundtrip, train, zenflow_adamw


#: (peak lr, window steps, write-back lag, multiplier): "interval" while lr x multiplier <= 5e-4 / sqrt(lag), the cap's
#: multiplier above it, never below 1 nor above the window
RULE = [
    (5e-5, 4, 1, 4.0),
    (1e-4, 4, 1, 4.0),
    (1.25e-4, 4, 1, 4.0),
    (2.5e-4, 4, 1, 2.0),
    (3e-4, 4, 1, 5 / 3),
    (5e-4, 4, 1, 1.0),
    (1e-3, 4, 1, 1.0),  # the un-normalised model that diverged under "interval" (x4)
    (3e-3, 4, 1, 1.0),
    (2e-2, 4, 1, 1.0),
    (5e-5, 4, 2, 4.0),
    (1e-4, 4, 2, 5 / 2**0.5),
    (5e-5, 4, 4, 4.0),
    (1e-4, 4, 4, 2.5),
    (2e-4, 4, 4, 1.25),
    (3e-4, 4, 4, 1.0),
    (1e-4, 4, 9, 5 / 3),
    (1e-4, 8, 1, 5.0),
    (1e-5, 16, 1, 16.0),
    (1e-3, 1, 1, 1.0),
    (0.0, 4, 1, 1.0),
]


@pytest.mark.parametrize("lr, window, lag, expected", RULE)
def test_the_rule(lr, window, lag, expected):
    # (approx: the decimal learning rates are not exact in binary; the ratio may round in the last bit)
    assert auto_host_lr_scale(lr, window, lag) == pytest.approx(expected, rel=1e-15, abs=0)
    assert host_lr_scale("auto", window, lr, lag) == auto_host_lr_scale(lr, window, lag)


def test_other_settings_ignore_lr_and_lag():
    assert host_lr_scale("interval", 4, 3e-3, 4) == 4.0
    assert host_lr_scale(1.5, 4, 3e-3, 4) == 1.5


def _schedule(lag, pending=False):
    return WindowSchedule(warm_up=0, update_interval=4, auto_ratio=0.99, auto_max_interval=16, select_period=10,
                          writeback_lag=lag, writeback_lag_pending=pending)


@pytest.mark.parametrize("schedule, overlap, window, expected", [
    (_schedule(2), True, 4, 2),
    (_schedule(None), True, 4, 4),  # ZenFlow's schedule: the next boundary, a whole window
    (_schedule(None), True, 2, 4),  # a window flush() closes early keeps the run's lag
    (_schedule(1, pending=True), True, 4, 1),  # writeback_lag="auto" before its choice
    (_schedule(None), False, 4, 1),  # not overlapped: written back at once
])
def test_the_lag_the_rule_counts(schedule, overlap, window, expected):
    assert window_lag(schedule, overlap, window) == expected


TOTAL = 16  # four full windows of 4: "auto" and its value agree on every window (see test_a_partial_window...)


def _run(host_lr_scale, lr, writeback_lag, steps=TOTAL, checkpoint_at=None):
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=lr, topk_ratio=0.25, update_interval=4, select_strategy="step",
                        select_interval=8, min_offload_numel=0, host_lr_scale=host_lr_scale,
                        writeback_lag=writeback_lag, high_lr_rule="off")
    sched = linear_schedule(opt, TOTAL)
    train(model, opt, batches(TOTAL)[:steps], sched, clip=1.0)
    saved = None
    if checkpoint_at is not None:
        saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    opt.flush()
    scale = opt.stats()["host_lr_scale"]
    opt.close()
    return model, scale, saved


@pytest.mark.parametrize("lr, writeback_lag, expected", [(3e-4, 1, 5 / 3), (1e-4, None, 2.5), (1e-5, 2, 4.0)])
def test_auto_is_bitwise_the_multiplier_it_picks(lr, writeback_lag, expected, caplog):
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        auto, scale, _ = _run("auto", lr, writeback_lag)
    # judged by the scheduler's peak lr, not the decayed one (approx: see test_the_rule)
    assert scale == pytest.approx(expected, rel=1e-15, abs=0)
    expected = scale  # the explicit run takes the very float "auto" picked
    chose = [r for r in caplog.records if 'host_lr_scale="auto" chose' in r.getMessage()]
    assert len(chose) == 1, "the choice is logged once"
    explicit, explicit_scale, _ = _run(expected, lr, writeback_lag)
    assert explicit_scale == expected
    for p, q in zip(auto.parameters(), explicit.parameters()):
        assert torch.equal(p, q)
    if expected != 1.0:  # and the choice mattered: 1.0 gives other weights
        plain, _, _ = _run(1.0, lr, writeback_lag)
        assert any(not torch.equal(p, q) for p, q in zip(auto.parameters(), plain.parameters()))


def test_stats_say_the_multiplier_before_the_first_window():
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=2e-4, update_interval=4, host_lr_scale="auto", writeback_lag=1,
                        min_offload_numel=0, high_lr_rule="off")
    linear_schedule(opt, 10)
    assert opt.stats()["host_lr_scale"] == 2.5
    opt.close()


def test_auto_resumes_exactly_mid_window():
    uninterrupted, _, _ = _run("auto", 3e-4, 1)
    _, _, saved = _run("auto", 3e-4, 1, steps=6, checkpoint_at=6)
    model = make_model(seed=123)
    model.load_state_dict(saved["model"])
    opt = zenflow_adamw(param_groups(model), lr=3e-4, topk_ratio=0.25, update_interval=4, select_strategy="step",
                        select_interval=8, min_offload_numel=0, host_lr_scale="auto", writeback_lag=1,
                        high_lr_rule="off")
    sched = linear_schedule(opt, TOTAL)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    train(model, opt, batches(TOTAL)[6:], sched, clip=1.0)
    opt.flush()
    assert opt.stats()["host_lr_scale"] == pytest.approx(5 / 3, rel=1e-15, abs=0)
    opt.close()
    for p, q in zip(model.parameters(), uninterrupted.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("writeback_lag", [1, None])
def test_a_checkpoint_mid_window_converts_to_adamw_as_its_multiplier_does(writeback_lag):
    """`to_torch_adamw` applies the open window as `flush()` would: with the multiplier "auto" picked for this run
    (the saved schedule's lag and the scheduler's peak lr), not "interval"'s. The open window is 2 steps long and
    both multipliers are below 2 (a shorter window than the multiplier would take at most its length, as with
    "interval")."""
    from hf_zenflow import to_torch_adamw

    lr = 3e-4 if writeback_lag == 1 else 2e-4  # 5/3 and 1.25
    _, scale, saved = _run("auto", lr, writeback_lag, steps=6, checkpoint_at=6)
    _, _, explicit = _run(scale, lr, writeback_lag, steps=6, checkpoint_at=6)
    _, _, interval = _run("interval", lr, writeback_lag, steps=6, checkpoint_at=6)
    def converted(checkpoint: dict) -> dict:
        model = make_model()
        model.load_state_dict(checkpoint["model"])  # (the weights hold the masters the state leaves to them)
        return to_torch_adamw(checkpoint["opt"], weights=[p for g in param_groups(model) for p in g["params"]])[1]

    masters = converted(saved)
    explicit_masters = converted(explicit)
    assert masters.keys() == explicit_masters.keys()
    assert all(torch.equal(masters[i], explicit_masters[i]) for i in masters)
    interval_masters = converted(interval)
    assert any(not torch.equal(masters[i], interval_masters[i]) for i in masters)


def test_a_partial_window_takes_at_most_its_length_and_stats_keep_the_full_windows_multiplier(caplog):
    """A window `flush()` closes after 2 of 4 steps: "auto" multiplies by at most 2 there, as "interval" does (so
    it equals "interval", not its full-window value 4); `stats()` and the log still say the run's multiplier, 4."""
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        auto, scale, _ = _run("auto", 1e-4, 1, steps=14)
    assert scale == 4.0
    assert [r.getMessage() for r in caplog.records if "chose" in r.getMessage() and "host_lr_scale" in
            r.getMessage()] == ['hf_zenflow: host_lr_scale="auto" chose 4 (peak lr 0.0001, write-back lag 1)']
    interval, _, _ = _run("interval", 1e-4, 1, steps=14)
    four, _, _ = _run(4.0, 1e-4, 1, steps=14)
    assert all(torch.equal(p, q) for p, q in zip(auto.parameters(), interval.parameters()))
    assert any(not torch.equal(p, q) for p, q in zip(auto.parameters(), four.parameters()))
