"""The emulator's report: the markdown table, summary and stated assumptions of one `run_estimate` result."""

from __future__ import annotations

import math
import statistics
from typing import Any

from hf_zenflow.estimate.emulator_scenario import EXEC_KEY, ZENFLOW_ROWS
from hf_zenflow.estimate.ranks import RankSplit


def format_estimate(res: dict[str, Any]) -> str:
    sc = res["scenario"]
    rows = res["results"]
    lines = [f"## {res['label']}", "",
             f"Scenario `{sc['name']}`: {sc['params'] / 1e9:.2f}B params; forward+backward "
             f"{sc['forward_ms'] + sc['backward_ms']:.0f} ms; "
             f"gradient offload {sc['grad_offload_ms']:.0f} ms; parameter upload {sc['param_upload_ms']:.0f} ms; "
             f"host AdamW {res['cpu_update_ms']:.0f} ms ({res['cpu_update_source']}); device AdamW "
             f"{res['device_optimizer_ms']:.1f} ms; ZenFlow topk_ratio {sc['topk_ratio']}, update_interval "
             f"{sc['update_interval']}.", "", *_rank_lines(res),
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
    link = res.get("ranks") or sc  # one rank's link carries its share
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
              f"{_f(dev['link_up_ms_per_copy'])} ms (targets {link['grad_offload_ms']:.0f} / "
              f"{link['param_upload_ms']:.0f} ms for bf16; a longer real copy is accounted at the target);",
              "- ZenFlow's device phases (norms, selection, selected-column AdamW; with accumulate_on=\"device\" also "
              "the window sum) execute on this CPU; their measured time (mean "
              f"{_mean_or_nan(zen['extra'].get(EXEC_KEY)):.0f} / {_mean_or_nan(dev['extra'].get(EXEC_KEY)):.0f} "
              "ms/step full scale) is replaced by the modelled device time (selected fraction x device AdamW + one "
              "gradient read, + 10 B per offloaded parameter for the device sum); the host worker keeps running "
              "meanwhile (extra overlap, a bias in ZenFlow's favour of at most that much per step);"]
    for key in ZENFLOW_ROWS:
        r = rows[key]
        lines.append(f"- {names[key]}: host worker work per step ((update_interval - 1) accumulations + one host "
                     "AdamW with the last gradient folded in, / update_interval; "
                     f"its own job timers) {r['host_work_per_step_ms']:.0f} ms full scale against a measured step of "
                     f"{r['step_ms_mean']:.0f} ms; "
                     + ("the schedule is HOST-BOUND: the \"step ms\" column and the ratios use the host work "
                        "per step, the measured columns stay measured;"
                        if r["host_bound"] else "the device, not the host, bounds the step;"))
    several = res.get("ranks", {}).get("ranks", 1) > 1
    lines += ["- one rank of several, one device timeline: its share as above; the data-parallel gradient all-reduce "
              "and FSDP's own collectives (there without offload too) are not modelled." if several else
              "- one training process, one device timeline: data-parallel communication is not modelled.",
              f"- {sc['notes']}" if sc["notes"] else ""]
    return "\n".join(line for line in lines if line is not None).rstrip() + "\n"


def _rank_lines(res: dict[str, Any]) -> list[str]:
    """With several ranks: what the emulated rank owns, and its full-scale figures (none with one rank)."""
    rank = res.get("ranks") or {}
    n = rank.get("ranks", 1)
    if n <= 1:
        return []
    cores = rank["host_cores_per_rank"]
    gather = rank["allgather_ms_per_write_back"]
    return [f"Ranks: {RankSplit(n, rank['parallel']).describe()}. The emulated process is ONE rank: "
            f"{rank['params_per_rank'] / 1e9:.2f}B parameters of host work"
            + (f" on {cores:g} host cores (1/{n} of the node's cores and memory bandwidth)" if cores else "")
            + f": host AdamW {rank['cpu_update_ms']:.0f} ms, ZenFlow's host memory "
            f"{rank['zenflow_host_memory_gb']:.1f} GB; its GPU's link: gradient offload "
            f"{rank['grad_offload_ms']:.0f} ms, upload {rank['param_upload_ms']:.0f} ms; device AdamW "
            f"{rank['device_optimizer_ms']:.1f} ms; "
            + (f"all-gather of the updated rows {gather:.0f} ms per write-back at {rank['interconnect_gbps']:g} "
               "GB/s (a timed wait on the device timeline)." if gather else "no weight collective."), ""]


def _mean_or_nan(values: list[float] | None) -> float:
    return statistics.fmean(values) if values else math.nan


def _f(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}"

