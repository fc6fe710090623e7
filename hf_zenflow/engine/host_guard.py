"""`EngineRules.host_step_guard`: a watch on each host result after it is written into the weights.

A window's host step lands all at once, with no gradient in between to correct it. Where the loss is sharp along the
unselected columns (an un-normalised path to the output, a learning rate at the edge of stability), a step that
AdamW would have taken in pieces overshoots, and the first gradient computed on the new weights shows it: its total
norm jumps. One step's norm is noisy (while fine-tuning it can triple from one batch to the next), so the guard
compares that norm with the largest of the last `HOST_STEP_GUARD_HISTORY` norms before the write-back: an ordinary
jump stays within the spread the recent steps already showed, an overshoot leaves it. Above `host_step_guard` times
that reference, the host AdamW's learning rate is cut for the rest of the run: halved, and at least back to one
AdamW step per window (the `host_lr_scale` multiplier times the guard's factor at most 1: the rule that never
diverged where a larger multiplier did); again at each later overshoot, down to `HOST_STEP_GUARD_MIN_FACTOR`.
Under "auto" the ratio is `HOST_STEP_GUARD_RATIO`, and the guard watches only windows that `high_lr_rule` shortened:
the learning rates at the edge of stability, where a host result written back one step late can overshoot; below
them it does not watch. The norms are the ones every step computes for its non-finite check and clipping, read in
the step's one sync: no extra pass, no timing, so the same script and seed give the same weights; with several
ranks it is the global norm, the same on every rank. Until the guard engages its factor is exactly 1 and the host
step's hyper-parameters are untouched (bit for bit the unguarded run).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from ..settings import rules as settings_rules
from ..settings.rules import HOST_STEP_GUARD_MIN_FACTOR, HOST_STEP_GUARD_RATIO


logger = logging.getLogger("hf_zenflow")


class HostStepGuard:
    """The guard's state: `factor` (the host lr's multiplier, 1.0 until it engages), `engaged` (overshoots seen),
    `scale` (the largest `host_lr_scale` multiplier of the last window closed), `high_lr` (whether that window was
    shortened by `high_lr_rule`: where "auto" watches), `recent_norms` (the last
    `HOST_STEP_GUARD_HISTORY` steps' total gradient norms, oldest first), `watch_norm` (the largest of them at the
    last write-back, while the first gradient after it is awaited; None otherwise)."""

    def __init__(self) -> None:
        self.factor = 1.0
        self.engaged = 0
        self.scale = 1.0
        self.high_lr = False
        self.recent_norms: deque[float] = deque(maxlen=settings_rules.HOST_STEP_GUARD_HISTORY)
        self.watch_norm: float | None = None

    @property
    def last_norm(self) -> float | None:
        """The last step's total gradient norm (None before the first)."""
        return self.recent_norms[-1] if self.recent_norms else None

    def observe(self, total_norm: float, step: int, setting: float | str) -> None:
        """A step's total gradient norm (finite steps only), before any write-back of this step: compared with the
        largest recent norm before the last write-back when this is the first gradient after it (`setting`: the
        configured ratio, "auto" or "off")."""
        watched, self.watch_norm = self.watch_norm, None
        self.recent_norms.append(float(total_norm))
        ratio = self.ratio_for(setting)
        if ratio is None or watched is None or not total_norm > ratio * watched:
            return
        self.engaged += 1
        if self.factor > HOST_STEP_GUARD_MIN_FACTOR:
            self.factor = max(HOST_STEP_GUARD_MIN_FACTOR, min(self.factor / 2, 1.0 / self.scale))
            logger.warning(
                "hf_zenflow: host_step_guard: at step %d, the first after a host result was written back, the "
                "gradient norm rose from at most %.4g in the last %d steps to %.4g (x%.2f > %g); the host AdamW's "
                "learning rate is now x%g of the configured one for the rest of the run (docs/quality.md)", step,
                watched, self.recent_norms.maxlen, total_norm, total_norm / watched, ratio, self.factor)

    def ratio_for(self, setting: float | str) -> float | None:
        """The ratio above which a jump is an overshoot under `setting`; None: not watching ("off", or "auto" while
        the windows are the configured ones)."""
        if setting == "off" or (setting == "auto" and not self.high_lr):
            return None
        return HOST_STEP_GUARD_RATIO if setting == "auto" else float(setting)

    def factor_for(self, setting: float | str) -> float:
        """The factor on the host lr under the configured `setting`: 1.0 when "off" (also after the guard engaged
        under an earlier setting: "off" means the configured host step)."""
        return 1.0 if setting == "off" else self.factor

    def closed(self, scales: list[float], high_lr_window: int | None = None) -> None:
        """A window closed with these `host_lr_scale` multipliers (one per param group with host state), its length
        shortened by `high_lr_rule` to `high_lr_window` steps (None: the configured windows)."""
        if scales:
            self.scale = max(scales)
        self.high_lr = high_lr_window is not None

    def wrote_back(self) -> None:
        """A host result went into the weights: the next gradient is the first to see it."""
        if self.recent_norms:
            # (the norms of the steps before it, this write-back's window among them: their spread is the noise)
            self.watch_norm = max(self.recent_norms)

    def forget_write_back(self) -> None:
        """A write-back that is not a host step's window (a warm-up step, plain AdamW): not watched."""
        self.watch_norm = None

    def state(self) -> dict[str, Any]:
        return {"factor": self.factor, "engaged": self.engaged, "scale": self.scale, "high_lr": self.high_lr,
                "last_norm": self.last_norm, "recent_norms": list(self.recent_norms), "watch_norm": self.watch_norm}

    def load(self, state: dict[str, Any]) -> None:
        """A checkpoint's `state()` (validated by `check_state`)."""
        self.factor = float(state["factor"])
        self.engaged = int(state["engaged"])
        self.scale = float(state["scale"])
        self.high_lr = bool(state.get("high_lr", False))  # (a checkpoint from before "auto": set at the next close)
        # (a checkpoint from before the history has the last norm alone)
        recent = state.get("recent_norms", [] if state["last_norm"] is None else [state["last_norm"]])
        self.recent_norms.clear()
        self.recent_norms.extend(float(norm) for norm in recent)
        self.watch_norm = None if state["watch_norm"] is None else float(state["watch_norm"])


