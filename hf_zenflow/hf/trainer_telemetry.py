"""The Trainer's ZenFlow telemetry: `ZenFlowAdamW.stats()` read after every optimizer step and averaged into the
`zenflow/...` metrics of each training log and of the end-of-training summary.

What each log carries, so that a log line stays readable:

- every training log: the essentials (`EVERY_LOG`: the critical path, its wait for the host, the host step, the
  selected fraction, the bytes sent to the host, means over the steps since the previous log; and the device
  utilisation);
- the first training log, and then a log only where its value changed since it was last logged: the settings and
  state the run is in (`WHEN_CHANGED`: the window length, re-selections, skipped steps, the high-lr rule and the
  host-step guard, the device memory peaks, the offloaded share, the device columns' share of the gradient);
- the end-of-training summary (and so ``all_results.json``): every figure over the whole run, the ones no step log
  carries included (`MEAN_STATS`' ``bytes_to_device`` and ``staleness``, the ``steps`` and ``windows`` counters).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from transformers import TrainerCallback

from ..engine.telemetry import device_wait_ms
from .unwrap import unwrap_zenflow_optimizer


#: `opt.stats()` keys averaged over the optimizer steps between two logs (and over the whole run for the card).
#: `cp_wait_ms` is the part of the critical path spent waiting for the host worker: the stall that overlap removes.
MEAN_STATS = ("critical_path_ms", "cp_wait_ms", "host_step_ms", "bytes_to_host", "bytes_to_device",
              "selected_fraction", "staleness")
#: `opt.stats()` keys reported as their latest value (the current interval, or counters).
LAST_STATS = ("update_interval", "steps", "windows", "reselections", "skipped_steps",
              # `high_lr_rule="auto"`'s choice (0: not engaged) and the host AdamW's beta1 it implies
              "high_lr_window", "host_beta1",
              # `host_step_guard`: the host lr's factor (1.0: not engaged) and the overshoots it saw
              "host_step_guard", "host_step_guard_engaged",
              # what the device held at its peak so far (weights, gradients, optimizer device state), per parameter,
              # and the share of the parameters offloaded
              "peak_device_bytes", "peak_device_bytes_per_param", "step_peak_device_bytes",
              "offloaded_params_fraction", "min_offload_numel",
              # how much of the offloaded matrices' gradient their device columns held at the last selection
              "selected_grad_share")
#: In every training log (with `UTILIZATION`).
EVERY_LOG = ("critical_path_ms", "cp_wait_ms", "host_step_ms", "selected_fraction", "bytes_to_host")
#: In the first training log and then in those where the value changed since it was last logged.
WHEN_CHANGED = tuple(key for key in LAST_STATS if key not in ("steps", "windows"))
TELEMETRY_PREFIX = "zenflow/"
#: The device's busy share of the training loop's wall time between optimizer steps: 1 - (the steps' device waits,
#: `telemetry.DEVICE_WAIT_PHASES`) / (their wall time), as `hf-zenflow compare` reports it.
UTILIZATION = "device_utilization"


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class ZenFlowTelemetry:
    """Aggregates `ZenFlowAdamW.stats()` over optimizer steps.

    `record()` after every optimizer step; `pop_interval()` returns the `zenflow/...` metrics of a training log (the
    module docstring says which: the `EVERY_LOG` means over the steps since the previous call, and the `WHEN_CHANGED`
    values that changed since they were last logged); `run_summary()` every figure over the whole run.

    Example:
        >>> t = ZenFlowTelemetry()
        >>> t.record({"critical_path_ms": 2.0, "update_interval": 4, "steps": 1})
        >>> t.record({"critical_path_ms": 4.0, "update_interval": 4, "steps": 2})
        >>> t.pop_interval()
        {'zenflow/critical_path_ms': 3.0, 'zenflow/update_interval': 4.0}
        >>> t.record({"critical_path_ms": 5.0, "update_interval": 4, "steps": 3})
        >>> t.pop_interval()  # the window length has not changed
        {'zenflow/critical_path_ms': 5.0}
        >>> t.run_summary()
        {'zenflow/critical_path_ms': 3.6666666666666665, 'zenflow/update_interval': 4.0, 'zenflow/steps': 3.0}
    """

    def __init__(self) -> None:
        self._interval_sum: dict[str, float] = {}
        self._interval_count: dict[str, int] = {}
        self._run_sum: dict[str, float] = {}
        self._run_count: dict[str, int] = {}
        self.last: dict[str, float] = {}
        self._interval_busy = [0.0, 0.0]  # device waits, wall ms of the steps with a known wall time
        self._run_busy = [0.0, 0.0]
        self._logged: dict[str, float] = {}  # the `WHEN_CHANGED` values as last logged

    def record(self, stats: dict[str, Any], step_wall_ms: float | None = None) -> None:
        """One optimizer step's `stats()`; `step_wall_ms`: the loop's wall time of that step (since the previous
        optimizer step), which the device utilisation divides by."""
        if step_wall_ms is not None and step_wall_ms > 0:
            wait = min(step_wall_ms, device_wait_ms(stats))
            for acc in (self._interval_busy, self._run_busy):
                acc[0] += wait
                acc[1] += step_wall_ms
        for key, value in stats.items():
            number = _number(value)
            if number is None or math.isnan(number):
                continue
            self.last[key] = number
            if key in MEAN_STATS:
                for sums, counts in ((self._interval_sum, self._interval_count), (self._run_sum, self._run_count)):
                    sums[key] = sums.get(key, 0.0) + number
                    counts[key] = counts.get(key, 0) + 1

    def _metrics(self, sums: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
        metrics = {f"{TELEMETRY_PREFIX}{key}": sums[key] / counts[key] for key in MEAN_STATS if counts.get(key)}
        metrics.update({f"{TELEMETRY_PREFIX}{key}": self.last[key] for key in LAST_STATS if key in self.last})
        return metrics

    @staticmethod
    def _utilization(acc: list[float]) -> dict[str, float]:
        return {f"{TELEMETRY_PREFIX}{UTILIZATION}": 1.0 - acc[0] / acc[1]} if acc[1] > 0 else {}

    def pop_interval(self) -> dict[str, float]:
        metrics = {f"{TELEMETRY_PREFIX}{key}": self._interval_sum[key] / self._interval_count[key]
                   for key in EVERY_LOG if self._interval_count.get(key)}
        metrics.update(self._utilization(self._interval_busy))
        changed = {key: self.last[key] for key in WHEN_CHANGED
                   if key in self.last and self._logged.get(key) != self.last[key]}
        self._logged.update(changed)
        metrics.update({f"{TELEMETRY_PREFIX}{key}": value for key, value in changed.items()})
        self._interval_sum, self._interval_count, self._interval_busy = {}, {}, [0.0, 0.0]
        return metrics

    def run_summary(self) -> dict[str, float]:
        return {**self._metrics(self._run_sum, self._run_count), **self._utilization(self._run_busy)}

    def reset(self) -> None:
        self.__init__()


class ZenFlowTelemetryCallback(TrainerCallback):
    """Reads `opt.stats()` right after each optimizer step (the figures are per last step)."""

    def __init__(self, telemetry: ZenFlowTelemetry) -> None:
        self.telemetry = telemetry
        self._previous: float | None = None  # perf_counter of the previous optimizer step

    def on_train_begin(self, args, state, control, **kwargs):
        self._previous = None  # the first step's wall time includes the set-up: not counted

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        now = time.perf_counter()
        wall = (now - self._previous) * 1e3 if self._previous is not None else None
        self._previous = now
        opt = unwrap_zenflow_optimizer(optimizer)
        if opt is not None:
            self.telemetry.record(opt.stats(), wall)
