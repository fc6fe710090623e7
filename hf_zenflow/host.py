"""The host path: per-matrix host state, gradient accumulation, and the worker that runs the host AdamW.

Host memory per offloaded parameter element: fp32 master (4 B) + fp32 exp_avg and exp_avg_sq (8 B) + fp32 window
accumulator (4 B) = 16 B, plus a write-back buffer in the parameter dtype (pinned on CUDA; on a CPU device it is a
spare storage of the weight, swapped in at each write-back instead of a copy) and on CUDA a pinned copy of the
gradient per in-flight step (2 slots x the gradient dtype; none with ``accumulate_on="device"``). One moment set
(DeepSpeed keeps two, zenflow.md §3.12).

The host state keeps the parameter's own memory layout: its `storage_matrix`, [out, in] for a row-major weight,
[in, out] for a column-major one (`column_major_`), so copies between the two sides are contiguous streams. Every
step the whole gradient is added into the accumulator (a contiguous streaming add on the worker; with
``accumulate_on="device"`` the device sums the window and it lands here once) and every window the host AdamW
updates the whole matrix with one fused call; the columns currently on the device are carried along and simply
ignored (their host values are refreshed from the device at re-selection). That keeps every per-step and per-window
host operation contiguous; the only column moves are the selected columns (device side, every step) and the
migration at re-selection, strided for row-major weights and whole rows for column-major ones.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field

import torch

from . import _native
from ._base import fused_adamw_, torch_threads
from .threads import worker_started, worker_stopped
from .transport import CpuDeviceTransport, PinnedArena, Transport


class HostWorkerError(RuntimeError):
    """The host worker failed; raised in the training process at its next `step()`/`synchronize()`."""


#: In-flight gradient hand-offs between the caller and the worker. Two lets the caller hand over step t+1 while the
#: worker still folds step t into the accumulator; more would only buy memory (each slot pins one gradient copy).
GRAD_SLOTS = 2

#: How often a waiting caller wakes to check that the worker thread is still alive.
_POLL_S = 0.5

#: How long a held job waits after its release before it starts (see `HostAdamWorker._run`).
_AFTER_RELEASE_S = 0.002

#: Worker threads closed without waiting for their last jobs (`HostAdamWorker.close`); they may still run them.
_closing: list[threading.Thread] = []
_closing_lock = threading.Lock()


def wait_for_closed_workers() -> None:
    """Wait until no closed worker still runs a job (`HostAdamWorker.close` may return before): two workers never
    run host jobs at the same time (a new worker of the same optimizer works on the same host state), and nothing
    reads host state a job still writes."""
    me = threading.current_thread()
    with _closing_lock:
        pending = [t for t in _closing if t is not me]
    for thread in pending:
        thread.join()
    with _closing_lock:
        _closing[:] = [t for t in _closing if t.is_alive()]


def _nobody_waits() -> bool:
    """Whether waiting for a closing worker's last jobs serves nobody: the caller is handling a KeyboardInterrupt
    (Ctrl-C: it wants out), or the interpreter is exiting after an uncaught exception (``sys.last_type``; atexit
    hooks run once the main thread counts as finished), so nothing will read the host state again."""
    if isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return True
    return not threading.main_thread().is_alive() and getattr(sys, "last_type", None) is not None


_scratch = threading.local()


def _fp32_scratch(like: torch.Tensor) -> torch.Tensor:
    """A reused fp32 buffer shaped like `like`, one per thread. Adding a bf16 tensor into an fp32 one directly is
    ~3.5x slower on CPU than converting into a warm fp32 buffer first and adding that (measured, 25M elements:
    135 ms against 16 + 21 ms); a fresh conversion each time pays page faults instead."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < like.numel():
        buf = _scratch.buf = torch.empty(like.numel(), dtype=torch.float32)
    return buf[: like.numel()].view(like.shape)