def check_state(state: Any) -> str | None:
    """What is wrong with a checkpoint's guard state (None: nothing)."""
    keys, optional = {"factor", "engaged", "scale", "last_norm", "watch_norm"}, {"high_lr", "recent_norms"}
    if not isinstance(state, dict) or not keys <= set(state) <= keys | optional:
        return (f"host_step_guard={state!r} is invalid, expected a dict of factor, engaged, scale, last_norm, "
                "watch_norm, and optionally high_lr, recent_norms")
    if not isinstance(state.get("high_lr", False), bool):
        return f"host_step_guard high_lr={state['high_lr']!r} is invalid, expected a bool"
    factor, engaged = state["factor"], state["engaged"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not HOST_STEP_GUARD_MIN_FACTOR <= factor <= 1:
        return f"host_step_guard factor={factor!r} is invalid, expected a float in [{HOST_STEP_GUARD_MIN_FACTOR}, 1]"
    if isinstance(engaged, bool) or not isinstance(engaged, int) or engaged < 0:
        return f"host_step_guard engaged={engaged!r} is invalid, expected an integer >= 0"
    scale = state["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        return f"host_step_guard scale={scale!r} is invalid, expected a finite float > 0"
    for key in ("last_norm", "watch_norm"):
        norm = state[key]
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not math.isfinite(norm) or norm < 0):
            return f"host_step_guard {key}={norm!r} is invalid, expected a finite float >= 0 or None"
    recent = state.get("recent_norms", [])
    if not isinstance(recent, list) or any(isinstance(norm, bool) or not isinstance(norm, (int, float))
                                           or not math.isfinite(norm) or norm < 0 for norm in recent):
        return f"host_step_guard recent_norms={recent!r} is invalid, expected a list of finite floats >= 0"
    return None


__all__ = ["HostStepGuard", "check_state"]
