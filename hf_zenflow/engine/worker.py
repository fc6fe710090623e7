"""`HostAdamWorker`: runs the host jobs (gradient accumulation, the host AdamW) in order, on a background thread or
inline, and carries a failure into the training thread; `GradSlot`, a hand-off slot returned exactly once;
`WorkerKeeper`, the life of one optimizer's worker (started when a step needs it, stopped, its failure kept, the
cores claimed for it).

Every wait of the caller is bounded and names what it waits for (`waits.bounded_wait`), and notices a dead worker;
a Ctrl-C never waits for a long host job (see `HostAdamWorker.close`).
"""

from __future__ import annotations

import atexit
import collections
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import torch

from .._base import torch_threads
from ..settings.threads import claim_cores, release_cores, worker_started
from ..transport.link import device_wait_ms
from .host import GRAD_SLOTS
from .waits import HostWorkerError, bounded_wait


__all__ = ["GradSlot", "HostAdamWorker", "HostWorkerError", "WorkerKeeper", "bounded_wait", "wait_for_closed_workers"]


class Gate:
    """What held jobs wait for before they start: the end of the caller's `step()` (`HostAdamWorker.hold`). Opened
    once, with the pause the worker takes before its first held job (`HostAdamWorker._loop`)."""

    def __init__(self) -> None:
        self._opened = threading.Event()
        self.pause_s = 0.0

    def open(self, pause_s: float = 0.0) -> None:
        self.pause_s = pause_s
        self._opened.set()

    def is_open(self) -> bool:
        return self._opened.is_set()

    def wait(self) -> None:
        self._opened.wait()


@dataclass
class HostJob:
    """One submitted host job: its name (in errors and waits), the work, the future its caller waits on, and the
    gate it waits for (None: it starts at once)."""

    what: str
    fn: Callable[[], None]
    future: Future
    gate: Gate | None


#: How long a held job waits after its release before it starts (see `HostAdamWorker._run`).
_AFTER_RELEASE_S = 0.002

#: Worker threads closed without waiting for their last jobs (`HostAdamWorker.close`); they may still run them.
_closing: list[threading.Thread] = []
_closing_lock = threading.Lock()

#: Every worker thread still running, with its worker (`_stop_workers_at_exit`).
_running: dict[threading.Thread, HostAdamWorker] = {}
#: Worker threads closed while the caller handled a Ctrl-C: nobody wants their jobs any more, and the exit waits for
#: them briefly even when the script then ends normally (`_stop_workers_at_exit`).
_interrupted: set[threading.Thread] = set()
#: Set at interpreter exit: a job not started by then is dropped.
_exiting = False
#: How long interpreter exit waits for the jobs in flight (one per worker; a host job takes seconds at most) ...
_EXIT_WAIT_S = 60.0
#: ... and after Ctrl-C or an uncaught exception (`_nobody_waits`), when a prompt exit matters more: a longer job is
#: abandoned, which aborts the process if it is inside torch when the interpreter finalizes.
_EXIT_WAIT_AFTER_FAILURE_S = 2.0


@atexit.register
def _stop_workers_at_exit() -> None:
    """No worker thread may still be inside torch when the interpreter finalizes: a daemon thread that returns
    from a torch op then (to take the GIL) is ended by Python with pthread_exit, whose unwinding through torch's
    noexcept C++ frames aborts the whole process ("terminate called without an active exception", SIGABRT).
    So at exit the jobs not yet started are dropped (they only touch host memory, which dies with the process)
    and the job in flight, if any, is waited for (briefly after Ctrl-C or an uncaught exception: a prompt exit);
    this covers workers never closed, and those whose `close` did not wait."""
    global _exiting
    _exiting = True
    with _closing_lock:
        running = list(_running.items())
    for _, worker in running:
        worker._open_gate()  # a held job would wait for a release that never comes
        worker._jobs.put(None)
    start, prompt = time.monotonic(), _nobody_waits()
    for thread, _ in running:
        # (a thread closed during a Ctrl-C: briefly, however the script ended)
        wait_s = _EXIT_WAIT_AFTER_FAILURE_S if prompt or thread in _interrupted else _EXIT_WAIT_S
        thread.join(max(0.0, start + wait_s - time.monotonic()))


