"""Was the machine busy while `hf-zenflow compare` ran? Other processes' CPU use, CPU steal and the load average.

Timings on a shared machine are only comparable when the runs were equally (un)disturbed, so the runner reads, for
each optimizer's run and for the whole command:

* **other processes' CPU** - the non-idle time of the CPUs this process may run on (`psutil.cpu_times`, per CPU)
  minus this process's own CPU time, per second of wall time: the mean number of cores someone else used. The load
  average cannot tell this: on a small machine the run's own training thread, torch's intra-op threads and the host
  worker already keep it above the core count;
* **steal** - the share of those CPUs' time the hypervisor gave to other virtual machines (Linux; 0 elsewhere);
* **the 1-minute load average** before the command started (others only) and its maximum during the run (a sampler
  thread reads `psutil.getloadavg` every couple of seconds; it includes this run's threads).

The CPU figures are differences of cumulative counters, so two readings give the exact mean over an interval; the
sampler thread only catches the load average's peak. Where psutil cannot read a figure it is None, and nothing is
reported as busy for it.

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
from typing import Any

import psutil

from hf_zenflow.settings.threads import available_cpu_count


#: Other processes using at least this share of the available cores make a run "busy".
BUSY_OTHERS_FRACTION = 0.10
#: CPU steal at or above this share of the CPU time makes a run "busy".
BUSY_STEAL_FRACTION = 0.02


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


def cpu_seconds(cpus: list[int] | None) -> tuple[float, float, float] | None:
    """(busy, total, steal) seconds since boot summed over `cpus` (all CPUs when None), from `psutil.cpu_times`."""
    try:
        per_cpu = psutil.cpu_times(percpu=True)
    except (OSError, AttributeError, NotImplementedError):
        return None
    chosen = [per_cpu[c] for c in cpus if c < len(per_cpu)] if cpus is not None else per_cpu
    if not chosen:
        return None
    busy = total = steal = 0.0
    for times in chosen:
        stolen = getattr(times, "steal", 0.0)
        idle = times.idle + getattr(times, "iowait", 0.0)
        busy_here = sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
        busy += busy_here  # (guest time is inside user)
        total += busy_here + idle + stolen
        steal += stolen
    return busy, total, steal


def read_loadavg() -> float | None:
    try:
        return float(psutil.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def take_reading() -> CpuReading:
    """The counters now."""
    times = os.times()
    own = times.user + times.system  # this process only: os.times() keeps children apart
    busy, total, steal = cpu_seconds(affinity_cpus()) or (None, None, None)
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
