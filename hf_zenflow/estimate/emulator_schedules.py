"""The emulated schedules: no-offload AdamW, synchronous offload and ZenFlow run step by step on the emulated device
(`emulator_device`), and `run_estimate` scales their measured step times to the full model (module `emulator`
explains what is real and what is emulated)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hf_zenflow.estimate.emulator_device import (
    CopyEngine,
    DeviceClock,
    PacedLink,
    emulated_model,
    offloaded_grad_bytes,
    set_grads,
)
from hf_zenflow.estimate.emulator_scenario import (
    HEADER,
    LINK_BYTES_PER_PARAM,
    PUBLISHED_HOST_CORES,
    PUBLISHED_HOST_PARAMS_PER_S,
    ZENFLOW_ROWS,
    EmulatorScenario,
)
from hf_zenflow.estimate.profiles import HOST_ADAMW_BYTES_PER_PARAM
from hf_zenflow.optimizer import SyncOffloadAdamW, ZenFlowAdamW
from hf_zenflow.settings.threads import available_cpu_count


@dataclass
class _Run:
    step_s: list[float]
    extra: dict[str, Any]


def _calibrate(params: list[torch.nn.Parameter], grads: list[torch.Tensor], threads: int) -> float:
    """Median host-AdamW seconds of `SyncOffloadAdamW` on the scaled model (its `host_update` phase)."""
    opt = SyncOffloadAdamW(params, lr=1e-5, cpu_threads=threads)
    samples = []
    for _ in range(5):
        set_grads(params, grads)
        opt.step()
        samples.append(opt.stats()["cp_host_update_ms"] / 1e3)
    opt.close()
    return statistics.median(samples[1:])


def _run_no_offload(sc: EmulatorScenario, clock: DeviceClock, rank: dict[str, Any]) -> _Run:
    steps = []
    for _ in range(sc.steps):
        t0 = time.perf_counter()
        clock.compute(sc.device_compute_ms + rank["device_optimizer_ms"])
        steps.append(time.perf_counter() - t0)
    return _Run(steps, {})


def _run_sync(sc: EmulatorScenario, clock: DeviceClock, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
              link_down: PacedLink, link_up: PacedLink, threads: int, rank: dict[str, Any]) -> _Run:
    opt = SyncOffloadAdamW(params, lr=1e-5, cpu_threads=threads)
    steps, host_ms, link_ms = [], [], []
    for _ in range(sc.steps):
        t0 = time.perf_counter()
        clock.compute(sc.device_compute_ms)
        set_grads(params, grads)
        opt.step()
        st = opt.stats()
        # The optimizer's own host copies are the link transfers here: pace them to the link bandwidth.
        down = link_down.copy(int(st["bytes_to_host"]), already_spent_s=st["cp_handoff_ms"] / 1e3)
        up = link_up.copy(int(st["bytes_to_device"]), already_spent_s=st["cp_writeback_ms"] / 1e3)
        clock.compute(rank["allgather_ms_per_write_back"])  # several DDP ranks: every rank needs every row
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
                 rank: dict[str, Any], accumulate_on: str = "host") -> _Run:
    """ZenFlow's schedule. ``accumulate_on="host"``: every step's bf16 gradient crosses the link and the host worker
    adds it up. ``"device"``: the window is summed on the device (modelled device time) and its fp32 sum crosses
    the link once per window; the host worker only runs the AdamW."""
    on_device = accumulate_on == "device"
    opt = ZenFlowAdamW(params, lr=1e-5, topk_ratio=sc.topk_ratio, update_interval=sc.update_interval,
                       overlap_step=True, cpu_threads=threads, select_strategy="step", select_interval=100,
                       accumulate_on=accumulate_on,
                       min_offload_numel=0)  # the scaled-down stand-in of a model whose matrices are all offloaded
    engine = CopyEngine(link_down)
    grad_bytes_bf16 = offloaded_grad_bytes(params)
    offloaded = sum(p.numel() for p in params if p.ndim >= 2)
    worker_gate = hasattr(opt, "_host")
    dense_fraction = sum(p.numel() for p in params if p.ndim < 2) / sum(p.numel() for p in params)
    # device-side window sum of the rank's rows: read the bf16 gradient, read and write the fp32 sum (10 B per
    # offloaded parameter)
    device_accumulate_ms = (sc.params * rank["host_share"] * offloaded / sum(p.numel() for p in params) * 10
                            / (sc.device_mem_gbps * 1e9) * 1e3) if on_device else 0.0
    steps, raw, stalls, device_exec, waits, link_waits = [], [], [], [], [], []
    host_jobs: list[float] = []
    accumulate: list[float] = []
    for _ in range(sc.steps):
        t0 = time.perf_counter()
        clock.compute(sc.device_compute_ms)
        set_grads(params, grads)
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
        modelled = rank["device_optimizer_ms"] * (selected + dense_fraction) + (
            # the gradient-norm pass reads every bf16 gradient (of its shard, under FSDP2) once on the device
            sc.params * rank["device_share"] * LINK_BYTES_PER_PARAM / (sc.device_mem_gbps * 1e9) * 1e3
        ) + device_accumulate_ms
        if st["bytes_to_device"] > 0:
            # Write-back of the host result: host->device on the compute stream, so on the device timeline.
            nbytes = int(st["bytes_to_device"])
            took = link_up.copy(nbytes, already_spent_s=st["cp_writeback_ms"] / 1e3)
            executed += max(0.0, took - link_up.target_s(nbytes))  # accounted at the link time, as for sync
            clock.compute(rank["allgather_ms_per_write_back"])  # several DDP ranks: every rank needs every row
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
    """Run the three schedules in one process and return the measured step times, scaled to the full model. With
    ``sc.ranks`` > 1 the process is one of the ranks: the real host code stands for its share (`rank_figures`)."""
    sc.rank_split()  # a bad rank count fails before the model is built
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
        elif sc.host_from_profile:
            # the published host rate, linear in cores (optimistic for a memory-bound step)
            cores = sc.host_cores or PUBLISHED_HOST_CORES
            rate = PUBLISHED_HOST_PARAMS_PER_S * cores / PUBLISHED_HOST_CORES
            cpu_update_ms = sc.params / rate * 1e3
            here = n_emu / host_real_s
            cpu_note = (f"published: the CPUAdam rate ({PUBLISHED_HOST_PARAMS_PER_S / 1e9:.2f} Gparam/s "
                        f"on {PUBLISHED_HOST_CORES} threads, Llama-2-7B) x {cores}/{PUBLISHED_HOST_CORES} cores, "
                        f"linear in cores (optimistic for a memory-bound step); this machine: {here / 1e9:.2f} "
                        f"Gparam/s on {threads} threads")
        else:
            # this machine's host, measured (`host_rates`): its AdamW rate on the target's cores (default its own)
            from hf_zenflow.estimate.host_rates import measure_host_rates

            rates = measure_host_rates()
            cores = sc.host_cores or rates.cores
            rate = min(rates.params_per_s(cores), rates.effective_mem_gbps() * 1e9 / HOST_ADAMW_BYTES_PER_PARAM)
            cpu_update_ms = sc.params / rate * 1e3
            cpu_note = f"this machine's host: {rates.describe(cores)} (--host-from-profile: the published rate)"
        rank = sc.rank_figures(cpu_update_ms)
        scale = rank["cpu_update_ms"] / (host_real_s * 1e3)
        ratio = rank["params_per_rank"] / n_emu
        # Link bandwidth in real time: the rank's bf16 bytes in its share of grad_offload_ms, compressed by `scale`,
        # for the emulated model's bytes.
        emu_link_bytes = n_emu * LINK_BYTES_PER_PARAM
        down_bps = emu_link_bytes / (rank["grad_offload_ms"] / scale / 1e3) if sc.grad_offload_ms > 0 else 0.0
        up_bps = emu_link_bytes / (rank["param_upload_ms"] / scale / 1e3) if sc.param_upload_ms > 0 else 0.0
        cap = 64 * 1024 * 1024
        links: dict[str, tuple[PacedLink, PacedLink]] = {}
        if progress:
            print(f"[estimate] {HEADER}", flush=True)
            share = f", one rank's {rank['params_per_rank'] / 1e9:.2f}B of {sc.ranks}" if sc.ranks > 1 else ""
            print(f"[estimate] scenario {sc.name}: {sc.params / 1e9:.2f}B params{share} emulated by "
                  f"{n_emu / 1e6:.1f}M real bf16 params; host AdamW measured {host_real_s * 1e3:.2f} ms -> time "
                  f"compression x{scale:.1f}", flush=True)
        runs: dict[str, _Run] = {}
        for name, fn in (("no_offload", lambda c, d, u: _run_no_offload(sc, c, rank)),
                         ("sync_offload", lambda c, d, u: _run_sync(sc, c, params, grads, d, u, threads, rank)),
                         ("zenflow", lambda c, d, u: _run_zenflow(sc, c, params, grads, d, u, threads, rank)),
                         ("zenflow_device_accumulation",
                          lambda c, d, u: _run_zenflow(sc, c, params, grads, d, u, threads, rank, "device"))):
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
            "device_idle_fraction": max(0.0, 1.0 - (compute + (rank["device_optimizer_ms"]
                                                                if name == "no_offload" else 0.0)) / mean),
            "steps_timed": len(timed),
            # mean time per link transfer, full scale (None: the schedule moved nothing that way)
            "link_down_ms_per_copy": _achieved_full(links[name][0], scale),
            "link_up_ms_per_copy": _achieved_full(links[name][1], scale),
            "per_step_ms": full_ms(r.step_s),
            "extra": {k: ([x * scale for x in v] if k.endswith("_ms") and isinstance(v, list) else v)
                      for k, v in r.extra.items()},
        }
    # ZenFlow's host worker must finish one window's work (U - 1 accumulation jobs + one AdamW job, into which the
    # window's last gradient is folded) per U steps, or the device waits for it: in steady state a step cannot be
    # shorter than the worker's work per step. The emulator measures that work directly (the worker's own job
    # timers), so the step time is also bounded by it; this also removes the bias of the extra overlap the worker
    # gets while device phases execute on the host.
    interval = max(1, int(sc.update_interval))
    for key in ZENFLOW_ROWS:
        zen = out_rows[key]
        acc, adamw = zen["extra"].get("accumulate_real_ms") or [], zen["extra"].get("host_adamw_real_ms") or []
        floor = ((statistics.fmean(acc) * (interval - 1) / interval if acc else 0.0)
                 + (statistics.fmean(adamw) / interval if adamw else 0.0))
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
        "device_optimizer_ms": rank["device_optimizer_ms"],
        "link_real_gbps": {"down": down_bps / 1e9, "up": up_bps / 1e9},
        "results": out_rows,
        "summary": summary,
        "ranks": rank,
    }



def _achieved_full(link: PacedLink, scale: float) -> float | None:
    return link.total_s / link.copies * 1e3 * scale if link.copies else None
