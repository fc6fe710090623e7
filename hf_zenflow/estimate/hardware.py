"""The bound model of the offload schedules on a hardware profile: "will ZenFlow help on my box, and what fits?".

A `HardwareProfile` (`profiles.py`, with the presets) holds the figures of one machine (device FLOP/s and memory, link
bandwidth, host cores, memory bandwidth and RAM). `schedule_model` turns a profile, a model size and a ZenFlow
setting into per-step times of each side (device, link, host) for no-offload AdamW, synchronous offload
(ZeRO-Offload's schedule) and ZenFlow, names what bounds each schedule, and counts the device and host memory each
holds (`memory.py`); `fits.what_fits` and `fits.max_params` answer which schedule fits a model and how large a model
each one fits. It is a model, not a measurement: `hf-zenflow estimate` prints it, and `compare`'s projection
(`compare/projection.py`) is the same model at the run's measured selection and window.

The model's constants:

* device compute: ``6 * params * tokens / (device FLOP/s * mfu)`` (forward + backward of a dense transformer);
* device AdamW: 28 bytes per parameter over the device memory bandwidth (`DEVICE_ADAMW_BYTES_PER_PARAM`); ZenFlow's
  device step also reads every bf16 gradient once (norms and selection);
* link: bf16 gradients and parameters, 2 bytes per parameter per direction;
* host: every host pass takes the longer of its core work and its memory traffic (a roofline per pass; the passes run
  one after another on the host worker). Core work: host AdamWs at the per-core rate (DeepSpeed's published CPUAdam
  rate, 7e9 parameters in 4.6 s on 128 threads, `profiles.PUBLISHED_HOST_PARAMS_PER_S`, or this machine's measured
  one, `host_rates`) times the profile's cores; ZenFlow's window pass, one step's accumulation and the write-back
  rounding cost the profile's ``host_window_adamws``, ``host_accumulate_adamws`` and ``host_rounding_adamws`` host
  AdamWs (this machine's engine passes timed against its fused AdamW, `host_rates.measure_host_rates`;
  `step_model.WINDOW_PASS_VS_ADAMW`, `step_model.ACCUMULATE_VS_ADAMW` and `step_model.ROUNDING_VS_ADAMW`, none for the
  rounding, where nothing was measured). Memory
  traffic: the bytes per offloaded parameter each pass reads and writes in its dtypes (`zenflow_host_passes`,
  ``HOST_ADAMW_BYTES_PER_PARAM`` for synchronous offload), over ``host_mem_gbps``, a STREAM-like sustained figure of a
  typical server of the profile's class (`profiles.HOST_MEMORY_SOURCES`; STREAM counts a byte read once and a byte
  written once, and so do these counts);
* ZenFlow's window: U - 1 accumulations (host accumulation; the last gradient is folded into the AdamW pass) and one
  AdamW pass, then (with a write-back buffer, under DDP) the rounding of the master into it; one rank, or an FSDP2
  rank, rounds the master at the write-back instead, on the training thread, as it fills the ring's chunks that the
  link copies to the weights (the write-back lasts the longer of the two). The write-back waits for that host
  step, and the host step for its input to land (the window's fp32 sums with ``accumulate_on="device"``, the last
  step's gradient otherwise): that chain, link then host, must fit in the window's U device steps (the write-back lag
  is at most U), so ZenFlow's host side per step is the larger of its work and that chain over U;
* ``accumulate_on="auto"`` (the default): the engine's planner's rule (`hf_zenflow.engine.planner.choose`) over
  ZenFlow's three rows (window summed on the host, on the device in fp32, in bf16: half the sums' device memory and
  link bytes, a widening pass on the host): the fastest row that fits the device memory with the engine's margin
  (`hf_zenflow.engine.accumulation.MARGIN` of it left free) together with the activations of a llama-shaped model with
  activation checkpointing (`activation_gb`), and the host RAM, then the smallest (`auto_accumulation`); ZenFlow's
  rows are the engine's step model (`hf_zenflow.engine.step_model.zenflow_step`);
* device and host memory: `memory.py` (what each schedule holds, the limits it must fit in); what fits and the
  largest model each schedule trains: `fits.py`;
* N data-parallel ranks on the profile's node (``ranks``, ``parallel``): every figure is per rank, split as module
  `ranks` describes (host work, host memory and link bytes 1/N on 1/N of the host cores and memory bandwidth; DDP adds
  an all-gather of the updated rows per write-back at ``interconnect_gbps``); ``tokens_per_step`` is per rank.

Example:
    >>> from hf_zenflow.estimate.hardware import schedule_model
    >>> from hf_zenflow.estimate.profiles import PROFILES
    >>> rows = schedule_model(PROFILES["a100-40gb-pcie4"], params=7e9, tokens_per_step=8 * 512)
    >>> rows["sync_offload"]["bound"]
    'host'
"""

