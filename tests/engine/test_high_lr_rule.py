"""`high_lr_rule="auto"`: above peak lr x update_interval > 5e-3 the windows are shortened to floor(5e-3 / lr) steps
and the host AdamW's beta1 is lowered (`host_lr.high_lr_window`, `host_lr.high_lr_beta1`). At or below the threshold
a run is bit for bit the run with `high_lr_rule="off"`; above it, bit for bit the run with those windows and that
host beta1 given explicitly; the choice is logged once, in `stats()`, and restored from a checkpoint (mid-window
resume is exact)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_zenflow import CheckpointError
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.engine.host_lr import high_lr_beta1, high_lr_window
from tests.conftest import batches, linear_schedule, make_model, param_groups, roundtrip, train, zenflow_adamw


@pytest.mark.parametrize("lr, interval, expected", [
    (5e-5, 4, None), (1e-3, 4, None), (1.25e-3, 4, None),  # lr x U <= 5e-3: the configured windows
    (1.3e-3, 4, 3), (2e-3, 4, 2), (2.5e-3, 4, 2), (3e-3, 4, 1), (1e-2, 4, 1),
    (6e-4, 8, None), (7e-4, 8, 7), (1e-3, 8, 5), (2e-3, 8, 2), (3e-3, 8, 1),
    (3e-3, None, None), (3e-3, 1, None), (0.0, 4, None),  # Zen-auto windows, one-step windows, no lr
])
def test_the_window_rule(lr, interval, expected):
    assert high_lr_window(lr, interval) == expected


@pytest.mark.parametrize("beta1, window, lag, expected", [
    (0.9, 1, 1, 0.4),  # AdamW's horizon, less the momentum of a one-step-stale update (d = 1: 1/2)
    (0.9, 2, 1, 0.8 - 1 / 3),
    (0.9, 2, 2, 0.3),
    (0.9, 3, 1, 0.7 - 0.25),
    (0.9, 1, 0, 0.9),  # not overlapped, one-step windows: AdamW's own beta1
    (0.9, 2, 0, 0.8),
    (0.95, 2, 1, 0.9 - 1 / 3),
    (0.5, 3, 1, 0.0),  # never negative
])
def test_the_beta1_rule(beta1, window, lag, expected):
    assert high_lr_beta1(beta1, window, lag) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def _matrices_only(seed: int = 0) -> torch.nn.Module:
    """Every parameter a matrix, so that with topk_ratio=0 each is updated by the host AdamW alone (the group's
    betas then reach nothing but the host step)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(24, 40), torch.nn.Linear(40, 80, bias=False), torch.nn.GELU(),
                               torch.nn.Linear(80, 24, bias=False))


def _run(model, lr, steps=16, betas=(0.9, 0.999), **settings):
    settings = {"topk_ratio": 0.25, "update_interval": 4, "select_strategy": "step", "select_interval": 8,
                "min_offload_numel": 0, "writeback_lag": 1, **settings}
    opt = zenflow_adamw(model.parameters() if settings["topk_ratio"] == 0.0 else param_groups(model), lr=lr,
                        betas=betas, **settings)
    train(model, opt, batches(16)[:steps], linear_schedule(opt, 16), clip=1.0)
    opt.flush()
    stats = opt.stats()
    opt.close()
    return model, stats


@pytest.mark.parametrize("lr, writeback_lag", [(1e-3, 1), (1.25e-3, 1), (1.25e-3, None), (3e-4, "auto")])
def test_at_or_below_the_threshold_nothing_changes(lr, writeback_lag):
    auto, stats = _run(make_model(), lr, writeback_lag=writeback_lag)
    off, _ = _run(make_model(), lr, writeback_lag=writeback_lag, high_lr_rule="off")
    assert stats["high_lr_window"] == 0 and stats["update_interval"] == 4 and stats["host_beta1"] == 0.9
    assert all(torch.equal(p, q) for p, q in zip(auto.parameters(), off.parameters()))


@pytest.mark.parametrize("lr, overlap_step, window, lag", [(2e-3, True, 2, 1), (3e-3, True, 1, 1),
                                                           (2e-3, False, 2, 0)])
def test_above_it_the_host_takes_the_rules_windows_and_beta1(lr, overlap_step, window, lag):
    """Every column on the host (topk_ratio=0): the run under the rule is bit for bit the run with its window
    length, write-back lag and host beta1 given explicitly (and not the configured windows' run)."""
    settings = dict(topk_ratio=0.0, overlap_step=overlap_step)
    auto, stats = _run(_matrices_only(), lr, **settings)
    beta1 = high_lr_beta1(0.9, window, lag)
    assert stats["high_lr_window"] == window and stats["update_interval"] == window
    assert stats["host_beta1"] == beta1
    explicit, _ = _run(_matrices_only(), lr, betas=(beta1, 0.999), update_interval=window, high_lr_rule="off",
                       **settings)
    assert all(torch.equal(p, q) for p, q in zip(auto.parameters(), explicit.parameters()))
    configured, _ = _run(_matrices_only(), lr, high_lr_rule="off", **settings)
    assert any(not torch.equal(p, q) for p, q in zip(auto.parameters(), configured.parameters()))


