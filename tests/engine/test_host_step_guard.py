"""`host_step_guard`: the first gradient after each write-back of a host result is compared with the largest of the
last `HOST_STEP_GUARD_HISTORY` norms before it; above the ratio, the host AdamW's learning rate is halved for the rest
of the run (down to `HOST_STEP_GUARD_MIN_FACTOR`; the first cut at least back to one AdamW step per window); "auto"
watches at `HOST_STEP_GUARD_RATIO` where `high_lr_rule` shortened the windows, nowhere else. Where it never engages
a run is bit for bit the run with the guard off; once engaged, the host step is bit for bit the
configured one at the guard's factor; it is in `stats()`, logged, and a checkpoint resumes it exactly (a factor
engaged, a write-back still watched)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_zenflow import CheckpointError
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.engine.host_guard import HostStepGuard
from hf_zenflow.settings.rules import (
    HOST_STEP_GUARD_HISTORY,
    HOST_STEP_GUARD_MIN_FACTOR,
    HOST_STEP_GUARD_RATIO,
)
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


STEPS = 16
OVERSHOOT_LR = 0.3  # on `_matrices_only` with every column on the host: the first write-back raises the norm x9


def test_only_the_first_gradient_after_a_write_back_is_compared():
    guard = HostStepGuard()
    guard.observe(1.0, 0, 2.5)
    guard.observe(10.0, 1, 2.5)  # a jump with no write-back before it: the device's own, not watched
    assert guard.factor == 1.0 and guard.engaged == 0
    guard.wrote_back()  # (the largest recent norm, 10.0, is the reference)
    guard.observe(24.0, 2, 2.5)  # x2.4: not above the ratio
    assert guard.factor == 1.0 and guard.watch_norm is None
    guard.wrote_back()
    guard.observe(61.0, 3, 2.5)  # x2.54 the largest before it (24.0)
    assert guard.factor == 0.5 and guard.engaged == 1
    guard.observe(1000.0, 4, 2.5)  # the watch is over
    assert guard.factor == 0.5
    guard.wrote_back()
    guard.forget_write_back()  # (a warm-up step's write-back)
    guard.observe(1e6, 5, 2.5)
    assert guard.factor == 0.5
    guard.wrote_back()
    guard.observe(1e7, 6, "off")
    assert guard.factor == 0.5 and guard.engaged == 1


# Total gradient norms of a MiniLM fine-tune (Rotten Tomatoes, lr 5e-5, seed 4, update_interval 4), steps 26-33: a
# write-back after the fourth, then an ordinary jump x3.05 over the norm just before it, within x1.7 of the largest
# of the last four.
FINE_TUNE_NORMS = [0.384, 0.508, 0.407, 0.828, 0.416, 0.515, 0.452]
FINE_TUNE_JUMP = 1.38


def test_an_ordinary_jump_within_the_recent_spread_is_not_an_overshoot():
    assert HOST_STEP_GUARD_HISTORY >= 4 and FINE_TUNE_JUMP > HOST_STEP_GUARD_RATIO * FINE_TUNE_NORMS[-1]
    guard = HostStepGuard()
    for step, norm in enumerate(FINE_TUNE_NORMS):
        guard.observe(norm, step, HOST_STEP_GUARD_RATIO)
    guard.wrote_back()
    assert guard.watch_norm == max(FINE_TUNE_NORMS[-HOST_STEP_GUARD_HISTORY:]) == 0.828
    guard.observe(FINE_TUNE_JUMP, len(FINE_TUNE_NORMS), HOST_STEP_GUARD_RATIO)
    assert guard.factor == 1.0 and guard.engaged == 0
    # the same jump above every one of the recent norms is an overshoot
    guard.wrote_back()
    guard.observe(HOST_STEP_GUARD_RATIO * 1.01 * FINE_TUNE_JUMP, len(FINE_TUNE_NORMS) + 1, HOST_STEP_GUARD_RATIO)
    assert guard.factor == 0.5 and guard.engaged == 1


def test_the_reference_forgets_norms_older_than_its_history():
    guard = HostStepGuard()
    guard.observe(100.0, 0, 2.5)  # (the large first norms of a run from scratch)
    for step in range(1, HOST_STEP_GUARD_HISTORY + 1):
        guard.observe(1.0, step, 2.5)
    guard.wrote_back()
    assert guard.watch_norm == 1.0
    guard.observe(3.0, HOST_STEP_GUARD_HISTORY + 1, 2.5)
    assert guard.factor == 0.5


def test_the_factor_halves_down_to_its_floor():
    guard = HostStepGuard()
    guard.observe(1.0, 0, 2.0)
    for step in range(1, 8):
        guard.wrote_back()
        guard.observe(3.0 ** step, step, 2.0)  # x3 after every write-back
        assert guard.factor == max(HOST_STEP_GUARD_MIN_FACTOR, 0.5 ** step) and guard.engaged == step


def test_the_first_cut_goes_at_least_back_to_one_adamw_step_per_window():
    guard = HostStepGuard()
    guard.closed([4.0, 2.0])  # (two param groups' multipliers: the larger counts)
    guard.observe(1.0, 0, 2.5)
    guard.wrote_back()
    guard.observe(3.0, 1, 2.5)
    assert guard.factor == 0.25  # x4 -> x1
    guard.wrote_back()
    guard.observe(9.0, 2, 2.5)
    assert guard.factor == 0.125  # then halved
    below_one = HostStepGuard()
    below_one.closed([0.5])
    below_one.observe(1.0, 0, 2.5)
    below_one.wrote_back()
    below_one.observe(3.0, 1, 2.5)
    assert below_one.factor == 0.5


def _matrices_only(seed: int = 0) -> torch.nn.Module:
    """Every parameter a matrix: with topk_ratio=0 each is updated by the host AdamW alone."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(24, 40), torch.nn.Linear(40, 80, bias=False), torch.nn.GELU(),
                               torch.nn.Linear(80, 24, bias=False))


