"""Hardware profiles and the bound model of the three offload schedules: "will ZenFlow help on my box?".

A `HardwareProfile` holds the figures of one machine (device FLOP/s and memory, link bandwidth, host cores and memory
bandwidth). `schedule_model` turns a profile, a model size and a ZenFlow setting into per-step times of each side
(device, link, host) for no-offload AdamW, synchronous offload (ZeRO-Offload's schedule) and ZenFlow, and names what
bounds each schedule. It is a model, not a measurement: `hf-zenflow estimate --hardware` also runs the emulator
(`emulator.run_estimate`) on the same figures, which executes the real host code.

The model's constants:

* device compute: ``6 * params * tokens / (device FLOP/s * mfu)`` (forward + backward of a dense transformer);
* device AdamW: 28 bytes per parameter over the device memory bandwidth
  (`emulator_scenario.DEVICE_ADAMW_BYTES_PER_PARAM`); ZenFlow's device step also reads every bf16 gradient once (norms
  and selection);
* link: bf16 gradients and parameters, 2 bytes per parameter per direction;
* host: every host pass takes the longer of its core work and its memory traffic (a roofline per pass; the passes
  run one after another on the host worker). Core work: host AdamWs at the per-core rate (DeepSpeed's published
  CPUAdam rate, 7e9 parameters in 4.6 s on 128 threads, `emulator_scenario.PUBLISHED_*`, or this machine's measured
  one, `host_rates`) times the profile's cores; one step's accumulation is `ACCUMULATE_VS_ADAMW` of a host AdamW,
  the ratio the emulator measured (BENCHMARKS.md §3a: 3 624 ms of host work per step at U=4 with a 4 600 ms AdamW,
  so 2 474 ms of accumulation per step); a pass that only moves bytes (the write-back rounding) has none. Memory
  traffic: the bytes per offloaded parameter each pass reads and writes in its dtypes (`zenflow_host_passes`,
  ``HOST_ADAMW_BYTES_PER_PARAM`` for synchronous offload), over ``host_mem_gbps``, a STREAM-like sustained figure of a
  typical server of the profile's class (`HOST_MEMORY_SOURCES`; STREAM counts a byte read once and a byte written
  once, and so do these counts);
* ZenFlow's window: U - 1 accumulations (host accumulation; the last gradient is folded into the AdamW pass) and one
  AdamW pass, then the rounding of the master into the bf16 write-back buffer. The write-back waits for that host
  step, and the host step for its input to land (the window's fp32 sums with ``accumulate_on="device"``, the last
  step's gradient otherwise): that chain, link then host, must fit in the window's U device steps (the write-back lag
  is at most U), so ZenFlow's host side per step is the larger of its work and that chain over U;
* ``accumulate_on="auto"`` (the default): the device when the ZenFlow row with device accumulation fits the device
  memory with the engine's margin (`hf_zenflow.accumulation.MARGIN` of it left free) together with the activations
  of a llama-shaped model with activation checkpointing (`activation_gb`), else the device with bf16 sums when
  those fit (``"device_bf16"``: half the sums' device memory and link bytes, a widening pass on the host), else the
  host (`auto_accumulation`);
* host memory: `HOST_BYTES_PER_PARAM` per offloaded parameter, as the engines hold it on a bf16 model;
* N data-parallel ranks on the profile's node (``ranks``, ``parallel``): every figure is per rank, split as module
  `ranks` describes (host work, host memory and link bytes 1/N on 1/N of the host cores and memory bandwidth; DDP adds
  an all-gather of the updated rows per write-back at ``interconnect_gbps``); ``tokens_per_step`` is per rank.

Example:
    >>> from hf_zenflow.compare.hardware import PROFILES, schedule_model
    >>> rows = schedule_model(PROFILES["a100-40gb-pcie4"], params=7e9, tokens_per_step=8 * 512)
    >>> rows["sync_offload"]["bound"]
    'host'
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hf_zenflow.compare.emulator_scenario import (
    DEVICE_ADAMW_BYTES_PER_PARAM,
    HOST_BYTES_PER_PARAM,
    LINK_BYTES_PER_PARAM,
    PUBLISHED_HOST_CORES,
    PUBLISHED_HOST_PARAMS_PER_S,
)
from hf_zenflow.compare.ranks import RankSplit


#: Host memory bytes per parameter of synchronous offload's host step (ZeRO-Offload's CPUAdam: the fp32 gradient
#: read (4), the fp32 master, exp_avg and exp_avg_sq read and written (24), the bf16 parameter written in the same
#: pass (2)).
#: Its gradient lands and its parameter leaves while the host waits (the link phases), so no DMA overlaps the pass.
HOST_ADAMW_BYTES_PER_PARAM = 30
#: One step's host accumulation, as a fraction of one host AdamW's core work (measured, see the module docstring).
ACCUMULATE_VS_ADAMW = 0.54
#: ZenFlow's host passes, bytes per offloaded parameter with a bf16 model and fp32 host state (`host.py`): the AdamW
#: pass of `kernels.window_adamw` reads and writes the fp32 master, exp_avg and exp_avg_sq (24) and reads the window's
#: fp32 sum (4; not on a one-step window summed on the host, whose sum is its gradient); with host accumulation it
#: also reads the window's last bf16 gradient, folded in (2).
HOST_STATE_BYTES = 24
FP32_BYTES, BF16_BYTES = 4, 2
#: The rounding of the fp32 master into the bf16 write-back buffer, a pass of its own (``writeback.copy_(master)``):
#: read 4, write 2.
HOST_ROUNDING_BYTES = 6
#: Device bytes per parameter: bf16 weight and gradient (4) + fp32 master and moments (12) where AdamW runs there.
DEVICE_BYTES_WEIGHT_GRAD = 4
DEVICE_BYTES_ADAM_STATE = 12
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
#: Fraction of the device memory counted as usable for weights, gradients and optimizer state (the rest is left for
#: activations, the allocator and the runtime, which the model does not count).
DEVICE_MEMORY_HEADROOM = 0.9


@dataclass
class HardwareProfile:
    """One node's figures, per GPU for the device, link and interconnect, for the whole node for the host. Presets in
    `PROFILES` are nominal datasheet values (dense bf16 tensor-core TFLOP/s, HBM bandwidth, a PCIe x16 link's
    practical bandwidth); measure your own and pass a JSON file for real decisions.

    `interconnect_gbps` is the GPU-to-GPU bandwidth per GPU and direction that an all-gather reaches (nccl-tests'
    "bus bandwidth"). Defaults: on a PCIe node the peer traffic crosses the same x16 links, so it is the link figure
    (25 GB/s Gen4, 50 GB/s Gen5; cards without peer-to-peer, such as the RTX 4090, stage through host memory and get
    less); on an NVLink node half the datasheet's bidirectional NVLink figure (A100 SXM4 600 GB/s -> 300, H100 SXM5
    900 GB/s -> 450). A JSON profile may set it; without it, 25.

    Example:
        >>> HardwareProfile(name="mine", device_tflops=100, device_mem_gb=24, device_mem_gbps=900, link_gbps=25,
        ...                 host_cores=16, host_mem_gbps=60).host_adamw_params_per_s() > 0
        True
    """

    name: str = "custom"
    device_tflops: float = 312.0  # dense bf16 FLOP/s of the device, in TFLOP/s
    device_mem_gb: float = 40.0
    device_mem_gbps: float = 1555.0
    link_gbps: float = 25.0  # host<->device, per direction
    host_cores: int = 64
    host_mem_gbps: float = 200.0
    mfu: float = 0.4  # fraction of the peak FLOP/s a training step reaches
    interconnect_gbps: float = 25.0  # GPU<->GPU per GPU and direction, for the all-gather of several ranks
    # host AdamW parameters/s per core: the published CPUAdam rate unless measured (`host_rates.host_profile`)
    host_adamw_per_core: float = PUBLISHED_HOST_PARAMS_PER_S / PUBLISHED_HOST_CORES

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"HardwareProfile.{f.name}={value!r} is invalid: allowed is a finite number > 0.")
        if self.mfu > 1:
            raise ValueError(f"HardwareProfile.mfu={self.mfu!r} is invalid: allowed is a fraction in (0, 1].")

    def host_core_params_per_s(self, core_share: float = 1.0) -> float:
        """What the cores alone would reach: the per-core AdamW rate times the cores (on `core_share` of them)."""
        return self.host_adamw_per_core * self.host_cores * core_share

    def host_adamw_params_per_s(self, core_share: float = 1.0,
                                bytes_per_param: float = HOST_ADAMW_BYTES_PER_PARAM) -> float:
        """Host AdamW rate: the per-core rate (published, or this host's measured one) times the cores, capped by
        the memory bandwidth over the pass's `bytes_per_param` (synchronous offload's by default); on `core_share`
        of the node's cores and memory bandwidth (one of several ranks on the node)."""
        return min(self.host_core_params_per_s(core_share),
                   self.host_mem_gbps * core_share * 1e9 / bytes_per_param)

    def host_limit(self, bytes_per_param: float = HOST_ADAMW_BYTES_PER_PARAM) -> str:
        """Which bounds a host AdamW pass of `bytes_per_param`: "memory" or "cores"."""
        memory = self.host_mem_gbps * 1e9 / bytes_per_param
        return "memory" if memory < self.host_core_params_per_s() else "cores"

    @classmethod
    def from_json(cls, path: str | Path) -> HardwareProfile:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"hardware profile {path}: unknown key(s) {unknown}: allowed are {sorted(known)}.")
        values.setdefault("name", Path(path).stem)
        return cls(**values)


