"""How hf_zenflow shares the CPU cores between the training thread and the host worker (README, *Threads*).

The rule, in one place:

- **cores** = the CPUs in this process's affinity (`available_cpu_count`; taskset and cgroup cpusets count,
  `os.cpu_count()` does not); with several ranks on one node (``LOCAL_WORLD_SIZE``, set by torchrun and accelerate)
  whose affinity is the whole machine, this rank's 1/N of them (`rank_cpu_count`; a launcher that pins each rank to
  its own cores has split them already);
- the **host worker** runs ``cpu_threads`` intra-op threads: by default half the cores, at least 1; a value above
  the cores is clamped to them, with a warning (`worker_threads`);
- while a **background** worker exists (``overlap_step=True``), the **training thread**'s intra-op pool is lowered
  to the cores the workers leave (cores minus their threads, at least 1). It is never raised, and it is left
  alone when the user has chosen it: ``OMP_NUM_THREADS`` is set, or ``torch.set_num_threads`` was called after
  ``import hf_zenflow`` (the pool differs from the size torch had then). Its previous size comes back when the
  last worker stops (`worker_started` / `worker_stopped`);
- the split is reported once per process (per distinct split) as a warning of the ``hf_zenflow.threads`` logger.

Why: the worker's host jobs run while the training thread runs forward/backward, and torch's OpenMP threads
spin-wait; two teams sharing the same cores were measured to make a host step >100x slower on a busy 2-core
machine. Torch's thread count is per OS thread, so lowering the training thread's pool leaves the worker's alone.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

import torch


logger = logging.getLogger(__name__)

#: The training thread's pool as this module found it (at ``import hf_zenflow``): a pool still at this size was not
#: chosen by the user.
_TORCH_THREADS_AT_IMPORT = torch.get_num_threads()


def available_cpu_count() -> int:
    """Cores this process may run on: its CPU affinity, not `os.cpu_count()` (which ignores taskset/cgroups)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS/Windows have no sched_getaffinity
        return max(1, os.cpu_count() or 1)


def rank_cpu_count() -> int:
    """The cores this process may use for itself: its affinity, divided among the ranks on this node when every
    rank's affinity is the whole machine (see the module docstring)."""
    cores = available_cpu_count()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    if local > 1 and cores >= (os.cpu_count() or cores):
        return max(1, cores // local)
    return cores


_clamp_warned: set[tuple[int, int]] = set()


def worker_threads(cpu_threads: int | None) -> int:
    """The host worker's thread count for a ``cpu_threads`` setting: the setting clamped to the cores (with a
    warning, once per value), or half the cores when it is None.

    Example:
        >>> worker_threads(None) == max(1, available_cpu_count() // 2)
        True
        >>> worker_threads(1)
        1
    """
    cores = rank_cpu_count()
    if cpu_threads is None:
        return max(1, cores // 2)
    if cpu_threads > cores:
        if (cpu_threads, cores) not in _clamp_warned:
            _clamp_warned.add((cpu_threads, cores))
            warnings.warn(
                f"hf_zenflow: cpu_threads={cpu_threads} is more than the {cores} core(s) in this process's CPU "
                f"affinity (its share of them with several ranks per node); the host worker uses {cores} (README, "
                "Threads).",
                stacklevel=3,
            )
        return cores
    return cpu_threads


class _TrainingPool:
    """The training thread's intra-op pool while background workers run: lowered when the first starts, adjusted
    as workers come and go, restored when the last stops. Only the thread that started the first worker (the
    training thread: workers start inside `step()`) is ever changed, and a size the user set meanwhile is kept."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: dict[int, int] = {}  # id(worker) -> its threads
        self.thread: int | None = None  # ident of the training thread
        self.before = 0  # its pool before the first worker
        self.user_set = False  # the user chose that pool: leave it alone
        self.applied = 0  # the size set here last (0: none)
        self.announced: set[tuple[int, int, int, str]] = set()

    def _apply(self) -> None:
        if self.thread != threading.get_ident() or self.user_set:
            return
        current = torch.get_num_threads()
        if self.applied and current != self.applied:
            return  # changed by the user since: theirs stands
        taken = sum(self.workers.values())
        target = min(self.before, max(1, rank_cpu_count() - taken)) if self.workers else self.before
        if current != target:
            torch.set_num_threads(target)
        self.applied = target if self.workers else 0

    def started(self, key: object, threads: int) -> None:
        with self.lock:
            if not self.workers:
                self.thread, self.before, self.applied = threading.get_ident(), torch.get_num_threads(), 0
                self.user_set = "OMP_NUM_THREADS" in os.environ or self.before != _TORCH_THREADS_AT_IMPORT
            self.workers[id(key)] = threads
            self._apply()
            self._announce(threads)

    def stopped(self, key: object) -> None:
        with self.lock:
            if self.workers.pop(id(key), None) is None:
                return
            self._apply()
            if not self.workers:
                self.thread = None

    def _announce(self, threads: int) -> None:
        cores, training = rank_cpu_count(), torch.get_num_threads()
        omp = os.environ.get("OMP_NUM_THREADS")
        if omp is not None:
            why = f"OMP_NUM_THREADS={omp}, left alone"
        elif self.user_set:
            why = "set with torch.set_num_threads, left alone"
        elif training < self.before:
            why = f"lowered from {self.before} while the worker runs"
        else:
            why = "torch's default"
        split = (cores, threads, training, why)
        if split in self.announced:
            return
        self.announced.add(split)
        total = threads + training
        logger.warning(
            "hf_zenflow threads: %d core(s) in this process's affinity; host worker %d thread(s), training thread %d "
            "(%s)%s. On a machine busy with other processes use fewer (e.g. OMP_NUM_THREADS=1 and cpu_threads=1): "
            "README, Threads.",
            cores, threads, training, why, f"; together {total} > {cores} cores" if total > cores else "",
        )


_POOL = _TrainingPool()


def worker_started(worker: object, threads: int) -> None:
    """A background host worker with `threads` threads starts; call from the training thread."""
    _POOL.started(worker, threads)


def worker_stopped(worker: object) -> None:
    """The worker stopped: give the training thread its cores back (once no worker is left, its former size)."""
    _POOL.stopped(worker)