def _settings(**settings):
    return {"topk_ratio": 0.25, "update_interval": 4, "select_strategy": "step", "select_interval": 8,
            "min_offload_numel": 0, "writeback_lag": 1, "high_lr_rule": "off", **settings}


def _run(model, lr, hook=None, **settings):
    settings = _settings(**settings)
    opt = zenflow_adamw(model.parameters() if settings["topk_ratio"] == 0.0 else param_groups(model), lr=lr,
                        **settings)
    train(model, opt, batches(STEPS), linear_schedule(opt, STEPS), clip=1.0,
          hook=None if hook is None else lambda i: hook(opt, i))
    opt.flush()
    stats = opt.stats()
    opt.close()
    return model, stats


@pytest.mark.parametrize("lr, settings", [
    (1e-3, {}), (5e-5, {}),
    (3e-3, {"high_lr_rule": "auto"}),  # the high-lr rule's one-step windows: a write-back every step
    (1e-3, {"overlap_step": False}), (1e-3, {"writeback_lag": None}), (1e-3, {"accumulate_on": "device"}),
    (1e-3, {"host_lr_scale": "interval", "full_warm_up_rounds": 2}),
])
def test_where_it_does_not_engage_nothing_changes(lr, settings):
    guarded, stats = _run(make_model(), lr, host_step_guard=HOST_STEP_GUARD_RATIO, **settings)
    assert stats["host_step_guard"] == 1.0 and stats["host_step_guard_engaged"] == 0
    off, off_stats = _run(make_model(), lr, host_step_guard="off", **settings)
    assert off_stats["host_step_guard"] == 1.0
    assert all(torch.equal(p, q) for p, q in zip(guarded.parameters(), off.parameters()))


def test_auto_watches_only_where_high_lr_rule_shortened_the_windows():
    """The same constructed overshoot (every column on the host, a learning rate far above the rule's threshold): with
    the configured windows "auto" does not watch, bit for bit the unguarded run; with `high_lr_rule`'s one-step windows
    it engages, bit for bit the run at the explicit `HOST_STEP_GUARD_RATIO`."""
    assert zenflow_config().rules.host_step_guard == "auto"
    configured, stats = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, high_lr_rule="off")
    assert stats["host_step_guard"] == 1.0 and stats["host_step_guard_engaged"] == 0 and stats["high_lr_window"] == 0
    off, _ = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, high_lr_rule="off", host_step_guard="off")
    assert all(torch.equal(p, q) for p, q in zip(configured.parameters(), off.parameters()))
    explicit, _ = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, high_lr_rule="off",
                       host_step_guard=HOST_STEP_GUARD_RATIO)
    assert any(not torch.equal(p, q) for p, q in zip(explicit.parameters(), off.parameters()))  # (it overshoots)

    shortened, stats = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, high_lr_rule="auto")
    assert stats["high_lr_window"] == 1 and stats["host_step_guard"] < 1.0, stats
    ratio, ratio_stats = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, high_lr_rule="auto",
                              host_step_guard=HOST_STEP_GUARD_RATIO)
    assert ratio_stats["host_step_guard"] == stats["host_step_guard"]
    assert all(torch.equal(p, q) for p, q in zip(shortened.parameters(), ratio.parameters()))
    unguarded, _ = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, high_lr_rule="auto", host_step_guard="off")
    assert any(not torch.equal(p, q) for p, q in zip(shortened.parameters(), unguarded.parameters()))