from __future__ import annotations

from typing import Any

from hf_zenflow.engine.accumulation import MARGIN
from hf_zenflow.engine.host import HostLayout, grad_slots
from hf_zenflow.engine.planner import Option, choose
from hf_zenflow.engine.schedule import lag_for_host_elements
from hf_zenflow.engine.step_model import (
    DEVICE_ACCUMULATOR_BYTES,
    DEVICE_ADAMW_BYTES_PER_PARAM,
    LINK_BYTES_PER_PARAM,
    SUM_BYTES,
    Rates,
    zenflow_host_passes,
    zenflow_step,
)
from hf_zenflow.estimate.memory import (
    DEVICE_MEMORY_HEADROOM,
    GPU_TRANSPORT,
    HOST_MEMORY_HEADROOM,
    SYNC_HOST_BYTES_PER_PARAM,
    activation_gb,
    device_memory_gb,
    host_layout,
    zenflow_host_bytes_per_param,
)
from hf_zenflow.estimate.profiles import HOST_ADAMW_BYTES_PER_PARAM, HardwareProfile
from hf_zenflow.estimate.ranks import RankSplit


#: ZenFlow's rows of the bound model: (row, where the window is summed).
ZENFLOW_ROWS = (("zenflow", "host"), ("zenflow_device_accumulation", "device"), ("zenflow_device_bf16", "device_bf16"))
#: The row of each place a window may be summed (`planner.SUM_PLACES`).
AUTO_ROWS = {place: row for row, place in ZENFLOW_ROWS}


def profile_rates(profile: HardwareProfile, core_share: float = 1.0) -> Rates:
    """`profile`'s speeds as the step model takes them (`step_model.Rates`), for a rank on `core_share` of the
    node's host cores and memory bandwidth."""
    return Rates(profile.device_mem_gbps, profile.link_gbps, profile.host_core_params_per_s(core_share),
                 profile.host_mem_gbps * core_share, profile.host_window_adamws, profile.host_accumulate_adamws,
                 profile.host_rounding_adamws)


