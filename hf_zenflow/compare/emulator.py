"""EMULATED accelerator: measure the end-to-end step time of no-offload AdamW, synchronous offload and ZenFlow on a
machine without a GPU. This is an emulation, and every figure it prints says so.

What is real and what is emulated
---------------------------------
* **Host side: real.** `SyncOffloadAdamW` and `ZenFlowAdamW` run unchanged on a scaled-down bf16 model whose
  parameters are CPU tensors (fp32 masters and moments on the host, as on a GPU machine). The host AdamW, the
  gradient accumulation, ZenFlow's background worker, its window hand-over and every stall the caller sees are real
  work on this machine's cores.
* **Device compute: emulated** as `time.sleep` (a wait that occupies no host core, as a GPU kernel would not) of the
  configured forward+backward time, plus the device's optimizer work (no-offload: the whole AdamW; ZenFlow: the
  selected columns and 1-D parameters), modelled as bytes moved / device memory bandwidth.
* **Host<->device link: emulated** as a real memory copy of the bytes the optimizer moves, paced (copy, then sleep
  the rest of bytes / bandwidth). ZenFlow's per-step gradient download runs on a separate "copy engine" thread that
  overlaps the next step's compute, as a CUDA side stream would, and the host worker does not fold a gradient in
  before its copy has landed (the engine's CUDA path waits on an event the same way). ZenFlow's write-back of the
  host result runs on the device timeline (the engine enqueues it on the compute stream).
* **Device-side optimizer work executed on the host.** The parameters are CPU tensors, so ZenFlow's device phases
  (gradient norms, column selection, the selected-column AdamW) execute on this CPU, where they are ~100x slower
  than on a GPU. Their measured time (the engine's own phase timers) is taken out of the step and their modelled
  device time put in. While they execute, the host worker keeps running, so it gets that much extra overlap per
  step; the JSON keeps the per-step executed time (``device_phases_on_host_real_ms``) and the unadjusted step times
  so the size of that bias can be checked.

Time scaling
------------
The host work runs on `emulated_params` parameters instead of the full model. One calibration step measures the
host AdamW on them (the `host_update` phase of `SyncOffloadAdamW`); the time-compression factor is
``s = full-model CPU update ms / measured host AdamW ms``. Every modelled time (compute, links, device optimizer) is
divided by ``s`` for the real waits, and every measured wall time is multiplied by ``s`` when reported. This assumes
all host work (AdamW, accumulation, copies) scales linearly with the parameter count, and it scales fixed per-step
costs (Python overhead, thread hand-offs) by ``s`` as well, which makes the offloading schedules look *slower*, never
faster; the default of 1e8 emulated parameters keeps the factor near 30 (at 24e6 it was 50-150 and ~1.5 ms of
per-step Python overhead became ~100 ms "full scale"). The copy pacing needs real copies to be at least as fast as
the scaled link. When one is slower (this host is small and shared), the step is accounted with the scenario's link
time instead of the real copy time, for every schedule alike, and the table reports the real per-copy time next to
the target.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


#: AdamW bytes per parameter on the device: read bf16 grad + fp32 master, exp_avg, exp_avg_sq (14 B), write the
#: three fp32 tensors and the bf16 parameter (14 B).
DEVICE_ADAMW_BYTES_PER_PARAM = 28
#: bf16 gradients and parameters cross the link.
LINK_BYTES_PER_PARAM = 2

#: The published Llama-2-7B host figure: CPUAdam over 7e9 parameters in 4600 ms on 128 threads (zenflow.md §2).
PUBLISHED_HOST_PARAMS_PER_S = 7e9 / 4.6
PUBLISHED_HOST_CORES = 128

#: Key of the per-step host-executed device-phase time in a ZenFlow row's "extra".
EXEC_KEY = "device_phases_on_host_real_ms"

#: ZenFlow's rows: the window summed on the host (the default) or on the device (``accumulate_on="device"``).
ZENFLOW_ROWS = ("zenflow", "zenflow_device_accumulation")

HEADER = "EMULATED ACCELERATOR (no GPU used): device compute = timed waits, link = paced real copies, host = real code"


@dataclass
class EmulatorScenario:
    """Full-scale figures of one hardware scenario (times in ms for the whole model, one optimizer step)."""

    name: str = "custom"
    params: float = 7e9
    forward_ms: float = 45.0
    backward_ms: float = 2000.0
    grad_offload_ms: float = 500.0  # device->host, all bf16 gradients
    param_upload_ms: float = 500.0  # host->device, all bf16 parameters
    cpu_update_ms: float | None = 4600.0  # host AdamW over the whole model; None = extrapolate from this machine
    device_optimizer_ms: float | None = None  # AdamW over the whole model on the device; None = from bandwidth
    device_mem_gbps: float = 8000.0  # aggregate device memory bandwidth used for device optimizer work
    host_cores: int | None = 128
    topk_ratio: float = 0.1
    update_interval: int = 4
    emulated_params: float = 100e6
    steps: int = 14
    warmup_steps: int = 2
    host_threads: int | None = None
    notes: str = ""

    @property
    def device_compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def resolved_device_optimizer_ms(self) -> float:
        if self.device_optimizer_ms is not None:
            return self.device_optimizer_ms
        return self.params * DEVICE_ADAMW_BYTES_PER_PARAM / (self.device_mem_gbps * 1e9) * 1e3


def llama2_7b_4xa100() -> EmulatorScenario:
    """The breakdown published with ZenFlow for Llama-2-7B on 4xA100 with ZeRO-Offload and CPUAdam on 128 threads
    (zenflow.md §2): forward 45 ms, backward 2000 ms, gradient offload 500 ms, CPU update 4600 ms, upload 500 ms."""
    return EmulatorScenario(
        name="llama2-7b-4xa100", params=7e9, forward_ms=45.0, backward_ms=2000.0, grad_offload_ms=500.0,
        param_upload_ms=500.0, cpu_update_ms=4600.0, device_mem_gbps=4 * 2000.0, host_cores=128,
        notes="published ZeRO-Offload breakdown; device optimizer time assumed = 7e9 x 28 B over 4 x 2 TB/s HBM "
              "(data-parallel ZeRO partitions: each GPU updates a quarter)",
    )


SCENARIOS = {"llama2-7b-4xa100": llama2_7b_4xa100}


# ---------------------------------------------------------------------------------------------------------------------
# Emulated device pieces
# ---------------------------------------------------------------------------------------------------------------------
class PacedLink:
    """A host<->device link: a real memory copy of `nbytes`, then a wait for the rest of nbytes / bandwidth.

    `bytes_per_s` is the real-time bandwidth (already divided by the time-compression factor).
    """

    def __init__(self, capacity_bytes: int, bytes_per_s: float) -> None:
        self.bytes_per_s = float(bytes_per_s)
        n = max(1, int(capacity_bytes))
        self._src = torch.ones(n, dtype=torch.uint8)
        self._dst = torch.empty(n, dtype=torch.uint8)
        self._dst.zero_()  # touch the pages now: a first-touch page fault is not link time
        self.copies = 0
        self.copy_s = 0.0  # time spent in real copies
        self.total_s = 0.0  # time including the pacing wait

    def target_s(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0

    def copy(self, nbytes: int, already_spent_s: float = 0.0) -> float:
        """Move `nbytes` (real copy, chunked through the buffer), pace to the bandwidth; returns seconds taken.

        `already_spent_s`: time the caller already spent copying these bytes itself (the optimizer's own host copy);
        then no further copy is made and only the rest of the pacing wait is slept.
        """
        start = time.perf_counter()
        if already_spent_s <= 0 and nbytes > 0:
            left = int(nbytes)
            cap = self._src.numel()
            while left > 0:
                n = min(left, cap)
                self._dst[:n].copy_(self._src[:n])
                left -= n
        copied = time.perf_counter() - start + max(0.0, already_spent_s)
        rest = self.target_s(nbytes) - copied
        if rest > 0:
            time.sleep(rest)
        took = time.perf_counter() - start + max(0.0, already_spent_s)
        self.copies += 1
        self.copy_s += copied
        self.total_s += took
        return took


class CopyEngine:
    """One DMA channel on its own thread: copies run one after another, overlapping whatever the caller does."""

    def __init__(self, link: PacedLink) -> None:
        self.link = link
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: threading.Event | None = None
        self._thread = threading.Thread(target=self._run, name="emulated-copy-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            nbytes, done = job
            self.link.copy(nbytes)
            done.set()

    def start(self, nbytes: int) -> tuple[threading.Event, float]:
        """Enqueue a copy; returns its completion event and how long the caller waited for the channel."""
        waited = 0.0
        if self._last is not None and not self._last.is_set():
            t0 = time.perf_counter()
            self._last.wait()  # the channel is still busy with the previous step's copy: a link stall
            waited = time.perf_counter() - t0
        done = threading.Event()
        self._last = done
        self._jobs.put((nbytes, done))
        return done, waited

    def drain(self) -> None:
        if self._last is not None:
            self._last.wait()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)


class DeviceClock:
    """The device timeline: compute is a sleep of the modelled time, compressed by `scale`."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def seconds(self, full_ms: float) -> float:
        """Real seconds standing for `full_ms` of full-scale device time."""
        return full_ms / self.scale / 1e3

    def compute(self, full_ms: float) -> None:
        want = self.seconds(full_ms)
        if want > 0:
            time.sleep(want)


# ---------------------------------------------------------------------------------------------------------------------
# The scaled-down model
# ---------------------------------------------------------------------------------------------------------------------
def emulated_model(n_params: float, seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """Llama-shaped bf16 matrices (q, k, v, o, gate, up, down and two norms per layer) totalling about `n_params`,
    and one fixed bf16 gradient per parameter whose energy sits on ~5% of the input columns (the skew ZenFlow's
    selection relies on, zenflow.md §2)."""
    hidden = 1024 if n_params >= 8e6 else 256
    inter = int(hidden * 2.75)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round(n_params / per_layer))
    gen = torch.Generator().manual_seed(seed)
    shapes: list[tuple[int, ...]] = []
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    params, grads = [], []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
        g = torch.randn(shape, generator=gen) * 1e-3
        if len(shape) == 2:
            hot = torch.rand(shape[1], generator=gen) < 0.05
            g[:, hot] *= 10.0
        params.append(p)
        grads.append(g.to(torch.bfloat16))
    return params, grads


def _set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g  # the same tensors every step: the optimizers only read them


def _offloaded_grad_bytes(params: list[torch.nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.ndim >= 2)


# ---------------------------------------------------------------------------------------------------------------------
# The three schedules
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class _Run:
    step_s: list[float]
    extra: dict[str, Any]


def _calibrate(params: list[torch.nn.Parameter], grads: list[torch.Tensor], threads: int) -> float:
    """Median host-AdamW seconds of `SyncOffloadAdamW` on the scaled model (its `host_update` phase)."""
    from hf_zenflow import SyncOffloadAdamW

    opt = SyncOffloadAdamW(params, lr=1e-5, cpu_threads=threads)
    samples = []
    for _ in range(5):
        _set_grads(params, grads)
        opt.step()
        samples.append(opt.stats()["cp_host_update_ms"] / 1e3)
    opt.close()
    return statistics.median(samples[1:])


def _run_no_offload(sc: EmulatorScenario, clock: DeviceClock) -> _Run:
    steps = []
    for _ in range(sc.steps):
        t0 = time.perf_counter()
        clock.compute(sc.device_compute_ms + sc.resolved_device_optimizer_ms())
        steps.append(time.perf_counter() - t0)
    return _Run(steps, {})


def _run_sync(sc: EmulatorScenario, clock: DeviceClock, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
              link_down: PacedLink, link_up: PacedLink, threads: int) -> _Run:
    from hf_zenflow import SyncOffloadAdamW

    opt = SyncOffloadAdamW(params, lr=1e-5, cpu_threads=threads)
    steps, host_ms, link_ms = [], [], []
    for _ in range(sc.steps):
        t0 = time.perf_counter()
        clock.compute(sc.device_compute_ms)
        _set_grads(params, grads)
        opt.step()
        st = opt.stats()
        # The optimizer's own host copies are the link transfers here: pace them to the link bandwidth.
        down = link_down.copy(int(st["bytes_to_host"]), already_spent_s=st["cp_handoff_ms"] / 1e3)
        up = link_up.copy(int(st["bytes_to_device"]), already_spent_s=st["cp_writeback_ms"] / 1e3)
        # A transfer costs the link time of the scenario: a real copy slower than that (this small host, busy) is
        # accounted at the link time, for every schedule alike.
        excess = max(0.0, down - link_down.target_s(int(st["bytes_to_host"]))) + max(
            0.0, up - link_up.target_s(int(st["bytes_to_device"])))
        steps.append(time.perf_counter() - t0 - excess)
        host_ms.append(st["cp_host_update_ms"])
        link_ms.append((down + up) * 1e3)
    opt.close()
    return _Run(steps, {"host_update_real_ms": host_ms, "link_real_ms": link_ms})


def _run_zenflow(sc: EmulatorScenario, clock: DeviceClock, params: list[torch.nn.Parameter],
                 grads: list[torch.Tensor], link_down: PacedLink, link_up: PacedLink, threads: int,
                 accumulate_on: str = "host") -> _Run:
    """ZenFlow's schedule. ``accumulate_on="host"``: every step's bf16 gradient crosses the link and the host worker
    adds it up. ``"device"``: the window is summed on the device (modelled device time) and its fp32 sum crosses
    the link once per window; the host worker only runs the AdamW."""
    from hf_zenflow import ZenFlowAdamW

    on_device = accumulate_on == "device"
    opt = ZenFlowAdamW(params, lr=1e-5, topk_ratio=sc.topk_ratio, update_interval=sc.update_interval,
                       overlap_step=True, cpu_threads=threads, select_strategy="step", select_interval=100,
                       accumulate_on=accumulate_on,
                       min_offload_numel=0)  # the scaled-down stand-in of a model whose matrices are all offloaded
    engine = CopyEngine(link_down)
    grad_bytes_bf16 = _offloaded_grad_bytes(params)
    offloaded = sum(p.numel() for p in params if p.ndim >= 2)
    worker_gate = hasattr(opt, "_host")
    dense_fraction = sum(p.numel() for p in params if p.ndim < 2) / sum(p.numel() for p in params)
    # device-side window sum: read the bf16 gradient, read and write the fp32 sum (10 B per offloaded parameter)
    device_accumulate_ms = (sc.params * offloaded / sum(p.numel() for p in params) * 10
                            / (sc.device_mem_gbps * 1e9) * 1e3) if on_device else 0.0
    steps, raw, stalls, device_exec, waits, link_waits = [], [], [], [], [], []
    host_jobs: list[float] = []
    accumulate: list[float] = []
    for _ in range(sc.steps):
        t0 = time.perf_counter()
        clock.compute(sc.device_compute_ms)
        _set_grads(params, grads)
        link_wait = 0.0
        schedule = opt._schedule
        closes = (schedule.window_steps if schedule is not None else 0) + 1 >= sc.update_interval
        if not on_device or closes:
            # The download starts when backward ends (host accumulation: this step's bf16 gradient; device
            # accumulation: the window's fp32 sum, when the window closes), on the copy engine; the host worker
            # must not use it before it has landed (the CUDA path waits on a copy event the same way).
            landed, link_wait = engine.start(grad_bytes_bf16 if not on_device else offloaded * 4)
            if worker_gate:
                opt._host.ensure_worker().submit("emulated_link_d2h", landed.wait)
        opt.step()
        st = opt.stats()
        device_phases = ("norms", "select", "device_update") + (("handoff",) if on_device else ())
        executed = sum(st[f"cp_{phase}_ms"] for phase in device_phases) / 1e3
        selected = st.get("selected_fraction", sc.topk_ratio)
        modelled = sc.resolved_device_optimizer_ms() * (selected + dense_fraction) + (
            # the gradient-norm pass reads every bf16 gradient once on the device
            sc.params * LINK_BYTES_PER_PARAM / (sc.device_mem_gbps * 1e9) * 1e3) + device_accumulate_ms
        if st["bytes_to_device"] > 0:
            # Write-back of the host result: host->device on the compute stream, so on the device timeline.
            nbytes = int(st["bytes_to_device"])
            took = link_up.copy(nbytes, already_spent_s=st["cp_writeback_ms"] / 1e3)
            executed += max(0.0, took - link_up.target_s(nbytes))  # accounted at the link time, as for sync
        wall = time.perf_counter() - t0
        # Device work executed on the host is accounted at its modelled device time (see the module docstring).
        raw.append(wall)
        steps.append(wall - executed + clock.seconds(modelled))  # `executed` includes any link-copy excess
        stalls.append(st["cp_wait_ms"] + (0.0 if on_device else st["cp_handoff_ms"]))
        waits.append(st["cp_wait_ms"])
        device_exec.append(executed * 1e3)
        link_waits.append(link_wait * 1e3)
        # stats() reports the LAST job of each kind: sample the accumulation every step, and each host AdamW once
        # (a new value means a new window finished)
        if st.get("accumulate_ms"):
            accumulate.append(st["accumulate_ms"])
        if st.get("host_step_ms") and (not host_jobs or st["host_step_ms"] != host_jobs[-1]):
            host_jobs.append(st["host_step_ms"])
    engine.drain()
    opt.flush()
    st = opt.stats()
    opt.close()
    engine.close()
    return _Run(steps, {"stall_real_ms": stalls, "wait_real_ms": waits, "device_phases_on_host_real_ms": device_exec,
                        "link_channel_wait_real_ms": link_waits, "unadjusted_step_real_ms": [x * 1e3 for x in raw],
                        "host_adamw_real_ms": host_jobs, "accumulate_real_ms": accumulate,
                        "selected_fraction": st.get("selected_fraction"), "accumulate_on": accumulate_on,
                        "windows": st.get("windows"), "worker_gated_on_link": worker_gate})


def run_estimate(sc: EmulatorScenario, progress: bool = True) -> dict[str, Any]:
    """Run the three schedules in one process and return the measured step times, scaled to the full model."""
    from hf_zenflow.config import available_cpu_count

    # The training thread keeps one core, the host worker gets the rest (as DeepSpeed reserves cores). The training
    # thread is busy here (it executes the device phases), so a worker on every core would oversubscribe them; the
    # calibration uses the same thread count, so the full-scale host AdamW time does not depend on it.
    threads = sc.host_threads or max(1, available_cpu_count() - 1)
    before_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params, grads = emulated_model(sc.emulated_params)
        n_emu = sum(p.numel() for p in params)
        host_real_s = _calibrate(params, grads, threads)
        if sc.cpu_update_ms is not None:
            cpu_update_ms = sc.cpu_update_ms
            cpu_note = "given"
        else:
            # Anchored on the published host rate, not on this machine: a 2-core VM says little about a 128-core
            # server, and linear scaling from 2 cores would promise a host AdamW far faster than the one measured.
            cores = sc.host_cores or PUBLISHED_HOST_CORES
            rate = PUBLISHED_HOST_PARAMS_PER_S * cores / PUBLISHED_HOST_CORES
            cpu_update_ms = sc.params / rate * 1e3
            here = n_emu / host_real_s
            cpu_note = (f"extrapolated: the published CPUAdam rate ({PUBLISHED_HOST_PARAMS_PER_S / 1e9:.2f} Gparam/s "
                        f"on {PUBLISHED_HOST_CORES} threads, Llama-2-7B) x {cores}/{PUBLISHED_HOST_CORES} cores, "
                        f"linear in cores (optimistic for a memory-bound step); this machine: {here / 1e9:.2f} "
                        f"Gparam/s on {threads} threads")
        scale = cpu_update_ms / (host_real_s * 1e3)
        ratio = sc.params / n_emu
        # Link bandwidth in real time: the full model's bf16 bytes in grad_offload_ms, compressed by `scale`, for the
        # emulated model's bytes.
        emu_link_bytes = n_emu * LINK_BYTES_PER_PARAM
        down_bps = emu_link_bytes / (sc.grad_offload_ms / scale / 1e3) if sc.grad_offload_ms > 0 else 0.0
        up_bps = emu_link_bytes / (sc.param_upload_ms / scale / 1e3) if sc.param_upload_ms > 0 else 0.0
        cap = 64 * 1024 * 1024
        links: dict[str, tuple[PacedLink, PacedLink]] = {}
        if progress:
            print(f"[estimate] {HEADER}", flush=True)
            print(f"[estimate] scenario {sc.name}: {sc.params / 1e9:.2f}B params emulated by {n_emu / 1e6:.1f}M real "
                  f"bf16 params; host AdamW measured {host_real_s * 1e3:.2f} ms -> time compression x{scale:.1f}",
                  flush=True)
        runs: dict[str, _Run] = {}
        for name, fn in (("no_offload", lambda c, d, u: _run_no_offload(sc, c)),
                         ("sync_offload", lambda c, d, u: _run_sync(sc, c, params, grads, d, u, threads)),
                         ("zenflow", lambda c, d, u: _run_zenflow(sc, c, params, grads, d, u, threads)),
                         ("zenflow_device_accumulation",
                          lambda c, d, u: _run_zenflow(sc, c, params, grads, d, u, threads, "device"))):
            if progress:
                print(f"[estimate] running {name} for {sc.steps} steps ...", flush=True)
            for p in params:
                p.grad = None
            links[name] = (PacedLink(cap, down_bps), PacedLink(cap, up_bps))
            runs[name] = fn(DeviceClock(scale), *links[name])
    finally:
        torch.set_num_threads(before_threads)

    def full_ms(seconds: list[float]) -> list[float]:
        return [s * 1e3 * scale for s in seconds]

    compute = sc.device_compute_ms
    out_rows: dict[str, dict[str, Any]] = {}
    for name, r in runs.items():
        timed = full_ms(r.step_s[sc.warmup_steps:]) or full_ms(r.step_s)
        mean = statistics.fmean(timed)
        out_rows[name] = {
            # the step time every ratio uses: the measured mean, or the host work per step when that is longer
            # (ZenFlow below); step_ms_mean/median/min/max stay the measured per-step figures
            "step_ms": mean,
            "step_ms_mean": mean,
            "step_ms_median": statistics.median(timed),
            "step_ms_min": min(timed),
            "step_ms_max": max(timed),
            # what the optimizer adds on top of forward+backward: the critical path of the optimizer step
            "optimizer_critical_path_ms": mean - compute,
            "device_idle_fraction": max(0.0, 1.0 - (compute + (sc.resolved_device_optimizer_ms()
                                                                if name == "no_offload" else 0.0)) / mean),
            "steps_timed": len(timed),
            # mean time per link transfer, full scale (None: the schedule moved nothing that way)
            "link_down_ms_per_copy": _achieved_full(links[name][0], scale),
            "link_up_ms_per_copy": _achieved_full(links[name][1], scale),
            "per_step_ms": full_ms(r.step_s),
            "extra": {k: ([x * scale for x in v] if k.endswith("_ms") and isinstance(v, list) else v)
                      for k, v in r.extra.items()},
        }
    # ZenFlow's host worker must finish one window's work (U accumulations + one AdamW) per U steps, or the device
    # waits for it: in steady state a step cannot be shorter than the worker's work per step. The emulator measures
    # that work directly (the worker's own job timers), so the step time is also bounded by it; this also removes
    # the bias of the extra overlap the worker gets while device phases execute on the host.
    interval = max(1, int(sc.update_interval))
    for key in ZENFLOW_ROWS:
        zen = out_rows[key]
        acc, adamw = zen["extra"].get("accumulate_real_ms") or [], zen["extra"].get("host_adamw_real_ms") or []
        floor = (statistics.fmean(acc) if acc else 0.0) + (statistics.fmean(adamw) / interval if adamw else 0.0)
        zen["host_work_per_step_ms"] = floor
        zen["host_bound"] = floor > zen["step_ms_mean"]
        if zen["host_bound"]:
            zen["step_ms"] = floor
            zen["optimizer_critical_path_ms"] = floor - compute
            zen["device_idle_fraction"] = max(0.0, 1.0 - compute / floor)
    base, sync = out_rows["no_offload"], out_rows["sync_offload"]
    summary: dict[str, float] = {"sync_step_vs_no_offload": sync["step_ms"] / base["step_ms"]}
    for key in ZENFLOW_ROWS:
        zen = out_rows[key]
        summary[f"{key}_speedup_vs_sync"] = sync["step_ms"] / zen["step_ms"]
        summary[f"{key}_step_vs_no_offload"] = zen["step_ms"] / base["step_ms"]
        summary[f"{key}_critical_path_vs_sync"] = (
            zen["optimizer_critical_path_ms"] / sync["optimizer_critical_path_ms"]
            if sync["optimizer_critical_path_ms"] > 0 else math.nan)
    return {
        "label": HEADER,
        "scenario": asdict(sc),
        "emulated_params": n_emu,
        "params_ratio": ratio,
        "host_threads": threads,
        "host_adamw_real_ms": host_real_s * 1e3,
        "cpu_update_ms": cpu_update_ms,
        "cpu_update_source": cpu_note,
        "time_compression": scale,
        "device_optimizer_ms": sc.resolved_device_optimizer_ms(),
        "link_real_gbps": {"down": down_bps / 1e9, "up": up_bps / 1e9},
        "results": out_rows,
        "summary": summary,
    }


def _achieved_full(link: PacedLink, scale: float) -> float | None:
    return link.total_s / link.copies * 1e3 * scale if link.copies else None


def format_estimate(res: dict[str, Any]) -> str:
    sc = res["scenario"]
    rows = res["results"]
    lines = [f"## {res['label']}", "",
             f"Scenario `{sc['name']}`: {sc['params'] / 1e9:.2f}B params; forward+backward "
             f"{sc['forward_ms'] + sc['backward_ms']:.0f} ms; "
             f"gradient offload {sc['grad_offload_ms']:.0f} ms; parameter upload {sc['param_upload_ms']:.0f} ms; "
             f"host AdamW {res['cpu_update_ms']:.0f} ms ({res['cpu_update_source']}); device AdamW "
             f"{res['device_optimizer_ms']:.1f} ms; ZenFlow topk_ratio {sc['topk_ratio']}, update_interval "
             f"{sc['update_interval']}.", "",
             "| schedule | measured step ms: mean | median | min | max | host work ms per step | step ms (the larger "
             "of measured mean and host work) | optimizer critical path ms (step - fwd/bwd) | device idle | "
             "vs no-offload | vs sync offload |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = rows["no_offload"]["step_ms"]
    sync = rows["sync_offload"]["step_ms"]
    names = {"no_offload": "no offload (AdamW on device)", "sync_offload": "SyncOffloadAdamW (ZeRO-Offload schedule)",
             "zenflow": "ZenFlowAdamW (window summed on the host)",
             "zenflow_device_accumulation": 'ZenFlowAdamW, accumulate_on="device" (+4 B/param on the device)'}
    for key, label in names.items():
        r = rows[key]
        versus = "1.00x" if key == "sync_offload" else f"{sync / r['step_ms']:.2f}x faster"
        host = r.get("host_work_per_step_ms")
        used = f"**{r['step_ms']:.0f}** (host-bound)" if r.get("host_bound") else f"{r['step_ms']:.0f}"
        lines.append(f"| {label} | {r['step_ms_mean']:.0f} | {r['step_ms_median']:.0f} | {r['step_ms_min']:.0f} | "
                     f"{r['step_ms_max']:.0f} | {_f(host)} | {used} | {r['optimizer_critical_path_ms']:.0f} | "
                     f"{100 * r['device_idle_fraction']:.0f}% | {r['step_ms'] / base:.2f}x | {versus} |")
    s = res["summary"]
    lines.append("")
    for key in ZENFLOW_ROWS:
        lines.append(f"{names[key]} vs synchronous offload: **{s[f'{key}_speedup_vs_sync']:.2f}x** faster per step; "
                     f"optimizer critical path ratio **{s[f'{key}_critical_path_vs_sync']:.3f}x**; step = "
                     f"{s[f'{key}_step_vs_no_offload']:.2f}x the no-offload step.")
    zen, dev = rows["zenflow"], rows["zenflow_device_accumulation"]
    lines += ["",
              "Assumptions (emulation):",
              "- real: host AdamW / accumulation / ZenFlow worker of hf_zenflow on "
              f"{res['emulated_params'] / 1e6:.1f}M bf16 params ({res['host_threads']} host threads on this machine); "
              "measured host AdamW "
              f"{res['host_adamw_real_ms']:.2f} ms, scaled by x{res['time_compression']:.1f} to "
              f"{res['cpu_update_ms']:.0f} ms (all host work assumed linear in the parameter count);",
              "- emulated: device compute and device AdamW as timed waits; links as real copies paced to "
              f"{res['link_real_gbps']['down']:.1f} / {res['link_real_gbps']['up']:.1f} GB/s real time; achieved per "
              "copy, full scale: sync offload down "
              f"{_f(rows['sync_offload']['link_down_ms_per_copy'])} / up "
              f"{_f(rows['sync_offload']['link_up_ms_per_copy'])} ms, ZenFlow down "
              f"{_f(zen['link_down_ms_per_copy'])} / up {_f(zen['link_up_ms_per_copy'])} ms, device accumulation "
              f"down {_f(dev['link_down_ms_per_copy'])} (one fp32 sum per window) / up "
              f"{_f(dev['link_up_ms_per_copy'])} ms (targets {sc['grad_offload_ms']:.0f} / "
              f"{sc['param_upload_ms']:.0f} ms for bf16; a longer real copy is accounted at the target);",
              "- ZenFlow's device phases (norms, selection, selected-column AdamW; with accumulate_on=\"device\" also "
              "the window sum) execute on this CPU; their measured time (mean "
              f"{_mean_or_nan(zen['extra'].get(EXEC_KEY)):.0f} / {_mean_or_nan(dev['extra'].get(EXEC_KEY)):.0f} "
              "ms/step full scale) is replaced by the modelled device time (selected fraction x device AdamW + one "
              "gradient read, + 10 B per offloaded parameter for the device sum); the host worker keeps running "
              "meanwhile (extra overlap, a bias in ZenFlow's favour of at most that much per step);"]
    for key in ZENFLOW_ROWS:
        r = rows[key]
        lines.append(f"- {names[key]}: host worker work per step (mean accumulation + host AdamW / update_interval, "
                     f"its own job timers) {r['host_work_per_step_ms']:.0f} ms full scale against a measured step of "
                     f"{r['step_ms_mean']:.0f} ms; "
                     + ("the schedule is HOST-BOUND: the \"step ms\" column and the ratios use the host work "
                        "per step, the measured columns stay measured;"
                        if r["host_bound"] else "the device, not the host, bounds the step;"))
    lines += ["- one training process, one device timeline: data-parallel communication is not modelled.",
              f"- {sc['notes']}" if sc["notes"] else ""]
    return "\n".join(line for line in lines if line is not None).rstrip() + "\n"


def _mean_or_nan(values: list[float] | None) -> float:
    return statistics.fmean(values) if values else math.nan


def _f(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"


# ---------------------------------------------------------------------------------------------------------------------
# CLI glue
# ---------------------------------------------------------------------------------------------------------------------
def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                   help="a calibrated preset; other flags given explicitly override its values")
    p.add_argument("--params", "--model-params", dest="params", type=float, default=None,
                   help="model parameters (e.g. 7e9) [7e9]")
    add_hardware_arguments(p)
    p.add_argument("--device-step-ms", type=float, default=None,
                   help="forward+backward time of one step on the device [2045]")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="host<->device bandwidth per direction, GB/s; sets the offload/upload times for bf16 "
                        "gradients/parameters [28, i.e. 500 ms for 7B]")
    p.add_argument("--host-cores", type=int, default=None,
                   help="host cores of the target machine: without --cpu-update-ms the host AdamW time is the "
                        "published rate (7e9 params in 4.6 s on 128 threads) scaled linearly to these cores [128]")
    p.add_argument("--cpu-update-ms", type=float, default=None,
                   help="host AdamW time for the whole model on the target machine (else extrapolated)")
    p.add_argument("--device-optimizer-ms", type=float, default=None,
                   help="AdamW over the whole model on the device (else params x 28 B / --device-mem-gbps)")
    p.add_argument("--device-mem-gbps", type=float, default=None, help="device memory bandwidth, GB/s [8000]")
    p.add_argument("--topk-ratio", type=float, default=None, help="[0.1]")
    p.add_argument("--update-interval", type=int, default=None, help="[4]")
    p.add_argument("--emulated-params", type=float, default=None,
                   help="real parameters the host code runs on (the scaled-down model; ~4 GB of host memory at "
                        "the default) [1e8]")
    p.add_argument("--steps", type=int, default=None, help="steps per schedule [14]")
    p.add_argument("--host-threads", type=int, default=None,
                   help="host worker threads here (cpu_threads; default: the cores in this process's affinity "
                        "minus one, as the training thread runs one thread: README, Threads)")
    p.add_argument("--output", default=None, help="write the result as JSON to this file")


def add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    from hf_zenflow.compare.hardware import PROFILES

    p.add_argument("--hardware", default=None,
                   help=f"a hardware profile: a preset ({', '.join(sorted(PROFILES))}) or a JSON file with the fields "
                        "of hf_zenflow.compare.hardware.HardwareProfile (device_tflops, device_mem_gb, "
                        "device_mem_gbps, link_gbps, host_cores, host_mem_gbps, mfu). Prints the bound model (where "
                        "each schedule is bound and which setting moves the bound), then runs the emulator on the "
                        "profile's figures; explicit flags override them")
    p.add_argument("--tokens-per-step", type=float, default=4096,
                   help="with --hardware: tokens per optimizer step (forward+backward = 6 x params x tokens FLOPs)")
    p.add_argument("--model-only", action="store_true",
                   help="with --hardware: print the bound model only, do not run the emulator")


def scenario_from_profile(profile: Any, params: float, tokens_per_step: float) -> EmulatorScenario:
    """The emulator scenario of a `hardware.HardwareProfile`: its forward+backward, link and host AdamW times."""
    from hf_zenflow.compare.hardware import schedule_model

    rows = schedule_model(profile, params, tokens_per_step)
    link_ms = rows["sync_offload"]["link_ms"] / 2
    return EmulatorScenario(
        name=f"hardware:{profile.name}", params=params, forward_ms=0.0, backward_ms=rows["no_offload"]["compute_ms"],
        grad_offload_ms=link_ms, param_upload_ms=link_ms, cpu_update_ms=rows["sync_offload"]["host_ms"],
        device_mem_gbps=profile.device_mem_gbps, host_cores=profile.host_cores,
        notes=f"hardware profile {profile.name}: forward+backward = 6 x params x {tokens_per_step:.0f} tokens at "
              f"{profile.mfu:g} of {profile.device_tflops:g} TFLOP/s; host AdamW at the published per-core CPUAdam "
              f"rate x {profile.host_cores} cores (capped by {profile.host_mem_gbps:g} GB/s)")


def scenario_from_args(args: argparse.Namespace) -> EmulatorScenario:
    hardware = getattr(args, "hardware", None)
    if hardware:
        from hf_zenflow.compare.hardware import load_profile

        sc = scenario_from_profile(load_profile(hardware), args.params or EmulatorScenario.params,
                                   args.tokens_per_step)
        for attr in ("topk_ratio", "update_interval", "emulated_params", "steps", "host_threads", "cpu_update_ms",
                     "device_optimizer_ms", "device_mem_gbps", "host_cores"):
            if getattr(args, attr) is not None:
                setattr(sc, attr, getattr(args, attr))
        if args.device_step_ms is not None:
            sc.backward_ms = args.device_step_ms
        if args.link_gbps is not None:
            sc.grad_offload_ms = sc.param_upload_ms = sc.params * LINK_BYTES_PER_PARAM / (args.link_gbps * 1e9) * 1e3
        return sc
    sc = SCENARIOS[args.scenario]() if args.scenario else EmulatorScenario(cpu_update_ms=None)
    if args.params is not None:
        sc.params = args.params
        if args.scenario and args.cpu_update_ms is None:
            sc.cpu_update_ms = None  # a different model size: the calibrated CPU time no longer applies
    if args.device_step_ms is not None:
        sc.forward_ms, sc.backward_ms = 0.0, args.device_step_ms
    if args.link_gbps is not None:
        ms = sc.params * LINK_BYTES_PER_PARAM / (args.link_gbps * 1e9) * 1e3
        sc.grad_offload_ms = sc.param_upload_ms = ms
    for attr in ("host_cores", "cpu_update_ms", "device_optimizer_ms", "device_mem_gbps", "topk_ratio",
                 "update_interval", "emulated_params", "steps", "host_threads"):
        value = getattr(args, attr)
        if value is not None:
            setattr(sc, attr, value)
    if not args.scenario:
        sc.name = "custom"
        if args.link_gbps is None:
            # default link: 28 GB/s per direction (the published 500 ms for 7B bf16 gradients)
            sc.grad_offload_ms = sc.param_upload_ms = sc.params * LINK_BYTES_PER_PARAM / 28e9 * 1e3
    return sc


def estimate_from_args(args: argparse.Namespace) -> dict[str, Any]:
    sc = scenario_from_args(args)
    if getattr(args, "hardware", None):
        from hf_zenflow.compare.hardware import format_schedule_model, load_profile

        print(format_schedule_model(load_profile(args.hardware), sc.params, args.tokens_per_step, sc.topk_ratio,
                                    sc.update_interval, device_step_ms=args.device_step_ms), flush=True)
        if args.model_only:
            return {"scenario": asdict(sc)}
    res = run_estimate(sc)
    print(format_estimate(res), flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(res, indent=2, default=str), encoding="utf-8")
    return res