@pytest.mark.parametrize("lr", [5e-5, 1e-3])
def test_auto_below_the_high_lr_rule_is_the_unguarded_run(lr):
    """The default at fine-tuning rates (the rule leaves the windows alone): bit for bit `host_step_guard="off"`."""
    auto, stats = _run(make_model(), lr, high_lr_rule="auto")
    assert stats["high_lr_window"] == 0 and stats["host_step_guard_engaged"] == 0
    off, _ = _run(make_model(), lr, high_lr_rule="auto", host_step_guard="off")
    assert all(torch.equal(p, q) for p, q in zip(auto.parameters(), off.parameters()))


def _factors_of_a_guarded_run(lr, ratio, **settings):
    """The guard's factor in force for each step's window close (after the step's own comparison)."""
    factors: list[float] = []
    model = _matrices_only()
    opt = zenflow_adamw(model.parameters(), lr=lr, **_settings(topk_ratio=0.0, host_step_guard=ratio, **settings))
    sched = linear_schedule(opt, STEPS)
    for x, y in batches(STEPS):
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        factors.append(opt.stats()["host_step_guard"])
        opt.zero_grad()
        sched.step()
    opt.flush()
    opt.close()
    return model, factors


@pytest.mark.parametrize("settings", [{}, {"overlap_step": False}, {"update_interval": 2, "writeback_lag": 2}])
def test_once_engaged_the_host_step_is_the_configured_one_at_the_guards_factor(settings):
    """Every column on the host (topk_ratio=0) and a learning rate at which the host step overshoots: the run is bit
    for bit the unguarded run whose host_lr_scale is set, before each step, to the guard's factor then."""
    guarded, factors = _factors_of_a_guarded_run(OVERSHOOT_LR, HOST_STEP_GUARD_RATIO, **settings)
    assert factors[-1] < 1.0 and len(set(factors)) >= 2, factors  # (it engaged, at least once)

    def follow(opt, i):
        opt.config = opt.config.with_rules(host_lr_scale=factors[i])

    explicit, _ = _run(_matrices_only(), OVERSHOOT_LR, hook=follow, topk_ratio=0.0, host_step_guard="off",
                       **settings)
    assert all(torch.equal(p, q) for p, q in zip(guarded.parameters(), explicit.parameters()))
    unguarded, _ = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, host_step_guard="off", **settings)
    assert any(not torch.equal(p, q) for p, q in zip(guarded.parameters(), unguarded.parameters()))


def test_an_engagement_is_logged_and_in_stats(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        _, stats = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0, host_step_guard=HOST_STEP_GUARD_RATIO)
    messages = [r.getMessage() for r in caplog.records if "host_step_guard" in r.getMessage()]
    # (logged when the factor changes; counted at every overshoot, also at the floor)
    assert 0 < stats["host_step_guard"] < 1.0 and 2.0 ** -len(messages) == stats["host_step_guard"]
    assert stats["host_step_guard_engaged"] >= len(messages)
    assert "the first after a host result was written back" in messages[0], messages


SPLIT_AT = 9  # one step after the write-back of the second window (update_interval=4, writeback_lag=1)


def _resumable():
    return {"lr": OVERSHOOT_LR, **_settings(topk_ratio=0.0, host_step_guard=HOST_STEP_GUARD_RATIO)}


@pytest.mark.parametrize("settings", [{}, {"host_step_guard": "auto", "high_lr_rule": "auto"}])
def test_a_guarded_run_resumes_exactly_with_a_write_back_still_watched(settings):
    uninterrupted, _ = _run(_matrices_only(), OVERSHOOT_LR, topk_ratio=0.0,
                            **{"host_step_guard": HOST_STEP_GUARD_RATIO, **settings})
    model = _matrices_only()
    opt = zenflow_adamw(model.parameters(), **{**_resumable(), **settings})
    sched = linear_schedule(opt, STEPS)
    train(model, opt, batches(STEPS)[:SPLIT_AT], sched, clip=1.0)
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    opt.close()
    guard = saved["opt"]["zenflow"]["host_step_guard"]
    # (the case this test is about: engaged, a write-back watched, a full history)
    assert guard["factor"] < 1.0 and guard["watch_norm"] is not None, guard
    assert len(guard["recent_norms"]) == HOST_STEP_GUARD_HISTORY, guard

    assert guard["high_lr"] == (settings.get("high_lr_rule") == "auto"), guard
    model = _matrices_only(seed=123)
    model.load_state_dict(saved["model"])
    opt = zenflow_adamw(model.parameters(), **{**_resumable(), **settings})
    sched = linear_schedule(opt, STEPS)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    assert opt.stats()["host_step_guard"] == guard["factor"]
    train(model, opt, batches(STEPS)[SPLIT_AT:], sched, clip=1.0)
    opt.flush()
    opt.close()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), uninterrupted.parameters()))