def wait_for_closed_workers() -> None:
    """Wait until no closed worker still runs a job (`HostAdamWorker.close` may return before): two workers never
    run host jobs at the same time (a new worker of the same optimizer works on the same host state), and nothing
    reads host state a job still writes."""
    me = threading.current_thread()
    with _closing_lock:
        pending = [t for t in _closing if t is not me]
    for thread in pending:
        def joined(timeout: float, thread: threading.Thread = thread) -> bool:
            thread.join(timeout)
            return not thread.is_alive()

        bounded_wait(joined, "the last host job of a closed worker")
    with _closing_lock:
        _closing[:] = [t for t in _closing if t.is_alive()]


def _nobody_waits() -> bool:
    """Whether waiting for a closing worker's last jobs serves nobody: the caller is handling a KeyboardInterrupt
    (Ctrl-C: it wants out), or the interpreter is exiting after an uncaught exception (``sys.last_type``; atexit
    hooks run once the main thread counts as finished), so nothing will read the host state again."""
    if isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return True
    return not threading.main_thread().is_alive() and getattr(sys, "last_type", None) is not None


def cuda_device_of(params: Iterable[torch.Tensor]) -> int | None:
    """The index of the first CUDA device among `params` (the device a host worker thread makes current), or None
    when none is on CUDA."""
    for p in params:
        if p.device.type == "cuda":
            return p.device.index if p.device.index is not None else torch.cuda.current_device()
    return None


