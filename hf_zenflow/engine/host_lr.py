"""The host AdamW's learning-rate multiplier (`ZenFlowConfig.host_lr_scale`) per window: a number, "interval" (the
window's length) or "auto" (the window's length, capped where a window's host step would overshoot), and the run's
record of it for `stats()` and the log."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from ..settings.config import AUTO_HOST_LR_CAP


if TYPE_CHECKING:
    from .schedule import WindowSchedule

logger = logging.getLogger("hf_zenflow")




def auto_host_lr_scale(lr: float, window_steps: int, lag: int) -> float:
    """`host_lr_scale="auto"`: the window's length ("interval", the unselected columns move at AdamW's per-step
    rate) while the host step's learning rate stays under `AUTO_HOST_LR_CAP / sqrt(lag)`; above it, the multiplier that
    reaches the cap, and never less than 1.0 (ZenFlow's rule, one AdamW step per window). `lr` is the run's peak
    (the scheduler's ``initial_lr``), `lag` the steps between the window's close and its write-back (1 = one step
    into the next window; the whole window for ZenFlow's schedule).

    Example:
        >>> auto_host_lr_scale(1e-3, 4, 1), auto_host_lr_scale(2.5e-3, 4, 1), auto_host_lr_scale(1e-3, 4, 4)
        (4.0, 2.0, 2.5)
    """
    if window_steps <= 1 or not lr > 0:
        return 1.0
    return min(float(window_steps), max(1.0, AUTO_HOST_LR_CAP / (math.sqrt(max(1, lag)) * lr)))


def host_lr_scale(setting: float | str, window_steps: int, lr: float = 0.0, lag: int = 1) -> float:
    """The host AdamW's learning-rate multiplier for a window of `window_steps` steps (`ZenFlowConfig.host_lr_scale`:
    a number, "interval" for the window's length, or "auto" for `auto_host_lr_scale` of the group's peak `lr` and the
    write-back `lag`)."""
    if setting == "interval":
        return float(window_steps)
    if setting == "auto":
        return auto_host_lr_scale(lr, window_steps, lag)
    return float(setting)


def peak_lr(group: dict) -> float:
    """The learning rate `host_lr_scale="auto"` judges by: the scheduler's base (``initial_lr``, set by every torch
    scheduler; a warm-up's first tiny rates would pick the longest multiplier), else the group's lr."""
    return float(group.get("initial_lr", group["lr"]))


def window_lag(schedule: WindowSchedule | None, overlap: bool, window_steps: int) -> int:
    """Steps from a window's close to its write-back, as `host_lr_scale="auto"` counts them: the schedule's lag
    (1 before `writeback_lag="auto"` chose), the whole window when it is written back at the next boundary; 1 when
    not overlapped (written back at once: no staleness, but the host step's size still counts)."""
    if not overlap or schedule is None:
        return 1
    if schedule.writeback_lag is not None:
        return schedule.writeback_lag
    return max(1, schedule.update_interval or window_steps)


class LrScaleRecord:
    """The multiplier of the run's last full window, for `stats()`; ``"auto"`` logs each value it picks once (it
    changes at most when ``writeback_lag="auto"`` chooses, or with a group's learning rate)."""

    def __init__(self) -> None:
        self.last: float | None = None
        self._logged: set[float] = set()

    def note(self, setting: float | str, scale: float, lr: float, lag: int, full: bool) -> None:
        """`full`: a whole window (a warm-up step or a window `flush()` closes early takes at most its length, and
        is kept only until a whole window closes)."""
        if not full:
            self.last = scale if self.last is None else self.last
            return
        self.last = scale
        if setting == "auto" and scale not in self._logged:
            self._logged.add(scale)
            logger.info('hf_zenflow: host_lr_scale="auto" chose %.4g (peak lr %g, write-back lag %d)', scale, lr, lag)
