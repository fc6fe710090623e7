"""The projection at the end of `hf-zenflow compare`: step time and GPU utilisation of no-offload, synchronous offload
and ZenFlow for a named model size on a few hardware profiles, from what this run measured.

Method (printed into results.md as `METHOD`), per profile, for N parameters (``--project-params``, default the model
that ran, n parameters) and this run's tokens per step T:

* device: forward + backward ``6 N T / (profile FLOP/s x mfu)``; AdamW on the device ``28 B x N / device memory
  bandwidth`` (no-offload), ZenFlow's selected share of it (the run's measured selected fraction) plus one read of the
  bf16 gradients;
* link: the bytes this run moved per step, each way (measured, fp32 here), x N / n, as bf16 on the GPU (x 1/2), over
  the profile's link bandwidth; synchronous offload waits for both directions, ZenFlow's two directions overlap;
* host: a host AdamW over the parameters whose gradients this run sent to the host per step (measured bytes / 4),
  x N / n, at the projected host's AdamW rate (this host measured on the H host cores, `host_rates`, or the profile's
  published figure with ``--host-from-profile``): every step for synchronous offload; for ZenFlow one per window (the
  measured mean window length) plus the accumulation of every step, at the accumulation/AdamW time ratio this run
  measured (both on the same worker, so machine load largely cancels). With ``accumulate_on="device"`` the host gets
  one fp32 sum per window (the measured bytes per step are 1/U of it, and fp32 on a GPU too) and runs no
  accumulation; the write-back waits for that sum to land and the AdamW to run, so the host side per step is at
  least that chain over the window, and the device adds each step's gradient into the sums
  (`hardware.DEVICE_ACCUMULATE_TRAFFIC` B per element over its memory bandwidth);
* step: no-offload device time; synchronous offload device + link + host (one after the other); ZenFlow the slowest
  of device, link and host (overlapped). GPU utilisation = device time / step time.
"""

from __future__ import annotations

from typing import Any

from hf_zenflow.compare.report import markdown_table
from hf_zenflow.estimate.emulator_scenario import DEVICE_ADAMW_BYTES_PER_PARAM, LINK_BYTES_PER_PARAM
from hf_zenflow.estimate.hardware import DEVICE_ACCUMULATE_TRAFFIC


#: The bytes per element the CPU runs move (fp32) and what the GPU run moves (bf16): link bytes scale by their ratio.
RUN_LINK_BYTES = 4
SCHEDULES = (("adamw_torch", "no offload"), ("sync_offload", "sync offload"), ("zenflow", "ZenFlow"))

METHOD = ("Projected, not measured: per profile, device = 6 x params x tokens/step over the profile's FLOP/s x mfu, "
          "plus AdamW on the device at 28 B/param over its memory bandwidth (ZenFlow: the measured selected share, "
          "plus one read of the bf16 gradients); link = this run's measured bytes per step each way x (params / "
          "params run), as bf16, over the profile's link; host = a host AdamW over the parameters whose gradients "
          "this run sent to the host each step (its measured bytes), scaled to the params, at the projected host's "
          "AdamW rate (this host's, measured on the H host cores; --host-from-profile: the profile's published "
          "figure): every step for sync offload; for ZenFlow one per measured window length plus every step's "
          "accumulation, at the accumulation/AdamW time ratio this run measured (window summed on the device, "
          "accumulate_on's choice where memory allows: one fp32 sum per window, no accumulation, at least the sum's "
          "landing plus the AdamW over the window on the host, and the device adds each step's gradient at 10 "
          "B/param). Step: no offload = device; sync "
          "offload = device + link + host; ZenFlow = the slowest of device, link and host (overlapped). GPU "
          "utilisation = device / step.")


def _interval(r: dict[str, Any]) -> float:
    stats = r.get("engine_stats") or {}
    steps, windows = stats.get("steps") or 0, stats.get("windows") or 0
    return max(1.0, steps / windows) if windows else max(1.0, float(stats.get("update_interval") or 1.0))


def accumulate_ratio(r: dict[str, Any]) -> float:
    """One host accumulation over one host AdamW, as this run measured them (the same worker, the same conditions,
    so machine load largely cancels); the emulator's ratio (`hardware.ACCUMULATE_VS_ADAMW`) when not measured."""
    from hf_zenflow.estimate.hardware import ACCUMULATE_VS_ADAMW

    adamw, acc = r.get("host_step_ms_mean"), r.get("accumulate_ms_mean")
    return acc / adamw if adamw and acc else ACCUMULATE_VS_ADAMW


