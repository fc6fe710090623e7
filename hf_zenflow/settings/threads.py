"""How hf_zenflow shares the CPU cores between the training thread and the host worker (docs/threads.md).

The rule, in one place:

- **cores** = the CPUs given to this process (`rank_cpu_count`): its affinity (`available_cpu_count`; taskset and
  cgroup cpusets count, `os.cpu_count()` does not); with several ranks on one node (``LOCAL_WORLD_SIZE``, set by
  torchrun and accelerate) whose launcher did not pin each rank to cores of its own (this process's affinity is
  its parent's), this rank's 1/N of them;
- the **host worker** runs ``cpu_threads`` intra-op threads: by default half the cores, at least 1; a value above
  the cores is clamped to them, with a warning (`worker_threads`);
- the **training thread**'s intra-op pool is decided **once per run, before its first forward**: when an optimizer
  that will offload something with a background worker is built (`claim_cores`: ``overlap_step=True``, some
  trainable matrix above ``min_offload_numel`` with columns on the host), the pool is lowered to the cores the
  workers leave (cores minus their threads, at least 1), and it stays so until that optimizer is closed
  (`release_cores`: the end of the run; the worker starting, stopping or restarting in between changes nothing).
  ``OMP_NUM_THREADS`` (what launchers set) is a ceiling like torch's default, not a pin: it is lowered too, so the
  worker and the training thread fit the process's cores. A pool set with ``torch.set_num_threads`` after
  ``import hf_zenflow`` (it differs from the size torch had then) is the user's and is never changed. A run that
  offloads nothing claims nothing: no worker thread, no change;
- the split is reported once per process (per distinct split) as a warning of this module's logger
  (``hf_zenflow.settings.threads``).

Why once: a CPU forward/backward's rounding depends on its thread count, and a resumed run must repeat the
uninterrupted one bit for bit; a pool that changed when the worker started (inside the first `step()`) gave the
resumed run's first forward another count than the uninterrupted run's at that step. The optimizer is built before
the first forward in both runs (the Trainer builds it in ``train()``, after the model and before the first step).
Why split at all: the worker's host jobs run while the training thread runs forward/backward, and torch's OpenMP
threads spin-wait: two teams sharing the same cores slow each other down many times over. Torch's thread count is
per OS thread, so lowering the training thread's pool leaves the worker's alone.
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


def _affinity(pid: int) -> set[int] | None:
    try:
        return set(os.sched_getaffinity(pid))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS/Windows), or the process is gone
        return None


def rank_cpu_count() -> int:
    """The cores given to this process: its affinity, divided among the ranks on this node (``LOCAL_WORLD_SIZE``)
    unless the launcher pinned each rank to cores of its own.

    Pinned is told by the parent (the launcher: torchrun's agent, ``accelerate launch``, an MPI proxy): a rank whose
    affinity is a strict subset of its parent's was given its own cores; one with its parent's whole affinity (no
    pinning; a container's cpuset or a ``taskset`` around the whole job included) shares it with the other ranks.
    Where the parent's affinity cannot be read, a rank whose affinity is the whole machine counts as not pinned.
    """
    cores = available_cpu_count()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    if local == 1:
        return cores
    mine, parent = _affinity(0), _affinity(os.getppid())
    pinned = mine < parent if mine is not None and parent is not None else cores < (os.cpu_count() or cores)
    return cores if pinned else max(1, cores // local)


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
                f"affinity (its share of them with several ranks per node); the host worker uses {cores} "
                "(docs/threads.md).",
                stacklevel=3,
            )
        return cores
    return cpu_threads


class _TrainingPool:
    """The training thread's intra-op pool and the claims on the cores (`claim_cores`): lowered at the first claim,
    never changed while a claim remains, restored when the last is released. Only the thread that made the first
    claim (the one that built the optimizer: the training thread) is changed, and a size the user set is kept."""

    def __init__(self) -> None:
        # re-entrant: garbage collection may run an unreachable optimizer's `close()` (its `__del__`, which releases
        # its claim) on this thread while it holds the lock inside `claim` (the announcement allocates)
        self.lock = threading.RLock()
        self.claims: dict[int, int] = {}  # id(owner) -> its worker's threads
        self.thread: int | None = None  # ident of the training thread
        self.before = 0  # its pool before the first claim
        self.user_set = False  # the user chose that pool: leave it alone
        self.applied = 0  # the size set here (0: none)
        self.announced: set[tuple] = set()

    def claim(self, owner: object, threads: int) -> None:
        with self.lock:
            if id(owner) in self.claims:
                return  # decided once: a claim is never revised while it holds
            if not self.claims:
                self.thread, self.before, self.applied = threading.get_ident(), torch.get_num_threads(), 0
                self.user_set = self.before != _TORCH_THREADS_AT_IMPORT
            self.claims[id(owner)] = threads
            self._lower()
            self._announce(threads, claimed=True)

    def _lower(self) -> None:
        if self.thread != threading.get_ident() or self.user_set:
            return
        current = torch.get_num_threads()
        if self.applied and current != self.applied:
            return  # changed by the user since: theirs stands
        target = min(current, max(1, rank_cpu_count() - sum(self.claims.values())))  # never raised
        if current != target:
            torch.set_num_threads(target)
        self.applied = target

    def release(self, owner: object) -> None:
        with self.lock:
            if self.claims.pop(id(owner), None) is None or self.claims:
                return  # (others still claim: their runs go on with the pool they started with)
            if self.thread == threading.get_ident() and self.applied and torch.get_num_threads() == self.applied:
                torch.set_num_threads(self.before)
            self.thread, self.applied = None, 0

    def worker_started(self, threads: int) -> None:
        with self.lock:
            if not self.claims:  # a worker nobody planned for (something offloaded after all): nothing changes
                self._announce(threads, claimed=False)

    def _announce(self, threads: int, claimed: bool) -> None:
        cores, training = rank_cpu_count(), torch.get_num_threads()
        omp = os.environ.get("OMP_NUM_THREADS")
        if not claimed:
            why = "kept: the worker was not planned when the optimizer was built"
        elif self.user_set:
            why = "set with torch.set_num_threads, kept"
        elif training < self.before:
            why = f"lowered from {self.before}" + (f" (OMP_NUM_THREADS={omp})" if omp is not None else "")
        else:
            why = f"OMP_NUM_THREADS={omp}" if omp is not None else "torch's default"
        split = (cores, threads, training, why)
        if split in self.announced:
            return
        self.announced.add(split)
        total = threads + training
        if total <= cores:
            fit = ""
        elif total == 2:  # one core: a single-threaded worker beside a single-threaded training thread, no team spins
            fit = "; one thread each on 1 core (the least an overlapped worker takes)"
        else:
            fit = f"; together {total} > {cores} cores"
        logger.warning(
            "hf_zenflow threads: %d core(s) for this process; host worker %d thread(s), training thread %d (%s, until "
            "the end of the run)%s. On a machine busy with other processes use fewer (e.g. OMP_NUM_THREADS=1 and "
            "cpu_threads=1): docs/threads.md.",
            cores, threads, training, why, fit,
        )


_POOL = _TrainingPool()


def claim_cores(owner: object, threads: int) -> None:
    """`owner` (an optimizer's host side) will run a background worker of `threads` threads: the training thread's
    pool is lowered now to the cores left (the once-per-run decision; call from the training thread, before the
    first forward). Idempotent."""
    _POOL.claim(owner, threads)


def release_cores(owner: object) -> None:
    """The end of `owner`'s run (its optimizer closed): once no claim is left, the training thread gets its former
    pool back."""
    _POOL.release(owner)


def worker_started(threads: int) -> None:
    """A background host worker of `threads` threads starts: reported when no claim planned for it (the pool is not
    changed then either)."""
    _POOL.worker_started(threads)