#: Sustained fraction of the memory channels' peak assumed for the presets' hosts (STREAM-triad-like). Two-socket
#: servers of these generations are commonly measured at 70-85 % of peak; 0.75 is the low end of that, an assumption:
#: measure yours (STREAM) and pass ``--host-memory-gbps`` or a JSON profile. It also assumes the host state is spread
#: over both sockets' memory; pages all on one socket (first touch by one thread, no interleaving) get about half.
SUSTAINED_FRACTION = 0.75
#: GB/s of one DDR channel at its peak: 8 bytes x the transfer rate.
DDR4_3200_GBPS, DDR5_4800_GBPS, DDR5_5200_GBPS = 25.6, 38.4, 41.6


def _sustained(channels: int, channel_gbps: float) -> float:
    return round(channels * channel_gbps * SUSTAINED_FRACTION, 1)


#: Where each preset's host figures (cores, host_mem_gbps) come from: the typical host of a server of that class.
HOST_MEMORY_SOURCES: dict[str, str] = {
    "a100-40gb-pcie4": "a typical A100 PCIe server: 2 x 32-core CPUs (e.g. EPYC 7543), 2 x 8 channels DDR4-3200 "
                       "= 16 x 25.6 = 409.6 GB/s peak, x 0.75 sustained",
    "a100-80gb-pcie4": "a typical A100 PCIe server: 2 x 32-core CPUs (e.g. EPYC 7543), 2 x 8 channels DDR4-3200 "
                       "= 16 x 25.6 = 409.6 GB/s peak, x 0.75 sustained",
    "h100-80gb-pcie5": "a typical H100 PCIe server: 2 x 48-core Sapphire Rapids (e.g. Xeon Platinum 8468), 2 x 8 "
                       "channels DDR5-4800 = 16 x 38.4 = 614.4 GB/s peak, x 0.75 sustained",
    "rtx4090-pcie4": "a 16-core desktop (e.g. Ryzen 9 7950X), 2 channels DDR5-5200 = 2 x 41.6 = 83.2 GB/s peak, "
                     "x 0.75 sustained",
    "l4-pcie4": "a 16-core single-socket server (e.g. EPYC 7313P), 8 channels DDR4-3200 = 8 x 25.6 = 204.8 GB/s "
                "peak, x 0.75 sustained",
    "a100-80gb-sxm4-nvlink": "DGX A100: 2 x 64-core EPYC 7742, 2 x 8 channels DDR4-3200 = 409.6 GB/s peak, x 0.75 "
                             "sustained",
    "h100-80gb-sxm5-nvlink": "DGX H100: 2 x 56-core Xeon Platinum 8480C, 2 x 8 channels DDR5-4800 = 614.4 GB/s "
                             "peak, x 0.75 sustained",
}

