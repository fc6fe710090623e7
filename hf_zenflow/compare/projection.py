"""The projection at the end of `hf-zenflow compare`: step time, GPU utilisation and memory of no-offload,
synchronous offload and ZenFlow for a named model size on a few hardware profiles.

The method is `hf-zenflow estimate`'s bound model (`hf_zenflow.estimate.hardware.schedule_model`), on each profile's
own host (its cores, memory bandwidth and RAM; this machine's measured per-core AdamW rate unless
``--host-from-profile``), with what this run measured of ZenFlow: the share of the parameters it updated on the device
(``selected_fraction``: the selected columns and the matrices kept whole on the device), its mean window length and
where it summed the window (``accumulate_on``'s choice). The model assumes every matrix beyond the selected share is
offloaded, as at the projected scale of billions of parameters.
"""

from __future__ import annotations

from typing import Any

from hf_zenflow.compare.report import markdown_table


SCHEDULES = (("adamw_torch", "no offload"), ("sync_offload", "sync offload"), ("zenflow", "ZenFlow"))
#: The bound model's row of each run: no offload, synchronous offload, and ZenFlow's by where it summed its window.
ZENFLOW_ROWS = {"host": "zenflow", "device": "zenflow_device_accumulation", "device_bf16": "zenflow_device_bf16"}

METHOD = ("Projected, not measured: `hf-zenflow estimate`'s bound model (docs/estimate.md) on each profile, with its "
          "host's cores, memory bandwidth and RAM (this machine's measured per-core host AdamW rate, or with "
          "--host-from-profile the published one), at the parameters and tokens per step above and this run's "
          "measured ZenFlow selected fraction, window length and accumulate_on choice. Device = 6 x params x "
          "tokens/step over the profile's FLOP/s x mfu plus the optimizer's device work; link = the bf16 bytes that "
          "cross; host = the host passes, each bound by the cores or the memory bandwidth. Step: no offload = device; "
          "sync offload = device + link + host; ZenFlow = the slowest of device, link and host (overlapped). GPU "
          "utilisation = device / step.")


def _interval(r: dict[str, Any]) -> float:
    stats = r.get("engine_stats") or {}
    steps, windows = stats.get("steps") or 0, stats.get("windows") or 0
    return max(1.0, steps / windows) if windows else max(1.0, float(stats.get("update_interval") or 1.0))


def project(results: dict[str, dict[str, Any]], params: float, tokens_per_step: float,
            profile: Any) -> dict[str, dict[str, Any]]:
    """Projected ms per step of each side, the step, the GPU utilisation and the device and host memory (GB) of
    every schedule that ran, from `schedule_model` on `profile` (its host already resolved)."""
    from hf_zenflow.estimate.hardware import schedule_model

    zen = results.get("zenflow") or {}
    stats = zen.get("engine_stats") or {}
    selected = float(stats.get("selected_fraction") or 0.0)
    rows = schedule_model(profile, params, tokens_per_step, topk_ratio=selected,
                          update_interval=_interval(zen) if zen else 4)
    keys = {"adamw_torch": "no_offload", "sync_offload": "sync_offload",
            "zenflow": ZENFLOW_ROWS.get(stats.get("accumulate_on") or "host", "zenflow")}
    out: dict[str, dict[str, Any]] = {}
    for name, _ in SCHEDULES:
        if name not in results:
            continue
        r = rows[keys[name]]
        out[name] = {"row": keys[name], "device_ms": r["device_ms"], "link_ms": r["link_ms"], "host_ms": r["host_ms"],
                     "step_ms": r["step_ms"], "bound": r["bound"],
                     "gpu_utilization": r["device_ms"] / r["step_ms"] if r["step_ms"] > 0 else 0.0,
                     "device_memory_gb": r["device_memory_gb"], "host_memory_gb": r["host_memory_node_gb"],
                     "fits_device_memory": r["fits_device_memory"], "fits_host_memory": r["fits_host_memory"]}
    return out


def _ms(value: float) -> str:
    """A time in ms with four significant figures (whole ms from 10 s up): a small model's step is well under 1 ms."""
    return f"{value:.0f}" if value >= 1e4 else f"{value:.4g}"


def projection_table(projections: dict[str, dict[str, dict[str, Any]]]) -> str:
    # (every figure is projected: the title above the table says so, and the table fits a 120-column terminal)
    header = ["profile", "schedule", "device ms", "link ms", "host ms", "step ms", "GPU util.", "device GB", "host GB"]
    body = []
    for profile, rows in projections.items():
        for name, label in SCHEDULES:
            if name in rows:
                p = rows[name]
                body.append([profile, label, _ms(p["device_ms"]), _ms(p["link_ms"]), _ms(p["host_ms"]),
                             _ms(p["step_ms"]), f"{100 * p['gpu_utilization']:.1f} %",
                             f"{p['device_memory_gb']:.3g}" + ("" if p["fits_device_memory"] else " (too big)"),
                             f"{p['host_memory_gb']:.3g}" + ("" if p["fits_host_memory"] else " (too big)")])
    return markdown_table(header, body)


def run_projection(results: dict[str, dict[str, Any]], params_ran: float, tokens_per_step: float, cfg: Any,
                   host_cores: int) -> dict[str, Any]:
    """Every profile of ``cfg.project_hardware`` at ``cfg.project_params`` (default: the model that ran, `params_ran`
    parameters), each on its own host. `host_cores` (the cores this run's host side had) is recorded, not projected:
    a profile's host is the server it describes."""
    from hf_zenflow.estimate.host_rates import measure_host_rates, resolve_host
    from hf_zenflow.estimate.profiles import load_profile

    params = float(cfg.project_params or params_ran)
    rates = None if cfg.host_from_profile else measure_host_rates()
    projections, hosts = {}, {}
    for spec in cfg.project_hardware:
        profile, line = resolve_host(load_profile(spec, published_host=cfg.host_from_profile), spec, None,
                                     cfg.host_from_profile)
        projections[profile.name] = project(results, params, tokens_per_step, profile)
        hosts[profile.name] = line
    return {"params": params, "tokens_per_step": tokens_per_step, "host_cores": host_cores,
            "host_from_profile": cfg.host_from_profile, "host_rates": rates.to_dict() if rates else None,
            "hosts": hosts, "profiles": projections, "method": METHOD}
