"""What a run decides and says once, at its first step: ``writeback_lag="auto"``'s lag (`writeback_lag.py`), and the
log lines about ``high_lr_rule="auto"``'s choice (`params.announce_high_lr_rule`), what is offloaded
(`offload_report.announce_offload`) and what ``device_memory_limit_bytes`` chose (`planner.announce_limit`).

A run is a schedule's life: a new optimizer's, or the one a loaded checkpoint restores. A resumed run therefore
decides and says it again at its first step, about what it restored. Nothing here runs on later steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .offload_report import announce_offload
from .params import announce_high_lr_rule
from .planner import announce_limit


if TYPE_CHECKING:
    from ..settings.config import ZenFlowConfig
    from .schedule import WindowSchedule
    from .windows import HostWindows
    from .writeback_lag import AutoWritebackLag


class RunStart:
    """The once-per-run decisions and announcements (`at_first_step`), made once for each schedule: a new schedule
    object (a new optimizer's, or the one a loaded checkpoint restores into) is a new run."""

    def __init__(self) -> None:
        self._made_for: WindowSchedule | None = None

    def at_first_step(self, schedule: WindowSchedule, config: ZenFlowConfig, groups: list[dict[str, Any]],
                      host: HostWindows, auto_lag: AutoWritebackLag, copies_lag: Callable[[], bool]) -> None:
        """At the run's first step, once its state exists and before any window closes (every rank reaches it at the
        same step): ``"auto"``'s lag is fixed from the host columns' sizes, then the run's choices are logged;
        `copies_lag`: whether the gradients' copies to the host may lag backward (`planner.announce_limit`). Later
        calls return at once."""
        if schedule is self._made_for:
            return
        auto_lag.maybe_choose(config, schedule, host)
        announce_high_lr_rule(schedule, config, groups)
        announce_offload(groups, config, schedule)
        if schedule.limit_min_offload_numel is not None:  # (a resumed run says what it restored)
            announce_limit(groups, config, schedule.limit_min_offload_numel, host.backward.free_kind is not None,
                           host.accumulate_on, copies_lag())
        self._made_for = schedule


__all__ = ["RunStart"]
