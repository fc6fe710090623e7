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
  `profiles.WINDOW_PASS_VS_ADAMW`, `profiles.ACCUMULATE_VS_ADAMW` and `profiles.ROUNDING_VS_ADAMW`, none for the
  rounding, where nothing was measured). Memory
  traffic: the bytes per offloaded parameter each pass reads and writes in its dtypes (`zenflow_host_passes`,
  ``HOST_ADAMW_BYTES_PER_PARAM`` for synchronous offload), over ``host_mem_gbps``, a STREAM-like sustained figure of a
  typical server of the profile's class (`profiles.HOST_MEMORY_SOURCES`; STREAM counts a byte read once and a byte
  written once, and so do these counts);
* ZenFlow's window: U - 1 accumulations (host accumulation; the last gradient is folded into the AdamW pass) and one
  AdamW pass, then the rounding of the master into the bf16 write-back buffer. The write-back waits for that host
  step, and the host step for its input to land (the window's fp32 sums with ``accumulate_on="device"``, the last
  step's gradient otherwise): that chain, link then host, must fit in the window's U device steps (the write-back lag
  is at most U), so ZenFlow's host side per step is the larger of its work and that chain over U;
* ``accumulate_on="auto"`` (the default): the device when the ZenFlow row with device accumulation fits the device
  memory with the engine's margin (`hf_zenflow.engine.accumulation.MARGIN` of it left free) together with the
  activations of a llama-shaped model with activation checkpointing (`activation_gb`), else the device with bf16 sums
  when those fit (``"device_bf16"``: half the sums' device memory and link bytes, a widening pass on the host), else
  the host (`auto_accumulation`);
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
from hf_zenflow.estimate.memory import (
    BF16_BYTES,
    DEFAULT_HOST_MOMENTS,
    DEVICE_MEMORY_HEADROOM,
    FP32_BYTES,
    HOST_MEMORY_HEADROOM,
    HOST_MOMENT_DTYPES,
    MOMENT_BYTES,
    SYNC_HOST_BYTES_PER_PARAM,
    activation_gb,
    device_memory_gb,
    zenflow_host_bytes_per_param,
)
from hf_zenflow.estimate.profiles import (
    ACCUMULATE_VS_ADAMW,
    HOST_ADAMW_BYTES_PER_PARAM,
    ROUNDING_VS_ADAMW,
    WINDOW_PASS_VS_ADAMW,
    HardwareProfile,
)
from hf_zenflow.estimate.ranks import RankSplit


#: AdamW bytes per parameter on the device: read bf16 grad + fp32 master, exp_avg, exp_avg_sq (14 B), write the
#: three fp32 tensors and the bf16 parameter (14 B).
DEVICE_ADAMW_BYTES_PER_PARAM = 28
#: bf16 gradients and parameters cross the link.
LINK_BYTES_PER_PARAM = 2


def host_state_bytes(host_moments: str = DEFAULT_HOST_MOMENTS) -> float:
    """Bytes per offloaded parameter the window's host AdamW pass reads and writes of its state: the fp32 master and
    the two moments, each read and written (24 with fp32 moments, 16 with bf16 ones)."""
    return 2 * (FP32_BYTES + 2 * MOMENT_BYTES[host_moments])


#: ZenFlow's host passes, bytes per offloaded parameter with a bf16 model (`host.py`): the AdamW pass of
#: `kernels.window_adamw` reads and writes the fp32 master and the moments (`host_state_bytes`) and reads the window's
#: fp32 sum (4; not on a one-step window summed on the host, whose sum is its gradient); with host accumulation it
#: also reads the window's last bf16 gradient, folded in (2).
HOST_STATE_BYTES = host_state_bytes()
#: The rounding of the fp32 master into the bf16 write-back buffer, a pass of its own (``writeback.copy_(master)``):
#: read 4, write 2.
HOST_ROUNDING_BYTES = 6
#: ZenFlow's device-side window sum (accumulate_on="device"): fp32, and its per-step cost (read bf16 grad, read and
#: write the fp32 sum).
DEVICE_ACCUMULATOR_BYTES = 4
DEVICE_ACCUMULATE_TRAFFIC = 10
#: The same in bf16 (accumulate_on="device_bf16"): a 2-B sum, and the engine's add in pieces through an fp32 scratch
#: (widen the sum: read 2, write 4; add the gradient: read 4 + 2, write 4; round: read 4, write 2).
DEVICE_BF16_ACCUMULATOR_BYTES = 2
DEVICE_BF16_ACCUMULATE_TRAFFIC = 22
#: The host's widening of a landed bf16 sum into its fp32 accumulator before the window's AdamW (read 2, write 4).
HOST_WIDEN_BYTES = 6
#: ZenFlow's rows of the bound model: (row, bytes of one device-side window sum element; 0 = summed on the host).
ZENFLOW_SUM_ROWS = (("zenflow", 0), ("zenflow_device_accumulation", DEVICE_ACCUMULATOR_BYTES),
                    ("zenflow_device_bf16", DEVICE_BF16_ACCUMULATOR_BYTES))
def _bound(parts: dict[str, float]) -> tuple[float, str]:
    side = max(parts, key=lambda k: parts[k])
    return parts[side], side


def zenflow_host_passes(update_interval: float, on_device: bool, bf16_sums: bool = False,
                        host_moments: str = DEFAULT_HOST_MOMENTS, window_adamws: float = WINDOW_PASS_VS_ADAMW,
                        accumulate_adamws: float = ACCUMULATE_VS_ADAMW,
                        rounding_adamws: float = ROUNDING_VS_ADAMW) -> list[tuple[str, float, float, float]]:
    """ZenFlow's host work in one window, pass by pass: (pass, how many per window, core work in host AdamWs, host
    memory bytes per offloaded parameter), with a bf16 model and host moments in `host_moments`; the window's AdamW
    pass costs `window_adamws` host AdamWs of core work, one step's accumulation `accumulate_adamws`, the write-back
    rounding `rounding_adamws` (a profile's ``host_window_adamws``, ``host_accumulate_adamws`` and
    ``host_rounding_adamws``: the same whatever the moments' dtype).

    Besides what each pass reads and writes (`HOST_STATE_BYTES`, ...), the DMA that runs beside the passes takes the
    same memory bandwidth and is counted in the pass it overlaps: with host accumulation each step's bf16 gradient
    lands (2) while the worker is busy with earlier ones; the write-back copy reads the bf16 buffer (2) while the
    worker may run the next window. The fp32 window sums' landing (``accumulate_on="device"``) is not counted: the
    host step waits for it (the chain in `schedule_model`), so it overlaps no pass. With `bf16_sums`
    (``accumulate_on="device_bf16"``) the landed bf16 sum is first widened into the fp32 accumulator.

    Example:
        >>> [(name, n, b) for name, n, _, b in zenflow_host_passes(4, on_device=True)]
        [('window AdamW', 1.0, 22.0), ('write-back rounding', 1.0, 6.0)]
    """
    u = max(1.0, float(update_interval))
    state = host_state_bytes(host_moments)
    rounding = ("write-back rounding", 1.0, rounding_adamws, float(HOST_ROUNDING_BYTES))
    if on_device:
        widen = [("bf16 sum widened", 1.0, 0.0, float(HOST_WIDEN_BYTES))] if bf16_sums else []
        return [*widen, ("window AdamW", 1.0, window_adamws, float(FP32_BYTES + state + BF16_BYTES)), rounding]
    landing = BF16_BYTES
    passes = []
    if u > 1:
        # the window's first gradient is written into the sum (read bf16, write fp32), later ones added to it
        passes.append(("first accumulation", 1.0, accumulate_adamws, float(landing + BF16_BYTES + FP32_BYTES)))
    if u > 2:
        passes.append(("accumulation", u - 2, accumulate_adamws,
                       float(landing + BF16_BYTES + 2 * FP32_BYTES)))
    # the last gradient folded into the AdamW pass: the sum read unless the window is that gradient alone
    window = landing + BF16_BYTES + (FP32_BYTES if u > 1 else 0) + state + BF16_BYTES
    return [*passes, ("window AdamW", 1.0, window_adamws, float(window)), rounding]


def _host_pass_ms(profile: HardwareProfile, params: float, core_share: float, adamws: float,
                  nbytes: float) -> tuple[float, float]:
    """(core ms, memory ms) of one host pass over `params` parameters on `core_share` of the node."""
    core = adamws * params / profile.host_core_params_per_s(core_share) * 1e3
    memory = nbytes * params / (profile.host_mem_gbps * core_share * 1e9) * 1e3
    return core, memory


def schedule_model(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
                   update_interval: float = 4, device_step_ms: float | None = None, ranks: int = 1,
                   parallel: str = "ddp", host_moments: str = DEFAULT_HOST_MOMENTS,
                   gradients_freed_in_backward: bool | None = None) -> dict[str, dict[str, Any]]:
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
    if host_moments not in MOMENT_BYTES:
        raise ValueError(f"host_moments={host_moments!r} is invalid: allowed are {', '.join(HOST_MOMENT_DTYPES)}.")
    split = RankSplit(ranks, parallel)
    n = float(params)
    dev, share = split.device_share, split.host_share
    compute = device_step_ms if device_step_ms is not None else (
        6.0 * n * tokens_per_step / (profile.device_tflops * 1e12 * profile.mfu) * 1e3)
    device_adamw = n * dev * DEVICE_ADAMW_BYTES_PER_PARAM / (profile.device_mem_gbps * 1e9) * 1e3
    grad_read = n * dev * LINK_BYTES_PER_PARAM / (profile.device_mem_gbps * 1e9) * 1e3
    link = n * share * LINK_BYTES_PER_PARAM / (profile.link_gbps * 1e9) * 1e3  # one direction, bf16, one GPU
    sync_core, sync_memory = _host_pass_ms(profile, n * share, split.core_share, 1.0, HOST_ADAMW_BYTES_PER_PARAM)
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
    rows["sync_offload"] = {"step_ms": sum(sync_parts.values()), "bound": _bound(sync_parts)[1],
                            "device_ms": compute + allgather, "link_ms": 2 * link, "host_ms": host_adamw,
                            "allgather_ms": allgather,
                            "device_memory_gb": device_memory_gb("sync_offload", n, split=split),
                            "host_memory_gb": n * share * SYNC_HOST_BYTES_PER_PARAM / 1e9,
                            "host_limit": "memory" if sync_memory > sync_core else "cores"}
    selected = topk_ratio * device_adamw + grad_read
    for key, sum_bytes in ZENFLOW_SUM_ROWS:
        on_device = sum_bytes > 0
        # the sums cross in their own dtype: `link` is one bf16 element per parameter
        sums_link = link * sum_bytes / LINK_BYTES_PER_PARAM
        traffic = (DEVICE_ACCUMULATE_TRAFFIC if sum_bytes == DEVICE_ACCUMULATOR_BYTES
                   else DEVICE_BF16_ACCUMULATE_TRAFFIC)
        # the write-back of a window's result (and under DDP its all-gather) runs on the device's stream: on the
        # device timeline
        device = compute + selected + link / u + allgather / u + (
            n * share * traffic / (profile.device_mem_gbps * 1e9) * 1e3 if on_device else 0.0)
        if on_device:
            # the device keeps one sum per matrix: the next window's first add, after its first forward+backward,
            # waits until the copy of the closed window's sums has read them
            device += max(0.0, sums_link - compute) / u
        link_down = sums_link / u if on_device else link  # one sum per window, or every bf16 gradient
        work = core_total = memory_total = 0.0
        chain = sums_link if on_device else link  # what the host step waits for: the sums, or the last gradient
        for name, count, adamws, nbytes in zenflow_host_passes(u, on_device, sum_bytes == BF16_BYTES, host_moments,
                                                               profile.host_window_adamws,
                                                               profile.host_accumulate_adamws,
                                                               profile.host_rounding_adamws):
            core, memory = _host_pass_ms(profile, n * share, split.core_share, adamws, nbytes)
            work += count * max(core, memory)
            core_total += count * core
            memory_total += count * memory
            if name in ("bf16 sum widened", "window AdamW", "write-back rounding"):
                chain += max(core, memory)
        host = max(work, chain) / u
        parts = {"device": device, "link": link_down, "host": host}
        step, side = _bound(parts)
        rows[key] = {"step_ms": step, "bound": side, "device_ms": device, "link_ms": link_down, "host_ms": host,
                     "host_work_ms": work / u, "host_chain_ms": chain,
                     "host_limit": "memory" if memory_total > core_total else "cores",
                     "allgather_ms": allgather / u,
                     "device_memory_gb": device_memory_gb("zenflow", n, topk_ratio, sum_bytes,
                                                          gradients_freed_in_backward, split),
                     "host_memory_gb": n * share * zenflow_host_bytes_per_param(sum_bytes, host_moments) / 1e9}
    for r in rows.values():
        r["fits_device_memory"] = r["device_memory_gb"] <= DEVICE_MEMORY_HEADROOM * profile.device_mem_gb
        r["host_memory_node_gb"] = r["host_memory_gb"] * split.ranks
        r["fits_host_memory"] = r["host_memory_node_gb"] <= HOST_MEMORY_HEADROOM * profile.host_mem_gb
        r["compute_ms"] = compute
    return rows


#: The bound model's row of each `auto_accumulation` choice.
AUTO_ROWS = {"host": "zenflow", "device": "zenflow_device_accumulation", "device_bf16": "zenflow_device_bf16"}


def auto_accumulation(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
                      ranks: int = 1, parallel: str = "ddp",
                      gradients_freed_in_backward: bool | None = None) -> dict[str, Any]:
    """What ``accumulate_on="auto"`` chooses on `profile`: "device" when weights, gradients, the selected columns'
    state and the fp32 window sums (`schedule_model`'s device-accumulation row) plus `activation_gb` fit the
    device's memory less the engine's margin, else "device_bf16" when the same with bf16 sums fits, else "host";
    with the figures (GB, one rank's; ``state_gb`` with the sums of the choice, fp32 sums for "host")."""

    row = schedule_model(profile, params, tokens_per_step, topk_ratio, 4, None, ranks, parallel,
                         gradients_freed_in_backward=gradients_freed_in_backward)
    need, need_bf16 = (row[k]["device_memory_gb"] for k in ("zenflow_device_accumulation", "zenflow_device_bf16"))
    activations = activation_gb(params * RankSplit(ranks, parallel).device_share, tokens_per_step)
    limit = (1 - MARGIN) * profile.device_mem_gb
    choice = ("device" if need + activations <= limit
              else "device_bf16" if need_bf16 + activations <= limit else "host")
    return {"choice": choice, "state_gb": need_bf16 if choice == "device_bf16" else need,
            "activations_gb": activations, "limit_gb": limit, "margin": MARGIN}


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


__all__ = ["AUTO_ROWS", "DEVICE_ADAMW_BYTES_PER_PARAM", "LINK_BYTES_PER_PARAM",
           "activation_gb", "auto_accumulation", "interval_to_unbind", "schedule_model", "zenflow_host_passes"]
