"""The schedule: pure decisions about steps, windows and selections, with no tensors.

Which kind of step this is (dense warm-up, a re-selection, or an ordinary step that may launch its device work before
the host reads the step's scalars), when a window closes (a fixed `update_interval`, or Zen-auto's votes within
`auto_max_interval`), which step writes a host result back, and the learning-rate scale of a host step.
`step_plan.py` turns these into one step's plan, which `ZenFlowAdamW` follows; it decides nothing of this itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any


class StepKind(Enum):
    WARM_UP = "warm-up"  # dense AdamW, every column by the host, synchronously
    SELECT = "select"  # re-selection: close the window, drain the worker, migrate state
    ORDINARY = "ordinary"


@dataclass
class ZenAutoStats:
    """Zen-auto bookkeeping for one matrix over the open window.

    The window may close once the unselected gradient mass accumulated since the last host update has caught up
    with the mean selected mass of one step, per column: ``sum_u noncrit_u / (in - k) >= mean_u crit_u / k``.
    DeepSpeed normalises "per 10% of columns" and re-applies that factor on every update, which compounds for
    ratios other than 0.1; per-column means are the same rule without that defect.
    """

    mean_critical: float = 0.0
    accumulated_noncritical: float = 0.0
    steps: int = 0

    def update(self, critical_sq: float, total_sq: float, k: int, columns: int) -> bool:
        self.steps += 1
        critical = critical_sq / k
        noncritical = max(total_sq - critical_sq, 0.0) / (columns - k)
        self.mean_critical += (critical - self.mean_critical) / self.steps
        self.accumulated_noncritical += noncritical
        return self.accumulated_noncritical >= self.mean_critical

    def reset(self) -> None:
        self.mean_critical, self.accumulated_noncritical, self.steps = 0.0, 0.0, 0

    def to_list(self) -> list[float]:
        return [self.mean_critical, self.accumulated_noncritical, float(self.steps)]

    @classmethod
    def from_list(cls, values: list[float]) -> ZenAutoStats:
        return cls(float(values[0]), float(values[1]), int(values[2]))


@dataclass
class WindowSchedule:
    """Step bookkeeping: warm-up, fixed or automatic windows, re-selection period.

    `steps` counts optimizer steps taken (skipped non-finite steps do not count). A step t (0-based) is a warm-up
    step when t < warm_up; the first selection happens at t == warm_up, and again every `select_period` steps.
    """

    warm_up: int
    update_interval: int | None  # None = automatic
    auto_ratio: float
    auto_max_interval: int
    select_period: int
    #: overlapped schedule: the previous window's result is written back in this step of the next window (None: in
    #: the step that closes it)
    writeback_lag: int | None = None
    #: writeback_lag="auto" before its choice (the lag is then 1)
    writeback_lag_pending: bool = False
    steps: int = 0
    window_steps: int = 0
    windows: int = 0
    reselections: int = 0
    last_interval: int = 0
    #: select at the next step whatever the period says (a resumed run whose `topk_ratio` changed)
    force_select: bool = False
    #: `high_lr_rule="auto"`'s shortened window (then also `update_interval`); None: not engaged
    high_lr_window: int | None = None
    #: the `min_offload_numel` that `device_memory_limit_bytes` chose for the run (`device_budget.py`); None: the
    #: setting's (no limit)
    limit_min_offload_numel: int | None = None

    def offload_threshold(self, config: Any) -> int:
        """The run's `min_offload_numel`: the limit's choice, else `config`'s setting."""
        return config.min_offload_numel if self.limit_min_offload_numel is None else self.limit_min_offload_numel

    def shorten_windows(self, window: int | None, configured: int | None, lag: int | None) -> None:
        """`high_lr_rule="auto"`'s choice (`host_lr.high_lr_window`, or a checkpoint's): windows of `window` steps
        instead of the `configured` interval (None: the configured windows), and the write-back `lag` (the
        setting's; 1 for "auto" before its choice) never beyond them."""
        self.high_lr_window = window
        self.update_interval = window or configured
        self.writeback_lag = lag if window is None or lag is None else min(lag, window)

    #: the keys of `state()` that `load()` always restores: the progress, whatever the settings in force
    COUNTERS = ("steps", "window_steps", "windows", "reselections", "last_interval")

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the schedule, as plain values under the keys of its ``zenflow`` block: the
        counters, a re-selection forced at the next step, the write-back lag (and whether "auto" has still to choose
        it), `high_lr_rule`'s window and the threshold a device memory limit chose."""
        return {
            "steps": self.steps, "window_steps": self.window_steps, "windows": self.windows,
            "reselections": self.reselections, "last_interval": self.last_interval, "force_select": self.force_select,
            "writeback_lag": self.writeback_lag, "writeback_lag_pending": self.writeback_lag_pending,
            "high_lr_window": self.high_lr_window, "limit_min_offload_numel": self.limit_min_offload_numel,
        }

    def load(self, state: dict[str, Any], lag: bool = False, limit: bool = False) -> None:
        """Restore the counters and a forced re-selection from `state` (a checked checkpoint block; one without
        ``force_select`` forces none); with `lag`, "auto"'s write-back lag as the saved run had it, chosen or not
        (after `shorten_windows`, which sets the lag from the settings); with `limit`, the threshold the saved run's
        device memory limit chose. Where the caller passes neither, the settings in force decide those afresh."""
        for key in self.COUNTERS:
            setattr(self, key, int(state[key]))
        self.force_select = bool(state.get("force_select", False))
        if lag:
            self.writeback_lag = state["writeback_lag"]
            self.writeback_lag_pending = bool(state["writeback_lag_pending"])
        if limit:
            self.limit_min_offload_numel = state["limit_min_offload_numel"]

    def in_warm_up(self) -> bool:
        return self.steps < self.warm_up

    def selection_due(self) -> bool:
        if self.steps < self.warm_up:
            return False
        return self.force_select or (self.steps - self.warm_up) % self.select_period == 0

    def window_closes(self, auto_votes: list[bool], window_steps: int | None = None) -> bool:
        """Whether the window closes after the current step: `window_steps` counts the current step (default: the
        open window's `window_steps`, the current step already added)."""
        steps = self.window_steps if window_steps is None else window_steps
        if self.update_interval is not None:
            return steps >= self.update_interval
        if steps >= self.auto_max_interval:
            return True
        if not auto_votes:  # a selection step (no masses measured) or no offloaded matrix: wait for the bound
            return False
        # At least `auto_ratio` of the matrices (DeepSpeed floors this count, so 0.99 of 10 matrices means 9).
        needed = max(1, math.ceil(self.auto_ratio * len(auto_votes) - 1e-9))
        return sum(auto_votes) >= needed

    def kind(self) -> StepKind:
        """The kind of the next step."""
        if self.in_warm_up():
            return StepKind.WARM_UP
        return StepKind.SELECT if self.selection_due() else StepKind.ORDINARY

    def launches_before_sync(self, waiting_for_columns: bool) -> bool:
        """Whether the next step may launch its device update before the host reads the step's scalars: only an
        ordinary step with no matrix waiting for its first columns (those decisions need host numbers first)."""
        return self.kind() is StepKind.ORDINARY and not waiting_for_columns

    def boundary_writes_back(self, overlap: bool, writeback_pending: bool, window_steps: int | None = None) -> bool:
        """Whether the next step writes a host result back: the previous window's, pending, when overlapped (in the
        `writeback_lag`-th step of this window, or in the step that closes a fixed-length window), this window's
        own when not (in the step that closes it). Zen-auto windows are decided after the device update, so their
        closing step never counts here (the close writes back itself). `window_steps`: the steps in the window
        before the next one (default: the open window's)."""
        before = self.window_steps if window_steps is None else window_steps
        if overlap and writeback_pending and self.writeback_lag is not None and before + 1 >= self.writeback_lag:
            return True
        if self.update_interval is None or before + 1 < self.update_interval:
            return False
        return not overlap or writeback_pending

    def writeback_steps(self, overlap: bool) -> int:
        """Steps from a window's close to the step that writes its result back, at most (`boundary_writes_back`): 1
        when not overlapped (at once); the lag; without one, the next window's length at most (`update_interval`,
        or `auto_max_interval` with Zen-auto windows). The hand-off slots follow from it (`host.grad_slots`)."""
        if not overlap:
            return 1
        if self.writeback_lag is not None:
            return self.writeback_lag
        return self.update_interval or self.auto_max_interval

    def close_window(self) -> int:
        """Account for a closed window; returns its length in steps."""
        steps, self.window_steps = self.window_steps, 0
        self.windows += 1
        self.last_interval = steps
        return steps


