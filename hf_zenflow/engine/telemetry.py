"""Per-step telemetry of the offloading optimizers: where the caller's time went, what moved, how stale it is."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator


logger = logging.getLogger("hf_zenflow")


#: Phases of the caller's time inside `step()`, in the order they happen.
PHASES = ("norms", "select", "device_update", "handoff", "wait", "writeback", "host_update")
#: The phases in which the device waits instead of computing: the gradient copies to the host, the wait for the host
#: worker, the write-back of parameters, the host AdamW run inline (device utilisation: `device_wait_ms`).
DEVICE_WAIT_PHASES = ("handoff", "wait", "writeback", "host_update")


def device_wait_ms(stats: dict) -> float:
    """ms of the last `step()` in which the device waited (`DEVICE_WAIT_PHASES`), from a `stats()` dict, plus the
    device time of the write-back copies (``writeback_device_ms``: on CUDA they run on the compute stream after the
    caller's `step()` has returned, and the next forward waits behind them)."""
    phases = sum(float(stats.get(f"cp_{p}_ms") or 0.0) for p in DEVICE_WAIT_PHASES)
    return phases + float(stats.get("writeback_device_ms") or 0.0)


class StepTimer:
    """Wall time of each phase of one `step()` call, as seen by the caller (the critical path)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []  # (phase, start, end) in perf_counter seconds: timelines

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.phases[name] = self.phases.get(name, 0.0) + (t1 - t0) * 1e3
            self.spans.append((name, t0, t1))

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3


class ZenFlowStats:
    """Counters behind `stats()`.

    Keys of the dict it returns (``*_ms`` in milliseconds, bytes per step unless named ``total_``):

    - ``critical_path_ms``: wall time the caller spent in the last `step()` (what the training loop waits for);
      ``cp_<phase>_ms`` splits it (norms, select, device_update, handoff, wait, writeback, host_update);
    - ``host_step_ms``: duration of the last host AdamW window step (on the worker, off the critical path when
      overlapped); ``accumulate_ms``: the last gradient accumulation job; both without the job's waits for the
      device (CUDA: a copy landing, a write-back reading its buffer);
    - ``writeback_device_ms``: device time of write-back copies (CUDA: the host->device copies on the compute
      stream, which the next forward waits behind), measured by timing events read once they have run, never waited
      for: counted in the last step when they have run by the time of `stats()` (a caller that synchronises after
      `step()`), else in a later one; 0 where the write-back swaps storage (a CPU device);
    - ``bytes_to_host`` / ``bytes_to_device``: bytes crossing the host-device link in the last step (on a CPU
      device: the bytes that would), ``total_bytes_to_host`` / ``total_bytes_to_device`` since construction;
    - ``selected_fraction``: fraction of matrix elements updated on the device each step;
      ``selected_grad_share``: how much of the gradient the device columns held when they were chosen: per offloaded
      matrix, their share of its squared gradient norm at its last selection, averaged over the matrices (NaN before
      the first selection, and in a resumed run until its next one: not checkpointed). ZenFlow assumes a few columns
      hold most of it. A share of the gradient, not of AdamW's step, which does not scale with the gradient's size:
      the host columns may receive most of the update even where the figure is high (docs/how-it-works.md);
    - ``update_interval``: length of the last closed window, in steps;
    - ``staleness``: optimizer steps whose host-path gradients are not yet in the weights after the last step;
    - ``steps``, ``windows``, ``reselections``, ``skipped_steps`` (non-finite gradients);
    - ``host_state_bytes`` / ``device_state_bytes``: optimizer state held on each side by this process (rank);
      ``host_bytes_per_param``: host bytes per element of host state (16 B of AdamW state and window sum, plus the
      write-back buffer and the CUDA gradient landing slots); ``pinned_host_bytes``: page-locked host memory (CUDA: the
      rings of chunks that the gradients, the device sums and the write-back cross, whatever the model's size; the
      master, moments, sums, landing slots and write-back buffers are never pinned);
    - ``ranks``: data-parallel ranks sharing the host work (each rank's host state covers 1/``ranks`` of every
      offloaded matrix, `distributed/sharding.py`); ``gather_buffer_bytes``: the write-back's all-gather buffer (on the
      device with NCCL, on the host with gloo), 0 with one rank;
    - ``peak_device_bytes``: the most the device held in any step so far (CUDA: ``max_memory_allocated``, reset at
      the end of each step; a CPU device: weights + gradients on the device + optimizer device state,
      `device_memory.py`),
      ``step_peak_device_bytes`` the last step's, ``peak_device_bytes_per_param`` over the parameters' elements,
      ``weight_bytes``; ``offloaded_params_fraction``: the share of the parameters in matrices with host state;
    - ``host_threads``: threads the host worker runs with (whatever ``OMP_NUM_THREADS`` says; docs/threads.md).
    """

    def __init__(self) -> None:
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.total_bytes_to_host = 0
        self.total_bytes_to_device = 0
        self.skipped_steps = 0
        self.staleness = 0
        self.last_ms = 0.0
        self.last_phases: dict[str, float] = {}
        self.last_spans: list[tuple[str, float, float]] = []  # the last step's phases in time (`StepTimer.spans`)
        self._step_bytes = (0, 0)
        #: per transport: the device time of its write-back copies that ran since the last call (`take_device_ms`)
        self.device_clocks: list[Callable[[], float]] = []
        self._writeback_device_ms = 0.0

    def collect_device_time(self) -> None:
        """Add the write-back copies that have run since the last collection to the last step's
        ``writeback_device_ms`` (`finish_step` and `stats()` call it: a caller that waits for the device after
        `step()` sees a write-back in the step that made it, one that does not in a later step; never twice)."""
        self._writeback_device_ms += sum(clock() for clock in self.device_clocks)

    def finish_step(self, timer: StepTimer, skipped: bool = False, staleness: int | None = None) -> None:
        self._writeback_device_ms = 0.0
        self.collect_device_time()
        self.last_ms = timer.elapsed_ms()
        self.last_phases = dict(timer.phases)
        self.last_spans = list(timer.spans)
        self._step_bytes = (self.bytes_to_host, self.bytes_to_device)
        self.total_bytes_to_host += self.bytes_to_host
        self.total_bytes_to_device += self.bytes_to_device
        self.bytes_to_host = self.bytes_to_device = 0
        if staleness is not None:
            self.staleness = staleness

    def skip_step(self, timer: StepTimer, steps: int) -> None:
        """A step skipped for non-finite gradients (nothing updated): counted, and said loudly at the first skip of
        the run and again each time the count doubles (`steps`: the steps taken so far)."""
        self.skipped_steps += 1
        if self.skipped_steps & (self.skipped_steps - 1) == 0:  # 1, 2, 4, 8, ...
            logger.warning(
                "ZenFlowAdamW: %d step(s) skipped so far (%d taken): the gradients or their clip norm were not finite "
                "(NaN/Inf), so those steps updated nothing. Look for a NaN or infinite loss, a learning rate too "
                "high, or a NaN max_norm given to clip_grad_norm_; a GradScaler skips a few steps at the start "
                "while it finds its scale (stats()[\"skipped_steps\"]). Said again when the count doubles.",
                self.skipped_steps, steps)
        self.finish_step(timer, skipped=True)

    def as_dict(self, **extra: float) -> dict[str, float]:
        out: dict[str, float] = {
            "critical_path_ms": self.last_ms,
            "bytes_to_host": float(self._step_bytes[0]),
            "bytes_to_device": float(self._step_bytes[1]),
            "total_bytes_to_host": float(self.total_bytes_to_host),
            "total_bytes_to_device": float(self.total_bytes_to_device),
            "staleness": float(self.staleness),
            "skipped_steps": float(self.skipped_steps),
            "writeback_device_ms": self._writeback_device_ms,
        }
        for phase in PHASES:
            out[f"cp_{phase}_ms"] = self.last_phases.get(phase, 0.0)
        out.update({k: float(v) for k, v in extra.items()})
        return out


def device_state_bytes(splits: dict, dense: dict) -> int:
    """Optimizer state on the device: the selected columns (master, moments, gathered gradient), the dense
    parameters' state and the device-side window sums."""
    matrices = splits.values()
    return (sum(s.device.nbytes() for s in matrices if s.device is not None)
            + sum(d.nbytes() for d in dense.values())
            + sum(s.window_sum.nbytes for s in matrices if s.window_sum is not None))


