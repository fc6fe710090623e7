"""What the bound model (`hardware.py`) says in words: the advice sentences (does offloading help, what bounds
ZenFlow, which setting moves the bound, what each of several ranks gets) and the tables `hf-zenflow estimate` prints:
the schedules' sides (`format_schedule_model`), what fits one model size (`format_what_fits`) and the largest model
each schedule fits (`format_max_params`).

Example:
    >>> from hf_zenflow.estimate.advice import format_schedule_model
    >>> from hf_zenflow.estimate.profiles import PROFILES
    >>> "| ZenFlow" in format_schedule_model(PROFILES["a100-40gb-pcie4"], 7e9, 8 * 512)
    True
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hf_zenflow.estimate.hardware import (
    AUTO_ROWS,
    DEVICE_ACCUMULATOR_BYTES,
    auto_accumulation,
    interval_to_unbind,
    schedule_model,
)
from hf_zenflow.estimate.memory import DEVICE_MEMORY_HEADROOM, HOST_MEMORY_HEADROOM
from hf_zenflow.estimate.profiles import HardwareProfile
from hf_zenflow.estimate.ranks import RankSplit
from hf_zenflow.estimate.speed_words import than, versus


def advice(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
           update_interval: float = 4, device_step_ms: float | None = None, ranks: int = 1,
           parallel: str = "ddp", gradients_freed_in_backward: bool | None = None) -> list[str]:
    """Plain sentences: does offloading help here, where is ZenFlow bound, and which setting moves the bound; with
    several ranks, what each rank gets and what the all-gather costs."""
    rows = schedule_model(profile, params, tokens_per_step, topk_ratio, update_interval, device_step_ms, ranks,
                          parallel, gradients_freed_in_backward=gradients_freed_in_backward)
    base, sync, zen, dev = (rows[k] for k in ("no_offload", "sync_offload", "zenflow", "zenflow_device_accumulation"))
    out = []
    if base["fits_device_memory"]:
        out.append(f"No offload needed: weights, gradients and AdamW state ({base['device_memory_gb']:.1f} GB, "
                   f"activations not counted) fit {DEVICE_MEMORY_HEADROOM:.0%} of the device's "
                   f"{profile.device_mem_gb:.0f} GB; plain AdamW on the device is the fastest schedule "
                   f"({base['step_ms']:.0f} ms/step).")
    else:
        out.append(f"Offload needed: weights, gradients and AdamW state take {base['device_memory_gb']:.1f} GB, "
                   f"more than {DEVICE_MEMORY_HEADROOM:.0%} of the device's {profile.device_mem_gb:.0f} GB.")
    if ranks > 1:
        out.append(_per_rank_sentence(profile, params, update_interval, rows, RankSplit(ranks, parallel)))
    auto = auto_accumulation(profile, params, tokens_per_step, topk_ratio, ranks, parallel, rows=rows)
    chosen = rows[AUTO_ROWS[auto["choice"]]]
    fitting = [o.accumulate_on for o in auto["options"] if o.fits]
    out.append(f'accumulate_on="auto" (the default) chooses "{auto["choice"]}": the fastest schedule that fits, then '
               f"the smallest (the engine's planner); fitting here: {', '.join(fitting) or 'none'} (device: state + "
               f"activations ~{auto['activations_gb']:.1f} GB, checkpointed, estimated, within {auto['limit_gb']:.1f} "
               f"GB, the device's {profile.device_mem_gb:g} GB less a {auto['margin']:.0%} margin; host: within "
               f"{auto['host_limit_gb']:.1f} GB); ZenFlow with the defaults: {chosen['step_ms']:.0f} ms/step, "
               f"{auto['state_gb']:.1f} GB on the device, {chosen['bound']}-bound, "
               f"{than(chosen['step_ms'], sync['step_ms'], 'synchronous offload')}, "
               f"{chosen['step_ms'] / base['step_ms']:.2f}x the no-offload step.")
    u = max(1.0, float(update_interval))
    landing = chosen["link_ms"] * u if auto["choice"] != "host" else chosen["link_ms"]
    out.append(f"Its host side per window of {u:g} steps: {chosen['host_work_ms'] * u:.0f} ms of host passes "
               f"(bound by {'memory bandwidth' if chosen['host_limit'] == 'memory' else 'the cores'}); the write-back "
               f"waits for the chain of the input landing ({landing:.0f} ms) then the AdamW and rounding passes, "
               f"{chosen['host_chain_ms']:.0f} ms in all: {chosen['host_ms']:.0f} ms per step, the larger over "
               f"the window.")
    out.append(f"ZenFlow (window summed on the host, U={update_interval:g}): {zen['step_ms']:.0f} ms/step, "
               f"{zen['bound']}-bound, {than(zen['step_ms'], sync['step_ms'], 'synchronous offload')} "
               f"({sync['step_ms']:.0f} ms/step), {zen['step_ms'] / base['step_ms']:.2f}x the no-offload step.")
    if zen["bound"] == "host":
        unbind = {"device_step_ms": device_step_ms, "ranks": ranks, "parallel": parallel}
        u_host = interval_to_unbind(profile, params, tokens_per_step, topk_ratio, "host", **unbind)
        u_dev = interval_to_unbind(profile, params, tokens_per_step, topk_ratio, "device", **unbind)
        move = (f'Device sums (the rule accumulate_on="device", which "auto" takes where they fit and are faster) '
                f'move the bound: {dev["step_ms"]:.0f} ms/step ({dev["bound"]}-bound; '
                f'+{params * DEVICE_ACCUMULATOR_BYTES / ranks / 1e9:.1f} GB of device memory'
                + ("" if dev["fits_device_memory"] else ", which does NOT fit") + ")")
        move += f"; device-bound from update_interval={u_dev}" if u_dev else "; still not device-bound at U=32"
        if u_host:
            move += f"; with host accumulation from update_interval={u_host}"
        out.append("Host-bound: the host accumulates U - 1 steps' gradients and runs one AdamW per window (with the "
                   "last gradient folded in). " + move
                   + ".")
    elif zen["bound"] == "link":
        out.append('Link-bound: every step\'s gradient crosses the link. Device sums (the rule '
                   'accumulate_on="device", which "auto" takes where they fit and are faster) send one fp32 sum '
                   f"per window instead: {dev['step_ms']:.0f} ms/step ({dev['bound']}-bound).")
    else:
        out.append("Device-bound: the offload is hidden behind forward/backward; a smaller topk_ratio only trims the "
                   f"selected-column AdamW ({topk_ratio * (base['step_ms'] - zen['compute_ms']):.1f} ms per step)"
                   + (f" and the all-gather adds {zen['allgather_ms']:.1f} ms per step." if zen["allgather_ms"]
                      else "."))
    return out


def _per_rank_sentence(profile: HardwareProfile, params: float, update_interval: float, rows: dict[str, Any],
                       split: RankSplit) -> str:
    n, zen = split.ranks, rows["zenflow"]
    host_adamw = rows["sync_offload"]["host_ms"]
    u = max(1.0, float(update_interval))
    cores, mem = split.cores_per_rank(profile.host_cores), profile.host_mem_gbps * split.core_share
    text = (f"Per rank: {cores:g} of the node's {profile.host_cores} host cores and {mem:g} of its "
            f"{profile.host_mem_gbps:g} GB/s. A host AdamW over the rank's {params * split.host_share / 1e9:.2f}B "
            f"parameters takes {host_adamw:.0f} ms, as long as one process's over the whole model on the whole node: "
            f"1/{n} of the work on 1/{n} of the host (without the split each rank would take {n * host_adamw:.0f} ms "
            f"and hold {n * zen['host_memory_gb']:.1f} GB). ZenFlow's host memory: {zen['host_memory_gb']:.1f} GB "
            f"per rank, {n * zen['host_memory_gb']:.1f} GB on the node. Each GPU's link carries 1/{n} of the "
            "offloaded bytes")
    if zen["allgather_ms"]:
        text += (f"; the all-gather of the updated rows takes {zen['allgather_ms'] * u:.0f} ms per write-back at "
                 f"{profile.interconnect_gbps:g} GB/s ({zen['allgather_ms']:.0f} ms per step on the device timeline)")
    return text + "."


def format_schedule_model(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
                          update_interval: float = 4, device_step_ms: float | None = None, ranks: int = 1,
                          parallel: str = "ddp", gradients_freed_in_backward: bool | None = None) -> str:
    """Markdown: the profile, one row per schedule (each side's ms, the step, the bound, device and host memory),
    then `advice`; with several ranks the figures are one rank's (host memory: the node's) and a column (the
    all-gather) is added."""
    rows = schedule_model(profile, params, tokens_per_step, topk_ratio, update_interval, device_step_ms, ranks,
                          parallel, gradients_freed_in_backward=gradients_freed_in_backward)
    several = ranks > 1
    names = {"no_offload": "no offload (AdamW on device)", "sync_offload": "synchronous offload (ZeRO-Offload)",
             "zenflow": f"ZenFlow, U={update_interval:g}, topk_ratio={topk_ratio:g} (window summed on the host)",
             "zenflow_device_accumulation": 'ZenFlow, same, accumulate_on="device"',
             "zenflow_device_bf16": 'ZenFlow, same, accumulate_on="device_bf16"'}
    chosen = auto_accumulation(profile, params, tokens_per_step, topk_ratio, ranks, parallel, rows=rows)["choice"]
    names[AUTO_ROWS[chosen]] += ' = the default ("auto")'
    p = asdict(profile)
    lines = [f"## Bound model (not a measurement): `{profile.name}`", "",
             "Profile: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in p.items()
                                     if k != "name")
             + f"; model {params / 1e9:.2f}B params, {tokens_per_step:.0f} tokens/step"
             + (f", forward+backward {device_step_ms:.0f} ms (given)" if device_step_ms is not None else "") + ".",
             ""]
    if several:
        lines += [f"Ranks: {RankSplit(ranks, parallel).describe()}. Every figure below is ONE rank's: its GPU's "
                  "device and link, its share of the node's host; tokens/step per rank.", ""]
    extra = " all-gather ms/step (in device) |" if several else ""
    lines += ["| schedule | device ms/step | link ms/step | host ms/step | step ms | bound | vs sync offload | "
              "device memory GB (no activations) | host memory GB (node) | host passes limited by |" + extra,
              "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if several else "")]
    sync = rows["sync_offload"]["step_ms"]
    for key, label in names.items():
        r = rows[key]
        fits = "" if r["fits_device_memory"] else " (does not fit)"
        host_fits = "" if r["fits_host_memory"] else " (does not fit)"
        bound = "sum (synchronous)" if key == "sync_offload" else r["bound"]
        limit = {"memory": f"memory ({profile.host_mem_gbps:g} GB/s)",
                 "cores": f"cores ({profile.host_cores} x {profile.host_adamw_per_core / 1e6:.0f} M/s)"}.get(
                     r["host_limit"], "-")
        lines.append(f"| {label} | {r['device_ms']:.0f} | {r['link_ms']:.0f} | {r['host_ms']:.0f} | "
                     f"{r['step_ms']:.0f} | {bound} | {versus(r['step_ms'], sync, key == 'sync_offload')} | "
                     f"{r['device_memory_gb']:.1f}{fits} | {r['host_memory_node_gb']:.1f}{host_fits} | {limit} |"
                     + (f" {r['allgather_ms']:.0f} |" if several else ""))
    lines += [""] + [f"- {s}" for s in advice(profile, params, tokens_per_step, topk_ratio, update_interval,
                                              device_step_ms, ranks, parallel, gradients_freed_in_backward)]
    return "\n".join(lines) + "\n"


#: How the tables name `fits.FIT_SCHEDULES`.
FIT_LABELS = {"no_offload": "no offload (AdamW on the device)", "sync_offload": "synchronous offload (ZeRO-Offload)",
              "zenflow": 'ZenFlow, the defaults (host_state="auto": bf16 moments, bf16 sums of the unselected '
                         'columns)',
              "zenflow_fp32": 'ZenFlow, host_state="fp32" (fp32 host moments and sums)',
              "zenflow_lean": 'ZenFlow, host_state="lean" (int8 moments, bf16 sums of the unselected columns)'}


def _limits(profile: HardwareProfile, ranks: int) -> str:
    node = f" ({ranks} ranks on the node; device figures are one GPU's, host figures the node's)" if ranks > 1 else ""
    return (f"device: {DEVICE_MEMORY_HEADROOM:.0%} of {profile.device_mem_gb:g} GB = "
            f"{DEVICE_MEMORY_HEADROOM * profile.device_mem_gb:.1f} GB for weights, gradients and optimizer state "
            f"(activations not counted); host: {HOST_MEMORY_HEADROOM:.0%} of {profile.host_mem_gb:.0f} GB of RAM = "
            f"{HOST_MEMORY_HEADROOM * profile.host_mem_gb:.1f} GB for the offloaded state{node}")


def format_what_fits(profile: HardwareProfile, rows: dict[str, dict[str, Any]], ranks: int = 1) -> str:
    """Markdown: for one model size (`hardware.what_fits`'s rows), each schedule's device and host memory, whether
    each fits, and its step time."""
    params = next(iter(rows.values()))["params"]
    lines = [f"### What fits: {params / 1e9:.2f}B parameters on `{profile.name}`", "",
             f"Limits: {_limits(profile, ranks)}.", "",
             "| schedule | device GB | fits device | host GB (node) | fits host | step ms | vs no offload | "
             "vs sync offload |", "|---|---|---|---|---|---|---|---|"]
    for key, r in rows.items():
        lines.append(f"| {_label(key, r)} | {r['device_memory_gb']:.1f} | {_yes(r['fits_device_memory'])} | "
                     f"{r['host_memory_node_gb']:.1f} | {_yes(r['fits_host_memory'])} | {r['step_ms']:.1f} | "
                     f"{versus(r['step_vs_no_offload'], 1.0, key == 'no_offload')} | "
                     f"{versus(1.0, r['speedup_vs_sync'], key == 'sync_offload')} |")
    return "\n".join(lines) + "\n"


def format_max_params(profile: HardwareProfile, largest: dict[str, dict[str, Any] | None], ranks: int = 1,
                      parallel: str = "ddp") -> str:
    """Markdown: the largest model each schedule trains (`hardware.max_params`), what limits it, its memory and its
    step time there."""
    several = f", {ranks} {parallel.upper()} ranks per node" if ranks > 1 else ""
    lines = [f"### The largest model each schedule trains on `{profile.name}`{several}", "",
             f"Limits: {_limits(profile, ranks)}.", "",
             "| schedule | largest model (B params) | limited by | device GB | host GB (node) | step ms there "
             "| bound |",
             "|---|---|---|---|---|---|---|"]
    for key, r in largest.items():
        if r is None:
            lines.append(f"| {FIT_LABELS[key]} | none (not even 1M parameters fit) | - | - | - | - | - |")
            continue
        lines.append(f"| {_label(key, r)} | {r['params'] / 1e9:.2f} | {r['limited_by']} | "
                     f"{r['device_memory_gb']:.1f} | {r['host_memory_node_gb']:.1f} | {r['step_ms']:.1f} | "
                     f"{'sum (synchronous)' if key == 'sync_offload' else r['bound']} |")
    return "\n".join(lines) + "\n"


def _label(key: str, row: dict[str, Any]) -> str:
    choice = row.get("accumulate_on")
    return FIT_LABELS[key] + (f' (accumulate_on="auto" chooses "{choice}")' if choice else "")


def _yes(value: bool) -> str:
    return "yes" if value else "**no**"


__all__ = ["FIT_LABELS", "advice", "format_max_params", "format_schedule_model", "format_what_fits"]