def test_off_after_an_engagement_restores_the_configured_host_step():
    """A run resumed with `host_step_guard="off"` from a checkpoint whose guard engaged continues bit for bit as the
    unguarded run resumed from the same state with its factor forgotten."""
    saved = _saved_at_split()
    assert saved["zenflow"]["host_step_guard"]["factor"] < 1.0

    def resume(state):
        torch.manual_seed(0)
        model = _matrices_only()
        opt = zenflow_adamw(model.parameters(), **{**_resumable(), "host_step_guard": "off"})
        opt.load_state_dict(state)
        stats = opt.stats()
        train(model, opt, batches(STEPS)[SPLIT_AT:], None, clip=1.0)
        opt.flush()
        opt.close()
        return model, stats

    off, stats = resume(saved)
    assert stats["host_step_guard"] == 1.0
    forgotten = roundtrip(saved)
    forgotten["zenflow"]["host_step_guard"]["factor"] = 1.0
    seal(forgotten)
    reference, _ = resume(forgotten)
    assert all(torch.equal(p, q) for p, q in zip(off.parameters(), reference.parameters()))


def _saved_at_split():
    model = _matrices_only()
    opt = zenflow_adamw(model.parameters(), **_resumable())
    train(model, opt, batches(STEPS)[:SPLIT_AT], None, clip=1.0)
    saved = roundtrip(opt.state_dict())
    opt.close()
    return saved


def test_a_checkpoint_from_before_the_guard_starts_it_afresh():
    saved = _saved_at_split()
    del saved["zenflow"]["host_step_guard"]
    seal(saved)
    opt = zenflow_adamw(_matrices_only().parameters(), **_resumable())
    opt.load_state_dict(saved)
    assert opt.stats()["host_step_guard"] == 1.0 and opt.stats()["host_step_guard_engaged"] == 0
    opt.close()


def test_a_checkpoint_from_before_the_history_keeps_its_last_norm():
    saved = _saved_at_split()
    state = saved["zenflow"]["host_step_guard"]
    del state["recent_norms"]
    seal(saved)
    opt = zenflow_adamw(_matrices_only().parameters(), **_resumable())
    opt.load_state_dict(saved)
    guard = opt.host_windows.state()["host_step_guard"]
    assert guard["recent_norms"] == [state["last_norm"]]
    assert guard["watch_norm"] == state["watch_norm"] and guard["factor"] == state["factor"]
    opt.close()


@pytest.mark.parametrize("key, value", [("factor", 0.0), ("factor", 2.0), ("engaged", -1), ("watch_norm", "x"),
                                        ("last_norm", float("nan")), ("extra", 1), ("recent_norms", [1.0, -1.0]),
                                        ("recent_norms", 3.0), ("high_lr", 1), ("scale", 0.0)])
def test_a_damaged_guard_state_is_refused(key, value):
    saved = _saved_at_split()
    saved["zenflow"]["host_step_guard"][key] = value
    seal(saved)
    opt = zenflow_adamw(_matrices_only().parameters(), **_resumable())
    with pytest.raises(CheckpointError, match="host_step_guard"):
        opt.load_state_dict(saved)
    opt.close()


@pytest.mark.parametrize("value", [1.0, 0.5, "never", True, float("inf")])
def test_bad_settings_name_the_field_the_value_and_what_is_allowed(value):
    with pytest.raises(ValueError) as info:
        zenflow_config(host_step_guard=value)
    message = str(info.value)
    assert f"EngineRules.host_step_guard={value!r}" in message and 'a float > 1, "auto" or "off"' in message


def test_settings_parse_numbers_and_off():
    assert zenflow_config().rules.host_step_guard == "auto"
    assert zenflow_config(host_step_guard=" AUTO ").rules.host_step_guard == "auto"
    assert zenflow_config(host_step_guard="3").rules.host_step_guard == 3.0
    assert zenflow_config(host_step_guard=" OFF ").rules.host_step_guard == "off"
