"""``writeback_lag="auto"``: how soon a window's host result goes into the weights, decided once per run from what
does not change from one run of a script to the next, so that the same script and seed give the same weights.

The decision is made at the first step, once the optimizer knows which matrices have host columns: one step of lag
per `AUTO_LAG_HOST_ELEMENTS` elements of host columns on this rank (rounded up), at least 1 and at most the window
(`auto_lag_from_sizes`). The host AdamW's time grows with those elements, and a window's result written back sooner
keeps the unselected columns fresher: a model under about two billion offloaded parameters per rank is written back
one step into the next window, a 7B model with most of its columns on the host of one rank three steps in (with
four-step windows). Several ranks take the largest of their choices, agreed at the same step on every rank, so
their write-back collectives stay in step. The choice is logged, part of the schedule (`stats()`, checkpoints; a
resumed run continues with it), and an integer rule `writeback_lag` (`ZenFlowConfig.with_rules`) replaces it.

Times are measured too, but only to advise: after the second window the measured host step and time between steps
give the smallest lag that would hold the host step with 25% to spare (`schedule.auto_writeback_lag`); when it
differs from the choice, a log line names the rule that would use it. The run's arithmetic never depends on it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from .schedule import AUTO_LAG_HOST_ELEMENTS, WindowSchedule, auto_writeback_lag, lag_for_host_elements


if TYPE_CHECKING:
    from ..settings.config import ZenFlowConfig
    from .windows import HostWindows

logger = logging.getLogger("hf_zenflow")



def auto_lag_from_sizes(host_elements: int, longest: int) -> int:
    """The write-back lag `"auto"` takes for `host_elements` elements of host columns on this rank and windows of at
    most `longest` steps.

    Example:
        >>> auto_lag_from_sizes(0, 4), auto_lag_from_sizes(10**9, 4), auto_lag_from_sizes(6 * 10**9, 4)
        (1, 1, 3)
    """
    return lag_for_host_elements(host_elements, longest)



def host_elements(host: HostWindows) -> int:
    """Elements of host columns (host masters) on this rank."""
    return sum(split.host.master.numel() for split in host.splits.values() if split.host is not None)


class AutoWritebackLag:
    """Decides the run's write-back lag at its first step (`maybe_choose`), and measures the time between optimizer
    steps for the advice logged after the second window (`maybe_advise`)."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._advised = False
        self.intervals_ms: deque[float] = deque(maxlen=32)

    def tick(self) -> None:
        """Called at the start of every `step()`: the interval since the previous one is a whole training step
        (forward, backward, and on CUDA the device time the step's one sync waited for)."""
        now = time.perf_counter()
        if self._last is not None:
            self.intervals_ms.append((now - self._last) * 1e3)
        self._last = now

    def maybe_choose(self, config: ZenFlowConfig, schedule: WindowSchedule, host: HostWindows) -> None:
        """Fix the schedule's lag when ``"auto"`` has not chosen yet (called once the step's state exists, before
        any window closes; every rank reaches it at the same step)."""
        if not schedule.writeback_lag_pending:
            return
        longest = schedule.update_interval or schedule.auto_max_interval
        elements = host_elements(host)
        lag = auto_lag_from_sizes(elements, longest)
        if host.reduce_group.ranks > 1:
            # every rank reaches this at the same step; one-hot counts summed, the largest lag chosen by any rank wins
            device = next(iter(host.splits)).device if host.splits else torch.device("cpu")
            votes = torch.zeros(longest + 1, device=device)
            votes[lag] = 1.0
            host.reduce_group.all_reduce_sum([votes], "writeback_lag agreement")
            lag = int(votes.nonzero().max())
        schedule.writeback_lag, schedule.writeback_lag_pending = lag, False
        if config.overlap_step:
            logger.info('hf_zenflow: writeback_lag="auto" chose %d step(s) of %d for %d elements of host columns '
                        "(one step per %d; the rule writeback_lag=N of ZenFlowConfig.with_rules sets it)", lag,
                        longest, elements, AUTO_LAG_HOST_ELEMENTS)

    def maybe_advise(self, config: ZenFlowConfig, schedule: WindowSchedule, host: HostWindows) -> None:
        """After the second overlapped window with an ``"auto"`` lag: log the lag the measured times would allow
        when it differs from the choice (advice only; the schedule keeps its lag)."""
        if self._advised or config.rules.writeback_lag != "auto" or not config.overlap_step:
            return
        if schedule.steps <= schedule.warm_up:
            # dense warm-up steps close a synchronous window each and wait for the host: neither their windows nor
            # their step times say anything about the overlapped schedule
            self.intervals_ms.clear()
            return
        if schedule.windows - schedule.warm_up < 2 or schedule.writeback_lag is None:
            return
        self._advised = True
        longest = schedule.update_interval or schedule.auto_max_interval
        host_ms = host.worker.last_job_ms.get("host_adamw", 0.0) if host.worker is not None else 0.0
        step_ms = statistics.median(self.intervals_ms) if self.intervals_ms else 0.0
        measured = auto_writeback_lag(host_ms, step_ms, longest)
        if measured != schedule.writeback_lag:
            logger.info('hf_zenflow: writeback_lag="auto" keeps %d step(s); this machine\'s measured host step '
                        "(%.1f ms) and step (%.1f ms) would allow writeback_lag=%d (a study can fix it with "
                        "ZenFlowConfig.with_rules: results then depend on that rule only)", schedule.writeback_lag,
                        host_ms, step_ms, measured)