#: `writeback_lag="auto"`: the host step must fit in this fraction of the lag's device time (25% to spare)
AUTO_LAG_FILL = 0.8


def auto_writeback_lag(host_step_ms: float, step_ms: float, longest: int) -> int:
    """The smallest lag, in steps, whose device time holds a host step of `host_step_ms` with 25% to spare, given
    steps of `step_ms` (the measured time between optimizer steps), between 1 and `longest` (the window).

    Example:
        >>> auto_writeback_lag(30.0, 2400.0, 4), auto_writeback_lag(3000.0, 1000.0, 4), auto_writeback_lag(9e3, 1e3, 4)
        (1, 4, 4)
    """
    if not step_ms > 0:
        return longest
    return max(1, min(longest, math.ceil(host_step_ms / (AUTO_LAG_FILL * step_ms))))


#: `writeback_lag="auto"`: host-column elements per step of lag (2**31: a host AdamW over them takes about half a
#: second on 8 cores at the 0.5 Gparam/s per core measured in BENCHMARKS.md, less than a training step of a model
#: that size)
AUTO_LAG_HOST_ELEMENTS = 2**31


def lag_for_host_elements(host_elements: int, longest: int) -> int:
    """``writeback_lag="auto"``'s rule (`writeback_lag.auto_lag_from_sizes`): one step per `AUTO_LAG_HOST_ELEMENTS`
    elements of host columns on this rank, rounded up, at least 1 and at most `longest` (the window)."""
    return max(1, min(longest, math.ceil(host_elements / AUTO_LAG_HOST_ELEMENTS)))


def planned_writeback_steps(config: Any, host_elements: int) -> int:
    """The steps from a window's close to its write-back that `config` gives a run with `host_elements` elements of
    host columns on this rank (`WindowSchedule.writeback_steps` once the run has its schedule): what the hand-off
    slots are counted by before the run starts (`host.grad_slots`; the planner's and the estimate's host memory).

    Example:
        >>> from hf_zenflow.settings.config import ZenFlowConfig
        >>> planned_writeback_steps(ZenFlowConfig().with_rules(writeback_lag=3), 0)
        3
        >>> planned_writeback_steps(ZenFlowConfig(), 0), planned_writeback_steps(ZenFlowConfig(host_step="zenflow"), 0)
        (1, 4)
    """
    longest = config.writeback_lag_bound()[0]
    if not config.overlap_step:
        return 1
    if config.rules.writeback_lag == "auto":
        return lag_for_host_elements(host_elements, longest)
    return longest if config.rules.writeback_lag is None else int(config.rules.writeback_lag)
