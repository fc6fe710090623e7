"""``writeback_lag="auto"``: how soon a window's host result can go into the weights without the device waiting,
chosen once per run from measured times.

The first window is written back one step into the second (early training moves fastest, and a stale update costs
most there); the device waits for that host step if it is not done, once. When the second window closes, the first
window's host step has been measured: its time and the median time between optimizer steps so far give the smallest
lag whose device time holds a host step with 25% to spare (`schedule.auto_writeback_lag`). From then on the schedule
writes each result back that many steps into the next window. The choice is part of the schedule: `stats()` reports
it, checkpoints keep it, and a resumed run continues with it (an integer `writeback_lag` makes runs reproducible
across machines). Several ranks take the largest of their choices, agreed at the same step on every rank, so their
write-back collectives stay in step.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from .schedule import WindowSchedule, auto_writeback_lag


if TYPE_CHECKING:
    from ..settings.config import ZenFlowConfig
    from .windows import HostWindows

logger = logging.getLogger("hf_zenflow")


class AutoWritebackLag:
    """Measures the time between optimizer steps and picks the run's write-back lag at the second window close."""

    def __init__(self) -> None:
        self._last: float | None = None
        self.intervals_ms: deque[float] = deque(maxlen=32)

    def tick(self) -> None:
        """Called at the start of every `step()`: the interval since the previous one is a whole training step
        (forward, backward, and on CUDA the device time the step's one sync waited for)."""
        now = time.perf_counter()
        if self._last is not None:
            self.intervals_ms.append((now - self._last) * 1e3)
        self._last = now

    def maybe_choose(self, config: ZenFlowConfig, schedule: WindowSchedule, host: HostWindows) -> None:
        """Fix the schedule's lag when it is due (``"auto"`` not chosen yet, overlapped, two windows closed after
        the warm-up)."""
        if not schedule.writeback_lag_pending or not config.overlap_step:
            return
        if schedule.steps <= schedule.warm_up:
            # dense warm-up steps close a synchronous window each and wait for the host: neither their windows nor
            # their step times say anything about the overlapped schedule
            self.intervals_ms.clear()
            return
        if schedule.windows - schedule.warm_up < 2:
            return
        longest = schedule.update_interval or schedule.auto_max_interval
        host_ms = host.worker.last_job_ms.get("host_adamw", 0.0) if host.worker is not None else 0.0
        step_ms = statistics.median(self.intervals_ms) if self.intervals_ms else 0.0
        lag = auto_writeback_lag(host_ms, step_ms, longest)
        if host.reduce_group.ranks > 1:
            # every rank reaches this at the same step; one-hot counts summed, the largest lag chosen by any rank wins
            device = next(iter(host.splits)).device if host.splits else torch.device("cpu")
            votes = torch.zeros(longest + 1, device=device)
            votes[lag] = 1.0
            host.reduce_group.all_reduce_sum([votes], "writeback_lag agreement")
            lag = int(votes.nonzero().max())
        schedule.writeback_lag, schedule.writeback_lag_pending = lag, False
        logger.info("hf_zenflow: writeback_lag=\"auto\" chose %d step(s) of %d (host step %.1f ms, step %.1f ms)",
                    lag, longest, host_ms, step_ms)