def schedule_model(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
                   update_interval: float = 4, device_step_ms: float | None = None, ranks: int = 1,
                   parallel: str = "ddp", host_moments: str | None = None,
                   gradients_freed_in_backward: bool | None = None,
                   host_state: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Per-step ms of each side and the step time of every schedule (the slowest side of an overlapped schedule,
    the sum of a synchronous one); `bound` names the side that sets the step; `host_limit` says what bounds the
    host's passes ("memory" or "cores", by the larger share of the host time). Memory: ``device_memory_gb`` and
    ``host_memory_gb`` (one rank's), ``host_memory_node_gb`` (all ranks'), ``fits_device_memory`` (within
    `DEVICE_MEMORY_HEADROOM` of the device) and ``fits_host_memory`` (the node's ranks within `HOST_MEMORY_HEADROOM`
    of ``profile.host_mem_gb``). `host_moments` ("float32", "bfloat16", "int8") is ZenFlow's host moment dtype
    (default: the library's, `DEFAULT_HOST_MOMENTS`);
    ``gradients_freed_in_backward`` (default `GRADIENTS_FREED_IN_BACKWARD`) its device gradients (`device_memory_gb`).

    `device_step_ms` replaces the FLOP-based forward+backward time when you have measured it. With `ranks` > 1 every
    figure is one rank's (`ranks.RankSplit`): ``link_ms`` is one GPU's link, ``host_ms`` one rank's host work on its
    share of the node, ``allgather_ms`` the per-step share of the write-back all-gather (DDP), which is part of
    ``device_ms``. ZenFlow's rows also carry ``host_work_ms`` (the host's passes per step) and ``host_chain_ms`` (per
    window: the input's landing, then the AdamW and rounding passes the write-back waits for); their ``host_ms`` is
    the larger of the work and the chain over the window.
    """
    split = RankSplit(ranks, parallel)
    n = float(params)
    dev, share = split.device_share, split.host_share
    compute = device_step_ms if device_step_ms is not None else (
        6.0 * n * tokens_per_step / (profile.device_tflops * 1e12 * profile.mfu) * 1e3)
    device_adamw = n * dev * DEVICE_ADAMW_BYTES_PER_PARAM / (profile.device_mem_gbps * 1e9) * 1e3
    link = n * share * LINK_BYTES_PER_PARAM / (profile.link_gbps * 1e9) * 1e3  # one direction, bf16, one GPU
    rates = profile_rates(profile, split.core_share)
    sync_core, sync_memory = rates.host_pass_ms(n * share, 1.0, HOST_ADAMW_BYTES_PER_PARAM)
    host_adamw = max(sync_core, sync_memory)
    allgather = split.allgather_ms(n * LINK_BYTES_PER_PARAM, profile.interconnect_gbps)
    u = max(1.0, float(update_interval))
    rows: dict[str, dict[str, Any]] = {}
    rows["no_offload"] = {"step_ms": compute + device_adamw, "bound": "device",
                          "device_ms": compute + device_adamw, "link_ms": 0.0, "host_ms": 0.0, "allgather_ms": 0.0,
                          "host_limit": None, "device_memory_gb": device_memory_gb("no_offload", n, split=split),
                          "host_memory_gb": 0.0}
    # ZeRO-Offload partitions the same way: its all-gather of the updated weights follows every step
    sync_parts = {"device": compute + allgather, "link": 2 * link, "host": host_adamw}
    rows["sync_offload"] = {"step_ms": sum(sync_parts.values()), "bound": max(sync_parts, key=sync_parts.__getitem__),
                            "device_ms": compute + allgather, "link_ms": 2 * link, "host_ms": host_adamw,
                            "allgather_ms": allgather,
                            "device_memory_gb": device_memory_gb("sync_offload", n, split=split),
                            "host_memory_gb": n * share * SYNC_HOST_BYTES_PER_PARAM / 1e9,
                            "host_limit": "memory" if sync_memory > sync_core else "cores"}
    layout = host_layout(host_moments, host_state)
    # DDP's ranks share the host state and write back through buffers; one rank, or each FSDP2 rank, writes back its
    # whole result (from the master unless "buffer": the engine's rule, `HostLayout.applied`)
    sharing = split.ranks if split.parallel == "ddp" else 1
    from_master = HostLayout(writeback=layout["host_writeback"]).applied(GPU_TRANSPORT, sharing).writeback_from_master
    # the hand-off slots of the default write-back lag (host_step="auto") for this rank's host columns (one landing
    # buffer each)
    slots = grad_slots(lag_for_host_elements(int(n * share), int(u)))
    for key, place in ZENFLOW_ROWS:
        sides = zenflow_step(rates, compute, n * dev, topk_ratio * n * dev, n * share, u, place,
                             layout["host_moment_dtype"], allgather, writeback_from_master=from_master)
        rows[key] = {**sides,
                     "device_memory_gb": device_memory_gb("zenflow", n, topk_ratio, SUM_BYTES[place],
                                                          gradients_freed_in_backward, split),
                     "host_memory_gb": (n * share * zenflow_host_bytes_per_param(SUM_BYTES[place], **layout,
                                                                                topk_ratio=topk_ratio, slots=slots,
                                                                                ranks=sharing)
                                        + GPU_TRANSPORT.fixed_host_bytes(place != "host")) / 1e9}
    for r in rows.values():
        r["fits_device_memory"] = r["device_memory_gb"] <= DEVICE_MEMORY_HEADROOM * profile.device_mem_gb
        r["host_memory_node_gb"] = r["host_memory_gb"] * split.ranks
        r["fits_host_memory"] = r["host_memory_node_gb"] <= HOST_MEMORY_HEADROOM * profile.host_mem_gb
        r["compute_ms"] = compute
    return rows


def auto_accumulation(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
                      ranks: int = 1, parallel: str = "ddp", gradients_freed_in_backward: bool | None = None,
                      update_interval: float = 4, device_step_ms: float | None = None,
                      host_moments: str | None = None, host_state: dict[str, str] | None = None,
                      rows: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """What ``accumulate_on="auto"`` chooses on `profile`: the engine's rule (`hf_zenflow.engine.planner.choose`)
    over ZenFlow's three rows (`schedule_model`'s, or `rows`): the fastest that fits, then the smallest. A row fits
    the device when its weights, gradients, selected columns' state and device sums plus `activation_gb` stay within
    the device's memory less the engine's margin, and the host when the node's host state stays within
    `HOST_MEMORY_HEADROOM` of its RAM. With the figures (GB, one rank's device, the node's host), ``options`` (the
    planner's view of each row) and ``state_gb`` (the device GB of the choice)."""
    if rows is None:
        rows = schedule_model(profile, params, tokens_per_step, topk_ratio, update_interval, device_step_ms, ranks,
                              parallel, host_moments, gradients_freed_in_backward, host_state)
    activations = activation_gb(params * RankSplit(ranks, parallel).device_share, tokens_per_step)
    limit = (1 - MARGIN) * profile.device_mem_gb
    host_limit = HOST_MEMORY_HEADROOM * profile.host_mem_gb
    options = [Option(place, rows[row]["step_ms"], rows[row]["device_memory_gb"] * 1e9,
                      rows[row]["host_memory_node_gb"] * 1e9,
                      max(0.0, rows[row]["device_memory_gb"] + activations - limit) * 1e9,
                      max(0.0, rows[row]["host_memory_node_gb"] - host_limit) * 1e9) for row, place in ZENFLOW_ROWS]
    choice = choose(options).accumulate_on
    return {"choice": choice, "state_gb": rows[AUTO_ROWS[choice]]["device_memory_gb"], "activations_gb": activations,
            "limit_gb": limit, "host_limit_gb": host_limit, "margin": MARGIN, "options": options}


def interval_to_unbind(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float,
                       accumulate_on: str, device_step_ms: float | None = None,
                       candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32), ranks: int = 1,
                       parallel: str = "ddp") -> int | None:
    """The smallest update_interval at which ZenFlow's step is device-bound (None: none of `candidates`)."""
    key = "zenflow_device_accumulation" if accumulate_on == "device" else "zenflow"
    for u in candidates:
        row = schedule_model(profile, params, tokens_per_step, topk_ratio, u, device_step_ms, ranks, parallel)[key]
        if row["bound"] == "device":
            return u
    return None


__all__ = ["AUTO_ROWS", "DEVICE_ACCUMULATOR_BYTES", "DEVICE_ADAMW_BYTES_PER_PARAM", "LINK_BYTES_PER_PARAM",
           "ZENFLOW_ROWS", "activation_gb", "auto_accumulation", "interval_to_unbind", "profile_rates",
           "schedule_model", "zenflow_host_passes"]