def accumulate_into(accum: torch.Tensor, grad2d: torch.Tensor, coef: float | None, first: bool) -> None:
    """``accum = grad * coef`` (first step of a window) or ``accum += grad * coef``, in fp32. The one rule for both
    places a window is summed (the host worker, or the device with ``accumulate_on="device"``), so the two give
    the same bits."""
    if _native.supports(grad2d) and accum.device.type == "cpu" and _native.library() is not None:
        # one pass that reads a bf16 gradient directly (torch needs a conversion pass first); same arithmetic
        _native.accumulate([accum], [grad2d], coef, first)
        return
    if first:
        accum.copy_(grad2d)
        if coef is not None:
            accum.mul_(coef)
        return
    if grad2d.dtype != torch.float32 and grad2d.device.type == "cpu":
        grad2d = _fp32_scratch(grad2d).copy_(grad2d)
    if coef is None:
        accum.add_(grad2d)
    else:
        accum.add_(grad2d, alpha=coef)


@dataclass
class HostMatrix:
    """Host-side AdamW state of one matrix, as [out, in] fp32 tensors."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    accum: torch.Tensor
    accum_count: int = 0
    # CUDA only: pinned landing buffers for the device->host gradient copy (one per slot).
    staging: list[torch.Tensor] = field(default_factory=list)
    # The host result in the parameter dtype, filled by the worker after each host step: on CUDA a pinned buffer
    # the write-back copies from (and the event after which that copy has read it); on a CPU device a spare
    # storage for the weight that the write-back swaps in, instead of copying (the weight's old storage becomes
    # the spare). `writeback_fresh`: filled since the last write-back.
    writeback: torch.Tensor | None = None
    writeback_free: object | None = None
    writeback_fresh: bool = False

    @classmethod
    def create(cls, param2d: torch.Tensor, grad_dtype: torch.dtype, accumulate_on: str = "host",
               transport: Transport | None = None) -> HostMatrix:
        """Host state for `param2d`. The buffers that cross the link come from `transport` (pinned from one arena
        on CUDA): the write-back buffer, the gradient landing buffers when the transport copies each step's
        gradient (one per hand-off slot), and the accumulator when the window is summed on the device
        (``accumulate_on="device"``: it lands there once per window, and no landing buffers are needed). The master
        and the moments never cross the link and are ordinary host memory."""
        transport = transport if transport is not None else CpuDeviceTransport()
        on_device = accumulate_on == "device"
        shape = param2d.shape
        state = cls(
            master=torch.empty(shape, dtype=torch.float32).copy_(param2d.detach()),
            exp_avg=torch.zeros(shape, dtype=torch.float32),
            exp_avg_sq=torch.zeros(shape, dtype=torch.float32),
            step=torch.zeros((), dtype=torch.float32),
            accum=(transport.host_buffer(shape, torch.float32) if on_device else torch.empty(shape)).zero_(),
        )
        if transport.stages_gradients and not on_device:
            state.staging = [transport.host_buffer(shape, grad_dtype) for _ in range(GRAD_SLOTS)]
        # initialised: a matrix that gets no gradient in a window is written back from it unchanged
        state.writeback = transport.host_buffer(shape, param2d.dtype).copy_(param2d.detach())
        return state

    @staticmethod
    def link_bytes(param2d: torch.Tensor, grad_dtype: torch.dtype, accumulate_on: str, transport: Transport) -> int:
        """Bytes of `transport.host_buffer` that `create` asks for (each rounded as a pinned arena rounds it)."""
        numel = param2d.numel()
        sizes = [numel * param2d.element_size()]
        if accumulate_on == "device":
            sizes.append(numel * 4)
        elif transport.stages_gradients:
            sizes += [numel * torch.empty((), dtype=grad_dtype).element_size()] * GRAD_SLOTS
        return sum(PinnedArena.aligned(n) for n in sizes)

    def accumulate(self, grad2d: torch.Tensor, coef: float | None) -> None:
        """Fold one step's gradient (times the clip coefficient) into the window sum, in fp32."""
        accumulate_into(self.accum, grad2d, coef, first=self.accum_count == 0)
        self.accum_count += 1

    @staticmethod
    def accumulate_all(pairs: list[tuple[HostMatrix, torch.Tensor]], coef: float | None) -> None:
        """`accumulate` for one step's batch of (matrix, gradient) pairs. CPU tensors go through the kernels in one
        call per window position (first step or not) instead of one per matrix: fewer Python steps on the worker
        thread, which shares the GIL with the training thread."""
        native: dict[bool, list[tuple[HostMatrix, torch.Tensor]]] = {True: [], False: []}
        for host, g2d in pairs:
            if _native.supports(g2d) and host.accum.device.type == "cpu" and _native.library() is not None:
                native[host.accum_count == 0].append((host, g2d))
            else:
                host.accumulate(g2d, coef)
        for first, batch in native.items():
            if batch:
                _native.accumulate([h.accum for h, _ in batch], [g for _, g in batch], coef, first)
                for host, _ in batch:
                    host.accum_count += 1

    def nbytes(self) -> int:
        tensors = [self.master, self.exp_avg, self.exp_avg_sq, self.accum, *self.staging]
        if self.writeback is not None:
            tensors.append(self.writeback)
        return sum(t.numel() * t.element_size() for t in tensors)