def test_the_choice_is_logged_once_and_stats_say_it_before_the_first_step(caplog):
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=2e-3, topk_ratio=0.25, update_interval=4, min_offload_numel=0,
                        writeback_lag=1)
    linear_schedule(opt, 16)
    before = opt.stats()
    # (the host step's multiplier is host_lr_scale="auto"'s at 2e-3: 1.0, the cap 5e-4 being below the lr)
    assert before["high_lr_window"] == 2 and before["update_interval"] == 2 and before["host_lr_scale"] == 1.0
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        train(model, opt, batches(12), None, clip=1.0)
    opt.close()
    chose = [r.getMessage() for r in caplog.records if 'high_lr_rule="auto"' in r.getMessage()]
    assert len(chose) == 1 and "windows of 2 step(s), host beta1 0.4667" in chose[0], chose
    assert opt.stats()["windows"] == 6


SPLIT_AT = 5  # inside the third window of 2 steps


def _resumable(**settings):
    return {"lr": 2e-3, "topk_ratio": 0.25, "update_interval": 4, "select_strategy": "step", "select_interval": 8,
            "min_offload_numel": 0, "writeback_lag": 1, **settings}


def _checkpoint(steps=SPLIT_AT):
    model = make_model()
    opt = zenflow_adamw(param_groups(model), **_resumable())
    sched = linear_schedule(opt, 16)
    train(model, opt, batches(16)[:steps], sched, clip=1.0)
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    opt.close()
    return saved


def _resume(saved, **settings):
    model = make_model(seed=123)
    model.load_state_dict(saved["model"])
    opt = zenflow_adamw(param_groups(model), **_resumable(**settings))
    sched = linear_schedule(opt, 16)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    return model, opt, sched


def test_a_run_under_the_rule_resumes_exactly_mid_window():
    uninterrupted, stats = _run(make_model(), 2e-3)
    assert stats["high_lr_window"] == 2
    saved = _checkpoint()
    assert saved["opt"]["zenflow"]["high_lr_window"] == 2 and saved["opt"]["zenflow"]["window_steps"] == 1
    model, opt, sched = _resume(saved)
    train(model, opt, batches(16)[SPLIT_AT:], sched, clip=1.0)
    opt.flush()
    assert opt.stats()["high_lr_window"] == 2
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted.parameters()))


@pytest.mark.parametrize("saved_window, settings, expected", [
    (3, {}, 3),  # the checkpoint's choice, not the rule's for this lr (2)
    ("missing", {}, 0),  # a checkpoint from before the rule: as it ran, the configured windows
    (2, {"high_lr_rule": "off"}, 0),  # a new setting takes effect
])
def test_the_choice_comes_from_the_checkpoint(saved_window, settings, expected):
    saved = _checkpoint(steps=4)  # (at a window boundary: any window length fits)
    if saved_window == "missing":
        del saved["opt"]["zenflow"]["high_lr_window"]
    else:
        saved["opt"]["zenflow"]["high_lr_window"] = saved_window
    seal(saved["opt"])  # (the checksums follow the edit, as a saved state of that choice would have them)
    _, opt, _ = _resume(saved, **settings)
    stats, interval = opt.stats(), opt.engine_state.schedule.update_interval  # (stats: the last closed window's, 2)
    opt.close()
    assert stats["high_lr_window"] == expected
    assert interval == (expected or 4)


@pytest.mark.parametrize("saved_window, logged", [("missing", None), (3, "windows of 3 step(s)")])
def test_a_resumed_run_logs_the_choice_it_continues_with(caplog, saved_window, logged):
    """The log names the checkpoint's choice, at the resumed run's first step; a checkpoint from before the rule
    (not engaged) logs nothing, not the choice a fresh schedule at this lr would have made (2)."""
    saved = _checkpoint(steps=4)
    if saved_window == "missing":
        del saved["opt"]["zenflow"]["high_lr_window"]
    else:
        saved["opt"]["zenflow"]["high_lr_window"] = saved_window
    seal(saved["opt"])
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        model, opt, sched = _resume(saved)
        train(model, opt, batches(16)[4:6], sched, clip=1.0)
    opt.close()
    chose = [r.getMessage() for r in caplog.records if 'high_lr_rule="auto"' in r.getMessage()]
    assert chose == ([] if logged is None else chose[:1]) and len(chose) == (logged is not None), chose
    assert logged is None or logged in chose[0]


def test_a_damaged_choice_is_refused():
    saved = _checkpoint()
    saved["opt"]["zenflow"]["high_lr_window"] = 0
    seal(saved["opt"])  # (checksums that agree: the schema itself refuses it)
    with pytest.raises(CheckpointError, match="high_lr_window"):
        _resume(saved)


def test_a_checkpoint_mid_window_converts_to_adamw_with_the_rules_beta1():
    """`to_torch_adamw` applies the open window as `flush()` would, with the rule's host beta1: as the explicit
    run's conversion."""
    from hf_zenflow import to_torch_adamw

    def saved(**settings):
        model = _matrices_only()
        opt = zenflow_adamw(model.parameters(), **{**_resumable(topk_ratio=0.0), **settings})
        train(model, opt, batches(16)[:SPLIT_AT], linear_schedule(opt, 16), clip=1.0)
        state = roundtrip(opt.state_dict())
        opt.close()
        return to_torch_adamw(state, weights=list(model.parameters()))[1]

    auto = saved()
    explicit = saved(update_interval=2, betas=(high_lr_beta1(0.9, 2, 1), 0.999), high_lr_rule="off")
    assert auto.keys() == explicit.keys()
    assert all(torch.equal(auto[i], explicit[i]) for i in auto)
