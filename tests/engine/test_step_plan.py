"""The plan of each step (`hf_zenflow.engine.step_plan`): the schedule's decisions for one step, against plans written
out by hand over a run, and against what an optimizer step then does."""

from __future__ import annotations

import pytest

from hf_zenflow.engine.schedule import StepKind, WindowSchedule
from hf_zenflow.engine.step_plan import StepPlan, plan_step
from hf_zenflow.optimizer import zenflow
from tests.conftest import batches, make_model, param_groups, train, zenflow_adamw


WARM, SEL, ORD = StepKind.WARM_UP, StepKind.SELECT, StepKind.ORDINARY


def _plans(schedule: WindowSchedule, overlap: bool, steps: int) -> list[tuple]:
    """The plans of `steps` steps, the schedule and the pending write-back kept as the optimizer keeps them: a
    re-selection closes the open window and writes every result back first, a write-back clears the pending result,
    and an overlapped close leaves its result pending."""
    pending, out = False, []
    for _ in range(steps):
        plan = plan_step(schedule, overlap, pending, waiting_for_columns=False)
        out.append((plan.kind, plan.launches_before_sync, plan.writes_back, plan.closes_window))
        if plan.selects:
            schedule.window_steps, pending = 0, False
        if plan.writes_previous_window_back:
            pending = False
        schedule.window_steps += 1
        if plan.closes_window:
            schedule.close_window()
            pending = overlap and not plan.warm_up
        schedule.steps += 1
    return out


def test_an_overlapped_run_plans_warm_up_selection_and_the_lagged_write_back():
    s = WindowSchedule(warm_up=1, update_interval=3, auto_ratio=0.99, auto_max_interval=16, select_period=4,
                       writeback_lag=1)
    # (kind, launches before the sync, writes back, closes the window)
    assert _plans(s, overlap=True, steps=10) == [
        (WARM, False, True, True),  # a window of its own, waited for and written back
        (SEL, False, False, False),  # a fresh window: nothing pending
        (ORD, True, False, False),
        (ORD, True, False, True),  # the third step closes the window; its result waits
        (ORD, True, True, False),  # written back one step into the next window
        (SEL, False, False, False),  # the re-selection closed the window of one step and wrote it back
        (ORD, True, False, False),
        (ORD, True, False, True),
        (ORD, True, True, False),
        (SEL, False, False, False),
    ]


def test_a_sequential_run_writes_each_window_back_in_its_closing_step():
    s = WindowSchedule(warm_up=0, update_interval=2, auto_ratio=0.99, auto_max_interval=16, select_period=5)
    assert _plans(s, overlap=False, steps=7) == [
        (SEL, False, False, False), (ORD, True, True, True), (ORD, True, False, False), (ORD, True, True, True),
        (ORD, True, False, False),
        (SEL, False, False, False),  # the re-selection closed the window of one step: a fresh window of two starts
        (ORD, True, True, True),
    ]


def test_zen_auto_windows_close_on_the_votes_and_a_waiting_matrix_takes_the_sync_first_path():
    s = WindowSchedule(warm_up=0, update_interval=None, auto_ratio=0.99, auto_max_interval=4, select_period=10)
    s.steps, s.window_steps = 3, 2
    plan = plan_step(s, overlap=True, writeback_pending=True, waiting_for_columns=True)
    assert plan == StepPlan(ORD, launches_before_sync=False, writes_back=False, writes_previous_window_back=False,
                            closes_window=None, close_waits=False)
    s.writeback_lag = 2
    assert plan_step(s, overlap=True, writeback_pending=True, waiting_for_columns=False).writes_previous_window_back


@pytest.mark.parametrize("overlap", [True, False])
def test_the_optimizer_closes_and_writes_back_where_its_plans_say(monkeypatch, overlap):
    plans: list[StepPlan] = []

    def recorded(*args, **kwargs) -> StepPlan:
        plans.append(plan_step(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(zenflow, "plan_step", recorded)
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=1e-3, topk_ratio=0.25, update_interval=3, full_warm_up_rounds=1,
                        select_strategy="step", select_interval=4, min_offload_numel=0, writeback_lag=1,
                        overlap_step=overlap, host_executor="inline")
    written, closed = [], []
    write_back, close_window = opt.host_windows.write_back, opt.host_windows.close_window
    monkeypatch.setattr(opt.host_windows, "write_back", lambda: (written.append(len(plans) - 1), write_back())[1])
    monkeypatch.setattr(opt.host_windows, "close_window",
                        lambda *a, **k: (closed.append(len(plans) - 1), close_window(*a, **k))[1])
    train(model, opt, batches(10), clip=1.0)
    opt.close()
    assert [p.kind for p in plans] == [WARM, SEL, ORD, ORD, ORD, SEL, ORD, ORD, ORD, SEL]
    for step, plan in enumerate(plans):
        if plan.kind is ORD:  # (a re-selection also closes and writes back the window before it)
            assert (step in closed) is plan.closes_window, step
            assert (step in written) is (plan.writes_previous_window_back or plan.closes_window and not overlap), step
        assert plan.launches_before_sync is (plan.kind is ORD)