def host_adamw_window(groups: list[tuple[dict, list[HostMatrix]]]) -> None:
    """The host AdamW step of one window: mean gradient of the window, one fused call per param group.

    Matrices that received no gradient during the window are left alone, as torch's AdamW skips parameters
    without a gradient.
    """
    for hyper, matrices in groups:
        live = [m for m in matrices if m.accum_count > 0]
        for m in live:
            if m.accum_count > 1:
                m.accum.div_(m.accum_count)
        fused_adamw_(
            [m.master for m in live], [m.accum for m in live], [m.exp_avg for m in live],
            [m.exp_avg_sq for m in live], [m.step for m in live], hyper,
        )
        for m in live:
            m.accum_count = 0
            if m.writeback is not None:
                # Sync point (worker waits on the device): the previous host->device copy of this buffer, enqueued
                # at the last window boundary, must have finished reading it before we overwrite it.
                if m.writeback_free is not None:
                    m.writeback_free.synchronize()  # type: ignore[attr-defined]
                m.writeback.copy_(m.master)
                m.writeback_fresh = True


class HostAdamWorker:
    """Runs host jobs (gradient accumulation, the host AdamW) in order, on a background thread or inline.

    Jobs run strictly in submission order, so a window's host step always sees all of that window's gradients and
    the next window's accumulation never races it. The inline mode runs the very same jobs at submission time: it
    is the sequential reference of the overlapped schedule and the engine of ``overlap_step=False``.

    A failed job poisons the worker: its exception is re-raised (as `HostWorkerError`) in the caller at the next
    `check()` / `wait()`, and every later job is dropped rather than run on inconsistent state.
    """

    def __init__(self, threads: int, background: bool) -> None:
        self.threads = threads
        self.background = background
        self._error: BaseException | None = None
        self._error_job = ""
        self._outstanding: list[Future] = []
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(GRAD_SLOTS):
            self._slots.put(slot)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._gate: threading.Event | None = None  # what held jobs wait for (see `hold`)
        self._holding = False
        self._thread: threading.Thread | None = None
        self.last_job_ms: dict[str, float] = {}
        if background:
            # A daemon thread: an interpreter that exits (Ctrl-C included) is never held up by a host step.
            self._thread = threading.Thread(target=self._run, name="hf_zenflow-host", daemon=True)
            worker_started(self, self.threads)  # the training thread leaves the worker its cores
            self._thread.start()

    # -- worker side -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # per OS thread in torch: the training thread keeps its own setting
        wait_for_closed_workers()
        while True:
            item = self._jobs.get()
            if item is None:
                return
            what, fn, future, gate = item
            if gate is not None:
                # Sync point (worker waits on the caller): a job submitted inside the caller's step() starts once
                # that step() has returned (`hold`/`release`)
                gate.wait()
                # ... plus a moment, so that the caller's return path runs first: the job's Python would take the
                # GIL whenever that path releases it (torch's step wrappers call torch ops) and keep it for up to a
                # switch interval (5 ms); measured on a CPU device, 1-5 ms added to about half the steps
                # (a wait for a held job opens the gate without that pause: the caller is waiting then)
                time.sleep(getattr(gate, "hf_zenflow_pause", 0.0))
            self._execute(what, fn, future)

    def _execute(self, what: str, fn: Callable[[], None], future: Future) -> None:
        if self._error is not None:
            future.set_exception(HostWorkerError(f"host job '{what}' dropped after an earlier failure"))
            return
        start = time.perf_counter()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - everything must reach the caller, KeyboardInterrupt too
            self._error, self._error_job = exc, what
            future.set_exception(exc)
            return
        self.last_job_ms[what] = (time.perf_counter() - start) * 1e3
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
            self._outstanding = [f for f in self._outstanding if not f.done()]
            self._outstanding.append(future)
            future.hf_zenflow_gate = self._gate  # type: ignore[attr-defined]
            self._jobs.put((what, fn, future, self._gate))
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
                self._gate = threading.Event()

    def release(self) -> None:
        """Let the held jobs start; stop holding."""
        self._holding = False
        self._open_gate(pause=_AFTER_RELEASE_S)

    def _open_gate(self, pause: float = 0.0) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.hf_zenflow_pause = pause  # type: ignore[attr-defined]
            gate.set()
        if self._holding:
            self._gate = threading.Event()

    def check(self) -> None:
        if self._error is not None:
            raise HostWorkerError(
                f"the hf_zenflow host worker failed in '{self._error_job}': "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error

    def wait(self, future: Future) -> None:
        """Block until `future` is done; raise the worker's failure; never hang on a dead worker."""
        gate = getattr(future, "hf_zenflow_gate", None)
        if gate is not None and not gate.is_set():
            self._open_gate()  # the job (or one before it) is held
        while True:
            try:
                future.result(timeout=_POLL_S)
                return
            except FutureTimeoutError:  # not the built-in TimeoutError before Python 3.11
                if self._thread is not None and not self._thread.is_alive():
                    raise HostWorkerError("the hf_zenflow host worker thread died") from None
            except BaseException:
                self.check()
                raise

    def synchronize(self) -> None:
        """Wait until every submitted job has run (a closed worker's last jobs included)."""
        self._open_gate()
        for future in list(self._outstanding):
            self.wait(future)
        self._outstanding = []
        wait_for_closed_workers()
        self.check()

    def acquire_slot(self) -> int:
        """A free gradient hand-off slot; blocks (a stall) while the worker is two steps behind."""
        if self._slots.empty():
            self._open_gate()  # the jobs that free a slot may be held
        while True:
            try:
                return self._slots.get(timeout=_POLL_S)
            except queue.Empty:
                self.check()
                if self._thread is not None and not self._thread.is_alive():
                    raise HostWorkerError("the hf_zenflow host worker thread died") from None

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
            >>> grant = worker.take_slot()
            >>> try:
            ...     buffers = ["slot 0 data", "slot 1 data"][grant.slot]
            ...     future = grant.submit("accumulate", lambda: None)
            ... except BaseException:
            ...     grant.give_back()
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
        `wait_for_closed_workers`). If the process exits first (the thread is a daemon), the job is abandoned with
        it, which loses nothing on disk: host jobs only touch host memory, never a file or the live weights.
        """
        self.release()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            if thread.is_alive():
                self._jobs.put(None)
                if _nobody_waits():
                    return
                thread.join(timeout)
        finally:
            if thread.is_alive():
                with _closing_lock:
                    _closing.append(thread)
            worker_stopped(self)


class GradSlot:
    """One gradient hand-off slot from `HostAdamWorker.take_slot`: `slot` indexes per-slot buffers (the pinned
    landing buffers on CUDA), `submit` queues the one job that uses them; the worker returns the slot after it."""

    def __init__(self, worker: HostAdamWorker, slot: int) -> None:
        self.worker = worker
        self.slot = slot
        self.future: Future | None = None
        # Whoever pops the slot returns it: the job as it starts, or `give_back`. list.pop is atomic under the
        # GIL, so the slot is returned exactly once even when an interrupt lands right after the submission.
        self._owner = [slot]

    def submit(self, what: str, fn: Callable[[], None]) -> Future:
        if self.future is not None:
            raise RuntimeError(f"GradSlot {self.slot}: one job per slot, and '{what}' is the second")
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
