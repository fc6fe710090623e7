"""The schedule on its own (`hf_zenflow.engine.schedule`): pure decisions, no tensors."""

from __future__ import annotations

import pytest

from hf_zenflow.engine.host_lr import host_lr_scale
from hf_zenflow.engine.schedule import StepKind, WindowSchedule, ZenAutoStats


def schedule(**kw) -> WindowSchedule:
    values = dict(warm_up=0, update_interval=4, auto_ratio=0.99, auto_max_interval=16, select_period=10)
    values.update(kw)
    return WindowSchedule(**values)


def test_zen_auto_rule_per_column_means():
    stats = ZenAutoStats()
    # k=2 of 10 columns: selected mass 4 per step (2 per column); unselected 0.4 per step (0.05 per column)
    votes = [stats.update(4.0, 4.4, 2, 10) for _ in range(50)]
    assert votes.index(True) == 39  # 40 steps x 0.05 = 2.0 >= mean selected 2.0
    stats.reset()
    assert stats.update(1.0, 100.0, 2, 10)  # heavy unselected mass: the first step already qualifies


def test_window_schedule_fixed_and_auto():
    fixed = WindowSchedule(warm_up=2, update_interval=3, auto_ratio=0.99, auto_max_interval=16, select_period=6)
    assert fixed.in_warm_up()
    fixed.steps = 2
    assert fixed.selection_due() and not fixed.in_warm_up()
    fixed.window_steps = 3
    assert fixed.window_closes([])
    auto = WindowSchedule(warm_up=0, update_interval=None, auto_ratio=0.5, auto_max_interval=4, select_period=100)
    auto.window_steps = 1
    assert not auto.window_closes([True, False, False])
    assert auto.window_closes([True, True, False])
    auto.window_steps = 4
    assert auto.window_closes([False])


def test_step_kinds_follow_warm_up_and_the_selection_period():
    s = schedule(warm_up=2, select_period=3)
    kinds = []
    for steps in range(9):
        s.steps = steps
        kinds.append(s.kind())
    assert kinds == [StepKind.WARM_UP] * 2 + [StepKind.SELECT, StepKind.ORDINARY, StepKind.ORDINARY] * 2 + [
        StepKind.SELECT]


def test_a_forced_selection_is_taken_whatever_the_period():
    s = schedule(select_period=100)
    s.steps = 37
    assert s.kind() is StepKind.ORDINARY
    s.force_select = True
    assert s.kind() is StepKind.SELECT
    s.warm_up = 50  # but never inside a warm-up
    assert s.kind() is StepKind.WARM_UP


@pytest.mark.parametrize("kind_steps, waiting, expected", [(5, False, True), (5, True, False), (10, False, False)])
def test_only_ordinary_steps_without_waiting_matrices_launch_before_the_sync(kind_steps, waiting, expected):
    s = schedule(select_period=10)
    s.steps = kind_steps
    assert s.launches_before_sync(waiting) is expected


def test_boundary_write_back():
    s = schedule(update_interval=4)
    s.window_steps = 2
    assert not s.boundary_writes_back(overlap=True, writeback_pending=True)  # not the last step of the window
    s.window_steps = 3
    assert s.boundary_writes_back(overlap=True, writeback_pending=True)
    assert not s.boundary_writes_back(overlap=True, writeback_pending=False)  # the first window: nothing pending
    assert s.boundary_writes_back(overlap=False, writeback_pending=False)  # sequential: its own result
    assert not schedule(update_interval=None).boundary_writes_back(overlap=False, writeback_pending=True)


@pytest.mark.parametrize("update_interval", [4, None])
def test_a_writeback_lag_writes_the_pending_result_back_in_that_step_of_the_next_window(update_interval):
    s = schedule(update_interval=update_interval, writeback_lag=2)
    s.window_steps = 0
    assert not s.boundary_writes_back(overlap=True, writeback_pending=True)  # 1st step of the window
    s.window_steps = 1
    assert s.boundary_writes_back(overlap=True, writeback_pending=True)  # 2nd step
    assert not s.boundary_writes_back(overlap=True, writeback_pending=False)  # written back already
    s.window_steps = 2  # a skipped 2nd step leaves the result pending: the next step writes it back
    assert s.boundary_writes_back(overlap=True, writeback_pending=True)
    assert not s.boundary_writes_back(overlap=False, writeback_pending=True)  # the lag is the overlapped one's


def test_closing_a_window_counts_it():
    s = schedule()
    s.window_steps = 3
    assert s.close_window() == 3
    assert (s.window_steps, s.windows, s.last_interval) == (0, 1, 3)


def test_host_lr_scale():
    assert host_lr_scale(1.0, 4) == 1.0
    assert host_lr_scale(0.5, 4) == 0.5
    assert host_lr_scale("interval", 4) == 4.0


@pytest.mark.parametrize("update_interval, lag", [(4, None), (4, 2), (None, 2), (1, None)])
def test_asking_for_a_window_length_is_asking_with_that_window_open(update_interval, lag):
    s = schedule(update_interval=update_interval, writeback_lag=lag, auto_max_interval=5)
    for steps in range(7):
        opened = schedule(update_interval=update_interval, writeback_lag=lag, auto_max_interval=5)
        opened.window_steps = steps
        for overlap, pending in [(True, True), (True, False), (False, False)]:
            assert s.boundary_writes_back(overlap, pending, window_steps=steps) is \
                opened.boundary_writes_back(overlap, pending)
        assert s.window_closes([True], window_steps=steps) is opened.window_closes([True])