def project(results: dict[str, dict[str, Any]], params_ran: float, params: float, tokens_per_step: float,
            profile: Any) -> dict[str, dict[str, float]]:
    """Projected ms per step of each side, the step and the GPU utilisation of every schedule that ran.
    `profile` carries the projected host (`host_adamw_params_per_s`: this host measured, or the published figure)."""
    scale = params / params_ran
    host_rate = profile.host_adamw_params_per_s()
    compute = 6.0 * params * tokens_per_step / (profile.device_tflops * 1e12 * profile.mfu) * 1e3
    device_adamw = params * DEVICE_ADAMW_BYTES_PER_PARAM / (profile.device_mem_gbps * 1e9) * 1e3
    grad_read = params * LINK_BYTES_PER_PARAM / (profile.device_mem_gbps * 1e9) * 1e3

    def link_ms(nbytes: float) -> float:
        return nbytes * scale * LINK_BYTES_PER_PARAM / RUN_LINK_BYTES / (profile.link_gbps * 1e9) * 1e3

    def adamw_ms(r: dict[str, Any]) -> float:
        """A host AdamW over the parameters whose gradients went to the host each step (measured bytes), scaled."""
        return (r.get("bytes_to_host_per_step") or 0.0) / RUN_LINK_BYTES * scale / host_rate * 1e3

    out: dict[str, dict[str, float]] = {}
    for name, _ in SCHEDULES:
        r = results.get(name)
        if r is None:
            continue
        down, up = link_ms(r.get("bytes_to_host_per_step") or 0.0), link_ms(r.get("bytes_to_device_per_step") or 0.0)
        if name == "adamw_torch":
            device, link, host = compute + device_adamw, 0.0, 0.0
            step = device
        elif name == "sync_offload":
            device, link, host = compute, down + up, adamw_ms(r)
            step = device + link + host
        else:
            stats = r.get("engine_stats") or {}
            selected = float(stats.get("selected_fraction") or 0.0)
            u = _interval(r)
            device = compute + selected * device_adamw + grad_read
            sum_bytes = {"device": 4, "device_bf16": 2}.get(stats.get("accumulate_on"))
            if sum_bytes:
                # one sum per window crosses in its own dtype (fp32, or bf16 with "device_bf16"; the same on a GPU:
                # no halving); the per-step bytes are 1/U of it, so the AdamW covers U times their elements; the
                # host step waits for the sum to land
                sent = (r.get("bytes_to_host_per_step") or 0.0) * scale
                down = sent / (profile.link_gbps * 1e9) * 1e3
                hosted = sent * u / sum_bytes
                adamw = hosted / host_rate * 1e3
                host = (down * u + adamw) / u  # the chain per window (its AdamW alone is less), over the window
                # the device adds every step's gradient into the sums (`DEVICE_ACCUMULATE_TRAFFIC` B per element)
                device += hosted * DEVICE_ACCUMULATE_TRAFFIC / (profile.device_mem_gbps * 1e9) * 1e3
            else:
                host = adamw_ms(r) * (1.0 / u + accumulate_ratio(r))  # one AdamW per window, every step summed
            link = max(down, up)
            step = max(device, link, host)
        out[name] = {"device_ms": device, "link_ms": link, "host_ms": host, "step_ms": step,
                     "gpu_utilization": device / step if step > 0 else 0.0}
    return out


def projection_table(projections: dict[str, dict[str, dict[str, float]]]) -> str:
    header = ["profile", "schedule", "device ms", "link ms", "host ms", "step ms (projected)",
              "GPU util. (projected)"]
    body = []
    for profile, rows in projections.items():
        for name, label in SCHEDULES:
            if name in rows:
                p = rows[name]
                body.append([profile, label, f"{p['device_ms']:.0f}", f"{p['link_ms']:.0f}", f"{p['host_ms']:.0f}",
                             f"{p['step_ms']:.0f}", f"{100 * p['gpu_utilization']:.0f} %"])
    return markdown_table(header, body)


def run_projection(results: dict[str, dict[str, Any]], params_ran: float, tokens_per_step: float, cfg: Any,
                   host_cores: int) -> dict[str, Any]:
    """Every profile of ``cfg.project_hardware`` at ``cfg.project_params`` (default: the model that ran)."""
    from hf_zenflow.estimate.host_rates import measure_host_rates, resolve_host
    from hf_zenflow.estimate.profiles import load_profile

    params = float(cfg.project_params or params_ran)
    rates = measure_host_rates()
    projections, hosts = {}, {}
    for spec in cfg.project_hardware:
        profile, line = resolve_host(load_profile(spec), spec, None if cfg.host_from_profile else host_cores,
                                     cfg.host_from_profile)
        projections[profile.name] = project(results, params_ran, params, tokens_per_step, profile)
        hosts[profile.name] = line
    return {"params": params, "tokens_per_step": tokens_per_step, "host_cores": host_cores,
            "host_from_profile": cfg.host_from_profile, "host_rates": rates.to_dict(), "hosts": hosts,
            "profiles": projections, "method": METHOD}
