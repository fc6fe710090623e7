"""Was the machine busy while `hf-zenflow compare` ran? Other processes' CPU use, CPU steal and the load average.

Timings on a shared machine are only comparable when the runs were equally (un)disturbed, so the runner reads, for
each optimizer's run and for the whole command:

* **other processes' CPU** - the non-idle time of the CPUs this process may run on (``/proc/stat``, per CPU) minus
  this process's own CPU time, per second of wall time: the mean number of cores someone else used. The load average
  cannot tell this: on a 2-core machine the run's own training thread, torch's intra-op threads and the host worker
  already keep it at 2-3;
* **steal** - the share of those CPUs' time the hypervisor gave to other virtual machines;
* **the 1-minute load average** before the command started (others only) and its maximum during the run (a sampler
  thread reads ``/proc/loadavg`` every couple of seconds; it includes this run's threads).

The CPU figures are differences of cumulative counters, so two readings give the exact mean over an interval; the
sampler thread only catches the load average's peak. Where ``/proc`` is missing (macOS, Windows) every figure is None
and nothing is reported as busy.

Example:
    >>> monitor = LoadMonitor(interval_s=0.05)
    >>> monitor.start()
    >>> since = monitor.reading()
    >>> report = monitor.report(since)
    >>> monitor.stop()
    >>> isinstance(report.busy_reasons(), list)
    True
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hf_zenflow.settings.threads import available_cpu_count


#: Other processes using at least this share of the available cores make a run "busy".
BUSY_OTHERS_FRACTION = 0.10
#: CPU steal at or above this share of the CPU time makes a run "busy".
BUSY_STEAL_FRACTION = 0.02

PROC_STAT = Path("/proc/stat")
PROC_LOADAVG = Path("/proc/loadavg")


@dataclass(frozen=True)
class CpuReading:
    """Cumulative CPU counters at one instant, summed over the CPUs this process may run on (seconds)."""

    wall: float  # time.monotonic()
    busy_s: float | None  # user + nice + system + irq + softirq (guest time is inside user)
    total_s: float | None  # busy + idle + iowait + steal
    steal_s: float | None
    own_s: float  # this process's user + system time, all its threads (its children are "others")
    loadavg_1m: float | None


@dataclass(frozen=True)
class LoadReport:
    """How busy the machine was over one interval (a run, or the whole command)."""

    seconds: float
    cores: int  # CPUs this process may run on
    others_cores: float | None  # mean cores used by other processes
    steal_fraction: float | None
    loadavg_before: float | None  # 1-minute load average before the interval (None where it would count this run)
    loadavg_max: float | None  # highest 1-minute load average sampled during the interval (includes this run)

    def busy_reasons(self) -> list[str]:
        """Why the interval's timings are disturbed; empty when the machine was quiet.

        Example:
            >>> LoadReport(60.0, 2, 0.5, 0.0, None, 3.1).busy_reasons()
            ['other processes used 0.50 of the 2 cores on average']
        """
        reasons = []
        if self.others_cores is not None and self.others_cores >= BUSY_OTHERS_FRACTION * self.cores:
            reasons.append(f"other processes used {self.others_cores:.2f} of the {self.cores} cores on average")
        if self.steal_fraction is not None and self.steal_fraction >= BUSY_STEAL_FRACTION:
            reasons.append(f"the hypervisor took {100 * self.steal_fraction:.1f} % of the CPU time (steal)")
        if self.loadavg_before is not None and self.loadavg_before >= self.cores:
            reasons.append(f"the 1-minute load average was {self.loadavg_before:.2f} on {self.cores} cores before "
                           "the run started")
        return reasons

    def short(self) -> str:
        """One table cell: ``"0.12 cores, steal 0.0 %"``."""
        if self.others_cores is None:
            return "n/a"
        steal = "n/a" if self.steal_fraction is None else f"{100 * self.steal_fraction:.1f} %"
        return f"{self.others_cores:.2f} cores, steal {steal}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "busy": bool(self.busy_reasons()), "busy_reasons": self.busy_reasons()}


def affinity_cpus() -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS/Windows
        return None


def parse_proc_stat(text: str, cpus: list[int] | None, ticks_per_s: float) -> tuple[float, float, float] | None:
    """(busy, total, steal) seconds summed over `cpus` (all CPUs when None) from the text of ``/proc/stat``.

    Example:
        >>> parse_proc_stat("cpu  9 0 1 80 0 0 0 10 0 0\\ncpu0 4 0 1 40 0 0 0 5\\ncpu1 5 0 0 40 0 0 0 5\\n",
        ...                 [1], 100.0)
        (0.05, 0.5, 0.05)
    """
    wanted = None if cpus is None else {f"cpu{c}" for c in cpus}
    busy = total = steal = 0.0
    found = False
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            continue
        if (wanted is None and fields[0] != "cpu") or (wanted is not None and fields[0] not in wanted):
            continue
        user, nice, system, idle, iowait, irq, softirq, stolen = (float(v) for v in (fields[1:9] + ["0"] * 8)[:8])
        busy += user + nice + system + irq + softirq
        total += user + nice + system + idle + iowait + irq + softirq + stolen
        steal += stolen
        found = True
    if not found:
        return None
    return busy / ticks_per_s, total / ticks_per_s, steal / ticks_per_s


def read_loadavg() -> float | None:
    try:
        return float(PROC_LOADAVG.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def take_reading() -> CpuReading:
    """The counters now."""
    times = os.times()
    own = times.user + times.system  # this process only: os.times() keeps children apart
    stat = None
    try:
        stat = parse_proc_stat(PROC_STAT.read_text(), affinity_cpus(), float(os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, AttributeError):
        pass
    busy, total, steal = stat if stat is not None else (None, None, None)
    return CpuReading(time.monotonic(), busy, total, steal, own, read_loadavg())


def load_between(start: CpuReading, end: CpuReading, cores: int, loadavg_max: float | None = None,
                 loadavg_before: float | None = None) -> LoadReport:
    """The load report of the interval between two readings.

    Example:
        >>> a = CpuReading(wall=0.0, busy_s=0.0, total_s=0.0, steal_s=0.0, own_s=0.0, loadavg_1m=1.0)
        >>> b = CpuReading(wall=10.0, busy_s=15.0, total_s=20.0, steal_s=0.0, own_s=10.0, loadavg_1m=2.0)
        >>> load_between(a, b, cores=2).others_cores  # 15 busy core-seconds, 10 of them ours, over 10 s
        0.5
    """
    seconds = max(1e-9, end.wall - start.wall)
    others = steal = None
    if None not in (start.busy_s, end.busy_s, start.total_s, end.total_s):
        others = max(0.0, (end.busy_s - start.busy_s) - (end.own_s - start.own_s)) / seconds
        total = end.total_s - start.total_s
        steal = (end.steal_s - start.steal_s) / total if total > 0 else 0.0
    peak = max((v for v in (start.loadavg_1m, end.loadavg_1m, loadavg_max) if v is not None), default=None)
    return LoadReport(seconds=seconds, cores=cores, others_cores=others, steal_fraction=steal,
                      loadavg_before=loadavg_before, loadavg_max=peak)


class LoadMonitor:
    """A daemon thread sampling the 1-minute load average; `report(since)` gives the load since a reading."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.cores = available_cpu_count()
        self._samples: list[tuple[float, float]] = []  # (monotonic time, 1-minute load average)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.first: CpuReading | None = None

    def start(self) -> None:
        self.first = take_reading()
        self._thread = threading.Thread(target=self._sample, name="compare-load-monitor", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            value = read_loadavg()
            if value is not None:
                self._samples.append((time.monotonic(), value))

    def reading(self) -> CpuReading:
        return take_reading()

    def report(self, since: CpuReading, until: CpuReading | None = None,
               loadavg_before: float | None = None) -> LoadReport:
        until = until or take_reading()
        peak = max((v for t, v in list(self._samples) if since.wall <= t <= until.wall), default=None)
        return load_between(since, until, self.cores, loadavg_max=peak, loadavg_before=loadavg_before)

    def whole_run(self) -> LoadReport:
        """Since `start()`; the load average before the start counts only other processes' work."""
        assert self.first is not None, "LoadMonitor.start() was not called"
        return self.report(self.first, loadavg_before=self.first.loadavg_1m)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
