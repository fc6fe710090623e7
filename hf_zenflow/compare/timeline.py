"""Device utilisation of a `compare` run and the timeline picture of one window of steps (timeline.png).

Device utilisation is the fraction of the training loop's wall time in which the device computes: forward,
backward, the gradient clip, the device-side optimizer work, scheduler and zero_grad. The rest is waiting: for the
host step, for copies, for syncs. It is measured from the training thread's own timers; the engines split their
``optimizer.step()`` into phases (`hf_zenflow.engine.telemetry.PHASES`), of which `WAIT_PHASES` are the device waiting
(the host AdamW run inline, a wait for the host worker, the copies each way). On CUDA the loop's phases are timed
with CUDA events on the current stream (`StepClock`), the waits with the engine's host-side timers.

The timeline draws, for each run, the steps of one window after the first `TIMING_SKIP` steps: the device lane
(busy / waiting), the host lane (the host step: synchronous offload's host AdamW, ZenFlow's worker jobs) and the
link lane (the copies inside ``optimizer.step()`` to and from the host). On a CPU device ZenFlow's gradient copies
that its gradient hooks start during backward are done by the training thread there and count as backward (device
busy); on CUDA they run on a side stream.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hf_zenflow.engine.telemetry import DEVICE_WAIT_PHASES as WAIT_PHASES
from hf_zenflow.engine.telemetry import device_wait_ms


#: Phases that use the host<->device link.
LINK_PHASES = ("handoff", "writeback")
#: Phases in which the host computes while the caller waits (synchronous offload's host AdamW).
HOST_PHASES = ("host_update",)
#: Steps drawn per run in timeline.png.
TIMELINE_STEPS = 6


class StepClock:
    """Marks the phase boundaries of one training step: ``perf_counter`` on a CPU device; on CUDA also CUDA events on
    the current stream, whose elapsed times are the device's own durations of the phases."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.times: list[float] = []
        self.events: list[Any] = []

    def mark(self) -> None:
        self.times.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def durations_ms(self) -> list[float]:
        """ms between consecutive marks (CUDA: by the events, once the last has completed)."""
        if self.cuda:
            self.events[-1].synchronize()  # Sync point: the last event must have run before it can be read
            return [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:])]


def wait_ms(phases: dict[str, float]) -> float:
    """The part of an engine's last `step()` in which the device waited (`WAIT_PHASES`), in ms."""
    return device_wait_ms(phases)


def device_utilization(step_ms: list[float], waits_ms: list[float]) -> float | None:
    """Busy share of the steps' wall time: 1 - sum(waits) / sum(steps)."""
    total = sum(step_ms)
    if total <= 0:
        return None
    return max(0.0, min(1.0, 1.0 - sum(waits_ms) / total))


class TimelineRecorder:
    """Collects the spans of the steps ``first .. first + TIMELINE_STEPS - 1`` of one run: lanes device, host, link;
    kinds busy / wait; times in ms from the window's start."""

    def __init__(self, first: int, steps: int = TIMELINE_STEPS) -> None:
        self.first, self.last = first, first + steps - 1
        self.origin: float | None = None
        self.end: float | None = None
        self.host_collected = False
        self.spans: list[tuple[str, str, float, float]] = []  # (lane, kind, start ms, end ms)

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last

    def _add(self, lane: str, kind: str, start: float, end: float) -> None:
        if end > start and self.origin is not None:
            self.spans.append((lane, kind, (start - self.origin) * 1e3, (end - self.origin) * 1e3))

    def record_step(self, step: int, start: float, end: float, opt: Any) -> None:
        """Call after every step (`start`, `end`: perf_counter s). In the window: the device is busy except in the
        engine's wait phases (`opt`'s last step spans). Two steps after the window, the host worker's jobs that ran
        inside the window are collected (by then they have finished; the worker keeps its latest 256)."""
        if self.wants(step):
            if self.origin is None:
                self.origin = start
            self.end = end
            stats = getattr(opt, "_stats", None)
            spans = list(getattr(stats, "last_spans", []) or [])
            cursor = start
            for t0, t1, name in sorted((t0, t1, name) for name, t0, t1 in spans if name in WAIT_PHASES):
                self._add("device", "busy", cursor, t0)
                self._add("device", "wait", t0, t1)
                if name in LINK_PHASES:
                    self._add("link", "copy", t0, t1)
                if name in HOST_PHASES:
                    self._add("host", "busy", t0, t1)
                cursor = max(cursor, t1)
            self._add("device", "busy", cursor, end)
        if step == self.last + 2:
            self.collect_host(opt)

    def collect_host(self, opt: Any) -> None:
        worker = getattr(getattr(opt, "host_windows", None), "worker", None)  # (ZenFlowAdamW)
        if worker is None or self.origin is None or self.end is None or self.host_collected:
            return
        self.host_collected = True
        for _, t0, t1 in list(getattr(worker, "job_spans", []) or []):
            self._add("host", "busy", max(t0, self.origin), min(t1, self.end))

    def to_dict(self) -> dict[str, Any]:
        return {"first_step": self.first, "last_step": self.last,
                "spans": [{"lane": lane, "kind": kind, "start_ms": a, "end_ms": b} for lane, kind, a, b in self.spans]}


COLORS = {("device", "busy"): "#2ca02c", ("device", "wait"): "#d62728", ("host", "busy"): "#1f77b4",
          ("link", "copy"): "#ff7f0e"}


def plot_timeline(results: dict[str, dict[str, Any]], path: Any, title: str) -> None:
    """timeline.png: `timeline_figure`, saved to `path`."""
    from hf_zenflow.compare.plots import pyplot

    fig = timeline_figure(results, title)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def timeline_figure(results: dict[str, dict[str, Any]], title: str) -> Any:
    """Per run, the device / host / link lanes of its recorded window, with its device utilisation; one x-axis
    scale for every run (from 0 to the longest window), so that a window twice as long looks twice as long."""
    from hf_zenflow.compare.plots import LABELS, pyplot

    plt = pyplot()
    names = [n for n in results if results[n].get("timeline")]
    fig, axes = plt.subplots(len(names) or 1, 1, figsize=(11, 1.6 + 1.5 * max(1, len(names))), squeeze=False,
                             sharex=True)
    longest = max((span["end_ms"] for n in names for span in results[n]["timeline"]["spans"]), default=0.0)
    lanes = ("link", "host", "device")
    for ax, name in zip(axes[:, 0], names):
        r = results[name]
        tl = r["timeline"]
        for span in tl["spans"]:
            y = lanes.index(span["lane"])
            ax.broken_barh([(span["start_ms"], span["end_ms"] - span["start_ms"])], (y - 0.4, 0.8),
                           facecolors=COLORS[(span["lane"], span["kind"])])
        ax.set_yticks(range(len(lanes)), ["link", "host", "device"])
        util = r.get("device_utilization")
        ax.set_title(f"{LABELS.get(name, name)}: steps {tl['first_step'] + 1}–{tl['last_step'] + 1}; device "
                     f"utilisation over the whole run {100 * util:.0f} %" if util is not None else name,
                     fontsize=9, loc="left")
        ax.set_xlabel("ms from the window's start (the same scale in every panel)", fontsize=8)
        ax.tick_params(labelbottom=True)  # (sharex hides the upper panels' tick labels)
    if longest > 0:
        axes[0, 0].set_xlim(0.0, longest * 1.02)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=f"{lane} {kind}") for (lane, kind), c in COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