# Device and link: nominal datasheet figures. Host: `HOST_MEMORY_SOURCES` (cores and sustained memory bandwidth).
PROFILES: dict[str, HardwareProfile] = {
    "a100-40gb-pcie4": HardwareProfile("a100-40gb-pcie4", 312.0, 40.0, 1555.0, 25.0, 64,
                                       _sustained(16, DDR4_3200_GBPS), interconnect_gbps=25.0),
    "a100-80gb-pcie4": HardwareProfile("a100-80gb-pcie4", 312.0, 80.0, 1935.0, 25.0, 64,
                                       _sustained(16, DDR4_3200_GBPS), interconnect_gbps=25.0),
    "h100-80gb-pcie5": HardwareProfile("h100-80gb-pcie5", 756.0, 80.0, 2000.0, 50.0, 96,
                                       _sustained(16, DDR5_4800_GBPS), interconnect_gbps=50.0),
    "rtx4090-pcie4": HardwareProfile("rtx4090-pcie4", 165.0, 24.0, 1008.0, 25.0, 16, _sustained(2, DDR5_5200_GBPS),
                                     interconnect_gbps=25.0),
    "l4-pcie4": HardwareProfile("l4-pcie4", 121.0, 24.0, 300.0, 25.0, 16, _sustained(8, DDR4_3200_GBPS),
                                interconnect_gbps=25.0),
    "a100-80gb-sxm4-nvlink": HardwareProfile("a100-80gb-sxm4-nvlink", 312.0, 80.0, 2039.0, 25.0, 128,
                                             _sustained(16, DDR4_3200_GBPS), interconnect_gbps=300.0),
    "h100-80gb-sxm5-nvlink": HardwareProfile("h100-80gb-sxm5-nvlink", 989.0, 80.0, 3350.0, 50.0, 112,
                                             _sustained(16, DDR5_4800_GBPS), interconnect_gbps=450.0),
}


