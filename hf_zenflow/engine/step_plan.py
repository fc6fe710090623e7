"""The plan of one optimizer step: the schedule's decisions for that step, made once, after the gradients are read and
before anything is updated.

`ZenFlowAdamW._step` follows a `StepPlan` from top to bottom instead of asking the schedule at each turn: what kind
of step it is, whether its device update starts before the step's one sync, whether a host result goes into the
weights in it, whether its window closes, and whether that close waits for the host step. The plan is a pure
function of the schedule (`schedule.py`), the overlap setting, whether a host result awaits its write-back and
whether a matrix waits for its first columns: no tensors, nothing changed.

Not in the plan: the learning rate of a window's host step. It is taken when the window closes (`windows.py`,
`host_lr.host_hyper`), after the step's sync, because `host_step_guard` may cut it on this very step's gradient norm
(`host_guard.HostStepGuard.observe`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedule import StepKind, WindowSchedule


@dataclass(frozen=True)
class StepPlan:
    """What one step does, in the order it does it."""

    #: warm-up (dense AdamW, every column by the host), a re-selection, or an ordinary step
    kind: StepKind
    #: the device update and the hand-off to the host start before the step's one device->host sync (an ordinary step
    #: with no matrix waiting for its first columns: the others decide on the synced numbers first)
    launches_before_sync: bool
    #: a host result goes into the weights in this step (the device update then leaves the columns of matrices with
    #: host state to that write-back); the sequential schedule writes its own window's back when the window closes
    writes_back: bool
    #: the overlapped schedule's write-back of the previous window, made before this step's hand-off
    writes_previous_window_back: bool
    #: the window closes after this step's hand-off; None: Zen-auto decides on this step's votes, after the sync
    closes_window: bool | None
    #: a close waits for its host step and writes the result back at once (the sequential schedule, warm-up)
    close_waits: bool

    @property
    def warm_up(self) -> bool:
        return self.kind is StepKind.WARM_UP

    @property
    def selects(self) -> bool:
        return self.kind is StepKind.SELECT


def plan_step(schedule: WindowSchedule, overlap: bool, writeback_pending: bool, waiting_for_columns: bool) -> StepPlan:
    """The plan of the next step of `schedule`: `overlap` is ``overlap_step``, `writeback_pending` whether a closed
    window's host result awaits its write-back, `waiting_for_columns` whether a matrix of this step waits for its
    first device columns (`reselection.select_waiting`).

    A warm-up step is a window of its own, closed, waited for and written back in the step. A re-selection closes the
    open window and writes every host result back before its device update (`reselection.reselect`): its write-back
    and its close are judged on an empty window with nothing pending.

    Example:
        >>> s = WindowSchedule(warm_up=0, update_interval=2, auto_ratio=0.99, auto_max_interval=8, select_period=4)
        >>> s.steps, s.window_steps = 1, 1
        >>> plan = plan_step(s, overlap=True, writeback_pending=True, waiting_for_columns=False)
        >>> plan.kind.value, plan.launches_before_sync, plan.writes_back, plan.closes_window
        ('ordinary', True, True, True)
    """
    kind = schedule.kind()
    if kind is StepKind.WARM_UP:
        return StepPlan(kind, launches_before_sync=False, writes_back=True, writes_previous_window_back=False,
                        closes_window=True, close_waits=True)
    before = 0 if kind is StepKind.SELECT else schedule.window_steps
    pending = writeback_pending and kind is not StepKind.SELECT
    writes_back = schedule.boundary_writes_back(overlap, pending, window_steps=before)
    return StepPlan(
        kind,
        launches_before_sync=schedule.launches_before_sync(waiting_for_columns),
        writes_back=writes_back,
        writes_previous_window_back=writes_back and overlap,
        # (Zen-auto's votes come from the masses read in the sync)
        closes_window=None if schedule.update_interval is None else schedule.window_closes([], before + 1),
        close_waits=not overlap,
    )


__all__ = ["StepPlan", "plan_step"]