class HostAdamWorker:
    """Runs host jobs (gradient accumulation, the host AdamW) in order, on a background thread or inline.

    Jobs run strictly in submission order, so a window's host step always sees all of that window's gradients and
    the next window's accumulation never races it. The inline mode runs the very same jobs at submission time: it
    is the sequential reference of the overlapped schedule and the engine of ``overlap_step=False``.

    A failed job poisons the worker: its exception is re-raised (as `HostWorkerError`) in the caller at the next
    `check()` / `wait()`, and every later job is dropped rather than run on inconsistent state.
    """

    def __init__(self, threads: int, background: bool, cuda_device: int | None = None,
                 slots: int = GRAD_SLOTS) -> None:
        self.threads = threads
        self.background = background
        # the CUDA device the thread makes current before its first job (`cuda_device_of`): its event waits (and
        # the events it frees) then use that device's context, not a new one on GPU 0 (a thread's default)
        self.cuda_device = cuda_device
        self._error: BaseException | None = None
        self._error_job = ""
        self._outstanding: dict[Future, HostJob] = {}
        # the free hand-off slots' indices (`take_slot`), `slots` of them (`host.grad_slots`; `provide_slots` adds)
        self.slots = 0
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.provide_slots(slots)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._gate: Gate | None = None  # what held jobs wait for (see `hold`)
        self._holding = False
        self._thread: threading.Thread | None = None
        self.last_job_ms: dict[str, float] = {}  # host work of the latest job of each kind, device waits excluded
        self.last_job_wait_ms: dict[str, float] = {}  # ... and the time that job waited for the device
        #: (job, start, end) in perf_counter seconds of the latest jobs: when the host was busy (compare's timeline)
        self.job_spans: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=256)
        if background:
            # A daemon thread: an interpreter that exits (Ctrl-C included) is never held up by a host step.
            self._thread = threading.Thread(target=self._run, name="hf_zenflow-host", daemon=True)
            worker_started(self.threads)  # (the training thread's pool was decided before: `threads.claim_cores`)
            with _closing_lock:
                _running[self._thread] = self
            self._thread.start()

    # -- worker side -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with _closing_lock:
                _running.pop(threading.current_thread(), None)

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # per OS thread in torch: the training thread keeps its own setting
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)  # per OS thread in CUDA, like the thread count
        wait_for_closed_workers()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.gate is not None:
                # Sync point (worker waits on the caller): a job submitted inside the caller's step() starts once
                # that step() has returned (`hold`/`release`; interpreter exit opens it too)
                job.gate.wait()
                # ... plus a moment, so that the caller's return path runs first: the job's Python would take the
                # GIL whenever that path releases it (torch's step wrappers call torch ops) and keep it for up to a
                # switch interval (5 ms); measured on a CPU device, 1-5 ms added to about half the steps
                # (a wait for a held job opens the gate without that pause: the caller is waiting then)
                time.sleep(job.gate.pause_s)
            if _exiting:  # (`_stop_workers_at_exit`)
                job.future.set_exception(HostWorkerError(f"host job '{job.what}' dropped at interpreter exit"))
                continue
            self._execute(job.what, job.fn, job.future)

    def _execute(self, what: str, fn: Callable[[], None], future: Future) -> None:
        if self._error is not None:
            future.set_exception(HostWorkerError(f"host job '{what}' dropped after an earlier failure"))
            return
        start, waited = time.perf_counter(), device_wait_ms()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - everything must reach the caller, KeyboardInterrupt too
            self._error, self._error_job = exc, what
            future.set_exception(exc)
            return
        end = time.perf_counter()
        # the job's host work: its waits for the device (copies landing, a write-back reading its buffer) are not
        # (`writeback_lag="auto"` sizes the lag by it)
        self.last_job_wait_ms[what] = device_wait_ms() - waited
        self.last_job_ms[what] = max(0.0, (end - start) * 1e3 - self.last_job_wait_ms[what])
        self.job_spans.append((what, start, end))
        future.set_result(None)

    # -- caller side -------------------------------------------------------------------------------------------
    def submit(self, what: str, fn: Callable[[], None]) -> Future:
        self.check()
        future: Future = Future()
        if self._thread is None:
            wait_for_closed_workers()
            with torch_threads(self.threads):
                self._execute(what, fn, future)
            self.check()
        else:
            self._outstanding = {f: job for f, job in self._outstanding.items() if not f.done()}
            job = self._outstanding[future] = HostJob(what, fn, future, self._gate)
            self._jobs.put(job)
        return future

    def hold(self) -> None:
        """Jobs submitted from now on wait to start until `release()`. The optimizer holds the worker for the
        length of its step(): host work then overlaps the caller's next forward/backward instead of competing with
        the rest of the step for cores, memory bandwidth and the GIL (on a CPU device that made step() up to ~5 ms
        longer). A wait for a held job lets the held jobs go first (and keeps holding later ones), so a hold
        never deadlocks."""
        if self._thread is not None:
            self._holding = True
            if self._gate is None:
                self._gate = Gate()

    def release(self) -> None:
        """Let the held jobs start; stop holding."""
        self._holding = False
        self._open_gate(pause=_AFTER_RELEASE_S)

    def _open_gate(self, pause: float = 0.0) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.open(pause)
        if self._holding:
            self._gate = Gate()

    @property
    def failed(self) -> bool:
        """Whether a job failed (every later job is dropped, and `check` raises)."""
        return self._error is not None

    def check(self) -> None:
        if self._error is not None:
            raise HostWorkerError(
                f"the hf_zenflow host worker failed in '{self._error_job}': "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error

    def wait(self, future: Future) -> None:
        """Block until `future` is done; raise the worker's failure; never hang on a dead worker (`bounded_wait`)."""
        job = self._outstanding.get(future)
        if job is not None and job.gate is not None and not job.gate.is_open():
            self._open_gate()  # the job (or one before it) is held

        def done(timeout: float) -> bool:
            try:
                future.result(timeout=timeout)
                return True
            except FutureTimeoutError:  # not the built-in TimeoutError before Python 3.11
                return False
            except BaseException:
                self.check()
                raise

        thread = self._thread
        bounded_wait(done, f"host job '{job.what if job is not None else 'unknown'}'",
                  alive=None if thread is None else thread.is_alive)

    def synchronize(self) -> None:
        """Wait until every submitted job has run (a closed worker's last jobs included)."""
        self._open_gate()
        for future in list(self._outstanding):
            self.wait(future)
        self._outstanding = {}
        wait_for_closed_workers()
        self.check()

    def provide_slots(self, count: int) -> None:
        """At least `count` hand-off slots (`host.grad_slots`: a later write-back needs more; the caller has made
        the per-slot buffers of the new indices first). Called by the training thread between steps."""
        for slot in range(self.slots, count):
            self._slots.put(slot)
        self.slots = max(self.slots, count)

    def acquire_slot(self) -> int:
        """A free gradient hand-off slot; blocks (a stall) while every slot is held by a job not yet run: the
        worker is `slots` steps behind (with `host.grad_slots` slots, only when it is behind by more than the
        window's host AdamW, whose write-back waits for it first)."""
        if self._slots.empty():
            self._open_gate()  # the jobs that free a slot may be held
        taken: list[int] = []

        def done(timeout: float) -> bool:
            try:
                taken.append(self._slots.get(timeout=timeout))
                return True
            except queue.Empty:
                return False

        thread = self._thread
        bounded_wait(done, "a free gradient hand-off slot (the host jobs of the last steps)",
                  alive=None if thread is None else thread.is_alive, check=self.check)
        return taken[0]

    def release_slot(self, slot: int) -> None:
        self._slots.put(slot)

    def take_slot(self) -> GradSlot:
        """A gradient hand-off slot (`acquire_slot`) for one job, returned to the pool exactly once: by the job when
        it has run (`GradSlot.submit`), or by `GradSlot.give_back`, which every way out that may not have
        submitted calls (an exception, a KeyboardInterrupt): it returns the slot at once unless the job has
        started, and a job that has not started then never runs. So an interrupted hand-off never leaks a slot,
        wherever the interrupt lands.

        Example:
            >>> worker = HostAdamWorker(threads=1, background=False)
            >>> slot = worker.take_slot()
            >>> try:
            ...     buffers = ["slot 0 data", "slot 1 data"][slot.index]
            ...     future = slot.submit("accumulate", lambda: None)
            ... except BaseException:
            ...     slot.give_back()
            ...     raise
            >>> future.done()
            True
        """
        return GradSlot(self, self.acquire_slot())

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread once the jobs already submitted have run; a later job of this worker runs inline (the
        optimizer starts a new worker instead).

        Waits at most `timeout` seconds, and not at all where waiting serves nobody: while the caller handles a
        KeyboardInterrupt, and at interpreter exit after an uncaught exception (Ctrl-C at the top level included);
        a Ctrl-C during the wait ends it too. A thread not waited for finishes its jobs in the background, and
        every later worker, inline run or `synchronize()` in this process waits for it before going on, so host
        jobs never overlap (as do the Trainer's and the accelerate hooks' checkpoint paths:
        `wait_for_closed_workers`). If the process exits first, the exit waits for the job in flight and drops the
        jobs not started (`_stop_workers_at_exit`), which loses nothing on disk: host jobs only touch host memory,
        never a file or the live weights.
        """
        self.release()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            if thread.is_alive():
                self._jobs.put(None)
                if _nobody_waits():
                    if isinstance(sys.exc_info()[1], KeyboardInterrupt):
                        _interrupted.add(thread)
                    return
                thread.join(timeout)
        finally:
            if thread.is_alive():
                with _closing_lock:
                    _closing.append(thread)


class GradSlot:
    """One gradient hand-off slot from `HostAdamWorker.take_slot`: `index` indexes per-slot buffers (the pinned
    landing buffers on CUDA), `submit` queues the one job that uses them; the worker returns the slot after it."""

    def __init__(self, worker: HostAdamWorker, slot: int) -> None:
        self.worker = worker
        self.index = slot
        self.future: Future | None = None
        # Whoever pops the slot returns it: the job as it starts, or `give_back`. list.pop is atomic under the
        # GIL, so the slot is returned exactly once even when an interrupt lands right after the submission.
        self._owner = [slot]

    def submit(self, what: str, fn: Callable[[], None]) -> Future:
        if self.future is not None:
            raise RuntimeError(f"GradSlot {self.index}: one job per slot, and '{what}' is the second")
        owner, worker = self._owner, self.worker

        def job() -> None:
            try:
                slot = owner.pop()
            except IndexError:
                return  # the caller gave the slot up before the job started
            try:
                fn()
            finally:
                worker.release_slot(slot)

        self.future = worker.submit(what, job)
        return self.future

    def give_back(self) -> None:
        """Return the slot unless the job has taken it; a job not yet started will then skip."""
        try:
            slot = self._owner.pop()
        except IndexError:
            return
        self.worker.release_slot(slot)


class WorkerKeeper:
    """The life of one optimizer's `HostAdamWorker` (`worker`, None until a step needs one): a background thread when
    the schedule overlaps (``overlap_step`` and the ``"thread"`` executor) and something is offloaded, else inline;
    stopped by `stop` (the run goes on) or `close` (its end); the failure of a worker stopped after it failed kept in
    `failure` (the host state may be partly updated); and the thread rule's cores claimed for a background worker
    once per run (`settings/threads.py`). `config` is kept current by its owner."""

    def __init__(self, config: Any, host_executor: str) -> None:
        self.config = config
        self.host_executor = host_executor
        self.worker: HostAdamWorker | None = None
        self.failure: HostWorkerError | None = None
        #: whether the parameters will have host state (`params.offloads_any`, set by the optimizer): only then a
        #: background worker starts and the thread rule claims cores for it
        self.offload_planned = False
        self._claimed = False

    def background(self) -> bool:
        """Whether the schedule runs the host jobs on a thread of their own."""
        return self.config.overlap_step and self.host_executor == "thread"

    def ensure(self, has_host_state: bool, may_replace_inline: bool, cuda_device: int | None,
               on_start: Callable[[], None] = lambda: None, slots: int = GRAD_SLOTS) -> HostAdamWorker:
        """The worker, started if there is none: a thread when the schedule overlaps and something is offloaded
        (planned, or `has_host_state` after all; an inline worker then gives way when `may_replace_inline`: it has
        nothing in flight); otherwise inline, no thread. `on_start` runs before a new worker starts; a new worker
        has `slots` hand-off slots."""
        thread = self.background() and (self.offload_planned or has_host_state)
        worker = self.worker
        if worker is None or (not worker.background and may_replace_inline and thread):
            self.claim_cores()  # (a run continued after `close()`: the same claim again)
            on_start()
            self.worker = HostAdamWorker(self.config.resolved_cpu_threads, background=thread, cuda_device=cuda_device,
                                         slots=slots)
        return self.worker

    def stop(self) -> None:
        """Stop the worker thread only (a later step starts a new one, e.g. with other settings); the cores stay
        claimed. A failed worker's failure is kept in `failure`."""
        worker, self.worker = self.worker, None
        if worker is not None:
            if worker.failed and self.failure is None:
                try:
                    worker.check()
                except HostWorkerError as failure:
                    self.failure = failure
            worker.close()

    def claim_cores(self) -> None:
        """The thread rule's once-per-run decision (`threads.claim_cores`), when a background worker is planned.
        Idempotent; called when the optimizer is built and before each training step (before any forward)."""
        if not self._claimed and self.offload_planned and self.background():
            self._claimed = True
            claim_cores(self, self.config.resolved_cpu_threads)

    def close(self) -> None:
        """The end of a run: stop the worker and give the training thread its cores back (`threads.release_cores`)."""
        self.stop()
        if self._claimed:
            self._claimed = False
            release_cores(self)