def load_profile(spec: str) -> HardwareProfile:
    """A preset name from `PROFILES` or the path of a JSON file with `HardwareProfile`'s fields."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec).expanduser()
    if path.is_file():
        return HardwareProfile.from_json(path)
    raise ValueError(f"--hardware {spec!r} is neither a preset ({', '.join(sorted(PROFILES))}) nor a JSON file.")


def _bound(parts: dict[str, float]) -> tuple[float, str]:
    side = max(parts, key=lambda k: parts[k])
    return parts[side], side


def zenflow_host_passes(update_interval: float, on_device: bool,
                        bf16_sums: bool = False) -> list[tuple[str, float, float, float]]:
    """ZenFlow's host work in one window, pass by pass: (pass, how many per window, core work in host AdamWs, host
    memory bytes per offloaded parameter), with a bf16 model and fp32 host state.

    Besides what each pass reads and writes (`HOST_STATE_BYTES`, ...), the DMA that runs beside the passes takes the
    same memory bandwidth and is counted in the pass it overlaps: with host accumulation each step's bf16 gradient
    lands (2) while the worker is busy with earlier ones; the write-back copy reads the bf16 buffer (2) while the
    worker may run the next window. The fp32 window sums' landing (``accumulate_on="device"``) is not counted: the
    host step waits for it (the chain in `schedule_model`), so it overlaps no pass. With `bf16_sums`
    (``accumulate_on="device_bf16"``) the landed bf16 sum is first widened into the fp32 accumulator.

    Example:
        >>> [(name, n, b) for name, n, _, b in zenflow_host_passes(4, on_device=True)]
        [('window AdamW', 1.0, 30.0), ('write-back rounding', 1.0, 6.0)]
    """
    u = max(1.0, float(update_interval))
    rounding = ("write-back rounding", 1.0, 0.0, float(HOST_ROUNDING_BYTES))
    if on_device:
        widen = [("bf16 sum widened", 1.0, 0.0, float(HOST_WIDEN_BYTES))] if bf16_sums else []
        return [*widen, ("window AdamW", 1.0, 1.0, float(FP32_BYTES + HOST_STATE_BYTES + BF16_BYTES)), rounding]
    landing = BF16_BYTES
    passes = []
    if u > 1:
        # the window's first gradient is written into the sum (read bf16, write fp32), later ones added to it
        passes.append(("first accumulation", 1.0, ACCUMULATE_VS_ADAMW, float(landing + BF16_BYTES + FP32_BYTES)))
    if u > 2:
        passes.append(("accumulation", u - 2, ACCUMULATE_VS_ADAMW,
                       float(landing + BF16_BYTES + 2 * FP32_BYTES)))
    # the last gradient folded into the AdamW pass: the sum read unless the window is that gradient alone
    window = landing + BF16_BYTES + (FP32_BYTES if u > 1 else 0) + HOST_STATE_BYTES + BF16_BYTES
    return [*passes, ("window AdamW", 1.0, 1.0, float(window)), rounding]


def _host_pass_ms(profile: HardwareProfile, params: float, core_share: float, adamws: float,
                  nbytes: float) -> tuple[float, float]:
    """(core ms, memory ms) of one host pass over `params` parameters on `core_share` of the node."""
    core = adamws * params / profile.host_core_params_per_s(core_share) * 1e3
    memory = nbytes * params / (profile.host_mem_gbps * core_share * 1e9) * 1e3
    return core, memory


def schedule_model(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
                   update_interval: float = 4, device_step_ms: float | None = None, ranks: int = 1,
                   parallel: str = "ddp") -> dict[str, dict[str, Any]]:
    """Per-step ms of each side and the step time of every schedule (the slowest side of an overlapped schedule,
    the sum of a synchronous one); `bound` names the side that sets the step; `host_limit` says what bounds the
    host's passes ("memory" or "cores", by the larger share of the host time).

    `device_step_ms` replaces the FLOP-based forward+backward time when you have measured it. With `ranks` > 1 every
    figure is one rank's (`ranks.RankSplit`): ``link_ms`` is one GPU's link, ``host_ms`` one rank's host work on its
    share of the node, ``host_memory_gb`` one rank's host memory, ``allgather_ms`` the per-step share of the
    write-back all-gather (DDP), which is part of ``device_ms``. ZenFlow's rows also carry ``host_work_ms`` (the
    host's passes per step) and ``host_chain_ms`` (per window: the input's landing, then the AdamW and rounding passes
    the write-back waits for); their ``host_ms`` is the larger of the work and the chain over the window.
    """
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
    mem_gb = profile.device_mem_gb
    weights_grads = n * dev * DEVICE_BYTES_WEIGHT_GRAD / 1e9
    rows: dict[str, dict[str, Any]] = {}
    rows["no_offload"] = {"step_ms": compute + device_adamw, "bound": "device",
                          "device_ms": compute + device_adamw, "link_ms": 0.0, "host_ms": 0.0, "allgather_ms": 0.0,
                          "host_limit": None,
                          "device_memory_gb": weights_grads + n * dev * DEVICE_BYTES_ADAM_STATE / 1e9}
    # ZeRO-Offload partitions the same way: its all-gather of the updated weights follows every step
    sync_parts = {"device": compute + allgather, "link": 2 * link, "host": host_adamw}
    rows["sync_offload"] = {"step_ms": sum(sync_parts.values()), "bound": _bound(sync_parts)[1],
                            "device_ms": compute + allgather, "link_ms": 2 * link, "host_ms": host_adamw,
                            "allgather_ms": allgather, "device_memory_gb": weights_grads,
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
        for name, count, adamws, nbytes in zenflow_host_passes(u, on_device, sum_bytes == BF16_BYTES):
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
                     "device_memory_gb": weights_grads + n * (topk_ratio * DEVICE_BYTES_ADAM_STATE * dev
                                                              + sum_bytes * share) / 1e9}
    for key, r in rows.items():
        r["fits_device_memory"] = r["device_memory_gb"] <= DEVICE_MEMORY_HEADROOM * mem_gb
        r["compute_ms"] = compute
        r["host_memory_gb"] = n * share * HOST_BYTES_PER_PARAM[key] / 1e9
    return rows


#: The bound model's row of each `auto_accumulation` choice.
AUTO_ROWS = {"host": "zenflow", "device": "zenflow_device_accumulation", "device_bf16": "zenflow_device_bf16"}


def activation_gb(params: float, tokens_per_step: float) -> float:
    """Activation memory of a llama-shaped model with activation checkpointing, in GB: one bf16 hidden state per
    layer and token, plus one layer's full activations (~34 bytes x hidden per token, Korthikanti et al. 2022);
    shape from the size: params = 12 x layers x hidden^2 with layers = hidden / 128 (7B: hidden 4096, 32 layers)."""
    hidden = (float(params) * 128 / 12) ** (1 / 3)
    layers = hidden / 128
    return tokens_per_step * hidden * (2 * layers + 34) / 1e9


def auto_accumulation(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
                      ranks: int = 1, parallel: str = "ddp") -> dict[str, Any]:
    """What ``accumulate_on="auto"`` chooses on `profile`: "device" when weights, gradients, the selected columns'
    state and the fp32 window sums (`schedule_model`'s device-accumulation row) plus `activation_gb` fit the
    device's memory less the engine's margin, else "device_bf16" when the same with bf16 sums fits, else "host";
    with the figures (GB, one rank's; ``state_gb`` with the sums of the choice, fp32 sums for "host")."""
    from hf_zenflow.accumulation import MARGIN

    row = schedule_model(profile, params, tokens_per_step, topk_ratio, 4, None, ranks, parallel)
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


def advice(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
           update_interval: float = 4, device_step_ms: float | None = None, ranks: int = 1,
           parallel: str = "ddp") -> list[str]:
    """Plain sentences: does offloading help here, where is ZenFlow bound, and which setting moves the bound; with
    several ranks, what each rank gets and what the all-gather costs."""
    rows = schedule_model(profile, params, tokens_per_step, topk_ratio, update_interval, device_step_ms, ranks,
                          parallel)
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
    auto = auto_accumulation(profile, params, tokens_per_step, topk_ratio, ranks, parallel)
    chosen = rows[AUTO_ROWS[auto["choice"]]]
    sums = "bf16" if auto["choice"] == "device_bf16" else "fp32"
    out.append(f'accumulate_on="auto" (the default) chooses "{auto["choice"]}": weights, gradients, selected '
               f"columns and {sums} window sums {auto['state_gb']:.1f} GB + activations ~{auto['activations_gb']:.1f} "
               f"GB (checkpointed, estimated) {'>' if auto['choice'] == 'host' else '<='} {auto['limit_gb']:.1f} "
               f"GB (the device's {profile.device_mem_gb:g} GB less a {auto['margin']:.0%} margin); ZenFlow with the "
               f"defaults: {chosen['step_ms']:.0f} ms/step, {chosen['bound']}-bound, "
               f"{sync['step_ms'] / chosen['step_ms']:.2f}x faster than synchronous offload, "
               f"{chosen['step_ms'] / base['step_ms']:.2f}x the no-offload step.")
    u = max(1.0, float(update_interval))
    landing = chosen["link_ms"] * u if auto["choice"] != "host" else chosen["link_ms"]
    out.append(f"Its host side per window of {u:g} steps: {chosen['host_work_ms'] * u:.0f} ms of host passes "
               f"(bound by {'memory bandwidth' if chosen['host_limit'] == 'memory' else 'the cores'}); the write-back "
               f"waits for the chain of the input landing ({landing:.0f} ms) then the AdamW and rounding passes, "
               f"{chosen['host_chain_ms']:.0f} ms in all: {chosen['host_ms']:.0f} ms per step, the larger over "
               f"the window.")
    out.append(f"ZenFlow (window summed on the host, U={update_interval:g}): {zen['step_ms']:.0f} ms/step, "
               f"{zen['bound']}-bound, {sync['step_ms'] / zen['step_ms']:.2f}x faster than synchronous offload "
               f"({sync['step_ms']:.0f} ms/step), {zen['step_ms'] / base['step_ms']:.2f}x the no-offload step.")
    if zen["bound"] == "host":
        unbind = {"device_step_ms": device_step_ms, "ranks": ranks, "parallel": parallel}
        u_host = interval_to_unbind(profile, params, tokens_per_step, topk_ratio, "host", **unbind)
        u_dev = interval_to_unbind(profile, params, tokens_per_step, topk_ratio, "device", **unbind)
        move = (f'accumulate_on="device" moves the bound: {dev["step_ms"]:.0f} ms/step ({dev["bound"]}-bound; '
                f'+{params * DEVICE_ACCUMULATOR_BYTES / ranks / 1e9:.1f} GB of device memory'
                + ("" if dev["fits_device_memory"] else ", which does NOT fit") + ")")
        move += f"; device-bound from update_interval={u_dev}" if u_dev else "; still not device-bound at U=32"
        if u_host:
            move += f"; with host accumulation from update_interval={u_host}"
        out.append("Host-bound: the host accumulates U - 1 steps' gradients and runs one AdamW per window (with the "
                   "last gradient folded in). " + move
                   + ".")
    elif zen["bound"] == "link":
        out.append('Link-bound: every step\'s gradient crosses the link. accumulate_on="device" sends one fp32 sum '
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
                          parallel: str = "ddp") -> str:
    """Markdown: the profile, one row per schedule (each side's ms, the step, the bound), then `advice`; with several
    ranks the figures are one rank's and two columns (all-gather, host memory per rank) are added."""
    rows = schedule_model(profile, params, tokens_per_step, topk_ratio, update_interval, device_step_ms, ranks,
                          parallel)
    several = ranks > 1
    names = {"no_offload": "no offload (AdamW on device)", "sync_offload": "synchronous offload (ZeRO-Offload)",
             "zenflow": f"ZenFlow, U={update_interval:g}, topk_ratio={topk_ratio:g} (window summed on the host)",
             "zenflow_device_accumulation": 'ZenFlow, same, accumulate_on="device"',
             "zenflow_device_bf16": 'ZenFlow, same, accumulate_on="device_bf16"'}
    chosen = auto_accumulation(profile, params, tokens_per_step, topk_ratio, ranks, parallel)["choice"]
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
    extra = " all-gather ms/step (in device) | host memory GB per rank |" if several else ""
    lines += ["| schedule | device ms/step | link ms/step | host ms/step | step ms | bound | vs sync offload | "
              "device memory GB (no activations) | host passes limited by |" + extra,
              "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if several else "")]
    sync = rows["sync_offload"]["step_ms"]
    for key, label in names.items():
        r = rows[key]
        fits = "" if r["fits_device_memory"] else " (does not fit)"
        bound = "sum (synchronous)" if key == "sync_offload" else r["bound"]
        limit = {"memory": f"memory ({profile.host_mem_gbps:g} GB/s)",
                 "cores": f"cores ({profile.host_cores} x {profile.host_adamw_per_core / 1e6:.0f} M/s)"}.get(
                     r["host_limit"], "-")
        lines.append(f"| {label} | {r['device_ms']:.0f} | {r['link_ms']:.0f} | {r['host_ms']:.0f} | "
                     f"{r['step_ms']:.0f} | {bound} | {sync / r['step_ms']:.2f}x | "
                     f"{r['device_memory_gb']:.1f}{fits} | {limit} |"
                     + (f" {r['allgather_ms']:.0f} | {r['host_memory_gb']:.1f} |" if several else ""))
    lines += [""] + [f"- {s}" for s in advice(profile, params, tokens_per_step, topk_ratio, update_interval,
                                              device_step_ms, ranks, parallel)]
    return "\n".join(lines) + "\n"


__all__ = ["HOST_BYTES_PER_PARAM", "PROFILES", "HardwareProfile", "activation_gb", "advice", "auto_accumulation",
           "format_schedule_model",
           "interval_to_unbind", "load_profile", "schedule_model"]