def offloaded_params_fraction(splits: dict, dense: dict) -> float:
    """The share of the parameters' elements in matrices with host state (the rest, e.g. matrices under
    `min_offload_numel` and 1-D parameters, live whole on the device)."""
    total = sum(s.param.numel() for s in splits.values()) + sum(p.numel() for p in dense)
    hosted = sum(s.param.numel() for s in splits.values() if s.host is not None)
    return hosted / total if total else 0.0


def state_sizes(splits: dict, dense: dict) -> dict[str, float]:
    """The `stats()` figures about where the state lives: the fraction of matrix elements updated on the device each
    step (and the share of the gradient those columns held when chosen), the bytes held on each side, and host bytes
    per element of the matrices with host state (16 B of AdamW state and window sum, plus the link buffers)."""
    matrices = list(splits.values())
    total = sum(s.param.numel() for s in matrices)
    on_device = sum(s.param.numel() * (s.k / s.columns) for s in matrices if s.device is not None)
    hosted = sum(s.host.master.numel() for s in matrices if s.host is not None)
    host_bytes = sum(s.host.nbytes() for s in matrices if s.host is not None)
    shares = [s.selected_share for s in matrices if s.host is not None and s.selected_share is not None]
    return {"selected_fraction": on_device / total if total else 1.0,
            "selected_grad_share": sum(shares) / len(shares) if shares else math.nan, "host_state_bytes": host_bytes,
            "device_state_bytes": device_state_bytes(splits, dense),
            "host_bytes_per_param": host_bytes / hosted if hosted else 0.0,
            "offloaded_params_fraction": offloaded_params_fraction(splits, dense)}
