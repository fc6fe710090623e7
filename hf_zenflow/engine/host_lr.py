"""The host AdamW's learning-rate multiplier (`EngineRules.host_lr_scale`) per window: a number, "interval" (the
window's length) or "auto" (the window's length, capped where a window's host step would overshoot), and the run's
record of it for `stats()` and the log; `high_lr_rule="auto"`: shorter windows and a lower host beta1 at high
learning rates (`high_lr_window`, `high_lr_beta1`); `host_hyper`: a window's host AdamW hyper-parameters."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from ..settings.rules import AUTO_HOST_LR_CAP, HIGH_LR_RULE_THRESHOLD


if TYPE_CHECKING:
    from ..settings.config import ZenFlowConfig
    from .schedule import WindowSchedule

logger = logging.getLogger("hf_zenflow")


def auto_host_lr_scale(lr: float, window_steps: int, lag: int) -> float:
    """`host_lr_scale="auto"`: the window's length ("interval", the unselected columns move at AdamW's per-step
    rate) while the host step's learning rate stays under `AUTO_HOST_LR_CAP / sqrt(lag)`; above it, the multiplier that
    reaches the cap, and never less than 1.0 (ZenFlow's rule, one AdamW step per window). `lr` is the run's peak
    (the scheduler's ``initial_lr``), `lag` the steps between the window's close and its write-back (1 = one step
    into the next window; the whole window for ZenFlow's schedule). The window's whole update lands at once, with no
    gradient in between to correct it: a host step much larger than the device's per-step one overshoots where the
    loss is sharp (docs/quality.md).

    Example:
        >>> auto_host_lr_scale(5e-5, 4, 1), auto_host_lr_scale(2.5e-4, 4, 1), auto_host_lr_scale(1e-3, 4, 1)
        (4.0, 2.0, 1.0)
        >>> auto_host_lr_scale(1e-4, 4, 4)
        2.5
    """
    if window_steps <= 1 or not lr > 0:
        return 1.0
    return min(float(window_steps), max(1.0, AUTO_HOST_LR_CAP / (math.sqrt(max(1, lag)) * lr)))


def high_lr_window(lr: float, update_interval: int | None) -> int | None:
    """`high_lr_rule="auto"`: the window length at the peak learning rate `lr`, or None where the rule leaves the
    configured `update_interval` alone (lr x update_interval <= `HIGH_LR_RULE_THRESHOLD`, one-step windows,
    Zen-auto's windows). Above it a window's single host step leaves the unselected columns behind, and a larger
    multiplier overshoots (BENCHMARKS.md "Quality: high learning rates"); shorter windows, floor(threshold / lr)
    steps, update them more often.

    Example:
        >>> high_lr_window(1e-3, 4), high_lr_window(1.25e-3, 4), high_lr_window(2e-3, 4), high_lr_window(3e-3, 4)
        (None, None, 2, 1)
        >>> high_lr_window(1e-3, 8), high_lr_window(3e-3, None), high_lr_window(3e-3, 1)
        (5, None, None)
    """
    if update_interval is None or update_interval <= 1 or not lr * update_interval > HIGH_LR_RULE_THRESHOLD:
        return None
    return max(1, min(update_interval - 1, math.floor(HIGH_LR_RULE_THRESHOLD / lr)))


def high_lr_beta1(beta1: float, window: int, lag: int) -> float:
    """`high_lr_rule="auto"`'s host beta1 for windows of `window` steps whose result is written back `lag` steps
    into the next window (0: at once, not overlapped): ``max(0, 1 - window (1 - beta1) - lag / (window + lag))``.

    AdamW's first moment averages about 1 / (1 - beta1) steps, 1 / (window (1 - beta1)) windows: a host beta1 of
    1 - window (1 - beta1) keeps that horizon. A late write-back leaves the first `lag` of the next window's
    `window` gradients one host step stale, a mean staleness of d = lag / window host steps; staleness acts as
    momentum of its own, about d / (1 + d) = lag / (window + lag) (Mitliagkas et al. 2016, "Asynchrony begets
    momentum"), which is taken off the explicit momentum.

    Example:
        >>> [round(high_lr_beta1(0.9, w, lag), 4) for w, lag in ((1, 1), (2, 1), (2, 2), (4, 1), (1, 0))]
        [0.4, 0.4667, 0.3, 0.4, 0.9]
    """
    return max(0.0, 1.0 - window * (1.0 - beta1) - lag / (window + lag))


def rule_window(config: ZenFlowConfig, groups: list[dict]) -> int | None:
    """`high_lr_rule`'s choice for a run with these param `groups`: `high_lr_window` at their largest peak lr; None
    when the rule is off, the windows are Zen-auto's, or the rate is below the threshold."""
    if config.rules.high_lr_rule != "auto" or config.is_auto_interval:
        return None
    return high_lr_window(max((peak_lr(g) for g in groups), default=0.0), int(config.update_interval))


def rule_beta1(config: ZenFlowConfig, beta1: float, window: int, lag: int) -> float:
    """`high_lr_beta1` for this run: the write-back `lag` counts only when the host step overlaps (else 0)."""
    return high_lr_beta1(beta1, window, lag if config.overlap_step else 0)


def host_hyper(group: dict, config: ZenFlowConfig, steps: int, lag: int, high_lr: int | None,
               guard: float = 1.0) -> tuple[dict, float]:
    """A window's host AdamW hyper-parameters from its param group (the lr in force now, times the `host_lr_scale`
    multiplier for a window of `steps` steps written back `lag` steps late, times the `host_step_guard` factor
    `guard`) and the multiplier; with the high-lr rule engaged (`high_lr`: the schedule's shortened window) beta1
    is `high_lr_beta1`'s."""
    hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
    scale = host_lr_scale(config.rules.host_lr_scale, steps, peak_lr(group), lag)
    hyper["lr"] = hyper["lr"] * scale
    if guard != 1.0:  # (only once the guard engaged: until then the same bits as without it)
        hyper["lr"] = hyper["lr"] * guard
    if high_lr is not None:
        beta1, beta2 = hyper["betas"]
        hyper["betas"] = (rule_beta1(config, beta1, high_lr, lag), beta2)
    return hyper, scale


def host_lr_scale(setting: float | str, window_steps: int, lr: float = 0.0, lag: int = 1) -> float:
    """The host AdamW's learning-rate multiplier for a window of `window_steps` steps (`EngineRules.host_lr_scale`:
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
