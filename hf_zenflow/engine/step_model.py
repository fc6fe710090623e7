"""How long a ZenFlow step takes, side by side, on a node's figures: the device, the link and the host, each per step,
and the step the slowest of them (they overlap). One model for the planner (`planner.py`: which schedule is the
fastest) and for `hf-zenflow estimate` (its ZenFlow rows, `hf_zenflow.estimate.hardware`); it is a model, never a
timing of the run, so a choice made from it is the same in every run of the same script on the same sizes.

* device: forward+backward (`compute_ms`, given), the AdamW of what is updated on the device each step
  (`DEVICE_ADAMW_BYTES_PER_PARAM` over the device memory bandwidth), one read of every gradient (norms and
  selection), the write-back of a window's result once per window and, with device window sums, their per-step add
  (`DEVICE_ACCUMULATE_TRAFFIC`, `DEVICE_BF16_ACCUMULATE_TRAFFIC`);
* link: every offloaded gradient each step (window summed on the host), or one sum per window (on the device);
* host: the window's passes (`zenflow_host_passes`), each the longer of its core work (in host AdamWs at the cores'
  rate) and its memory traffic (over the memory bandwidth); and the chain the write-back waits for (the input's
  landing, then the AdamW and rounding passes) over the window.

Example:
    >>> rates = Rates(device_mem_gbps=2000, link_gbps=50, host_core_params_per_s=1e11, host_mem_gbps=460.8)
    >>> sides = zenflow_step(rates, compute_ms=569.0, device_elements=7e9, selected_elements=7e8,
    ...                      host_elements=7e9, update_interval=4, accumulate_on="host")
    >>> sides["bound"], round(sides["step_ms"])
    ('device', 656)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


FP32_BYTES, BF16_BYTES = 4, 2
#: Host moment storage, bytes per element of each of the two moments, by ``host_moment_dtype``: int8 blocks of
#: `INT8_BLOCK` elements with one fp32 scale each.
INT8_BLOCK = 256
MOMENT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + FP32_BYTES / INT8_BLOCK}
#: AdamW bytes per parameter on the device: read bf16 grad + fp32 master, exp_avg, exp_avg_sq (14 B), write the
#: three fp32 tensors and the bf16 parameter (14 B).
DEVICE_ADAMW_BYTES_PER_PARAM = 28
#: bf16 gradients and parameters cross the link.
LINK_BYTES_PER_PARAM = 2
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
#: Bytes of one device-side window sum element by where the window is summed (0: on the host).
SUM_BYTES = {"host": 0, "device": DEVICE_ACCUMULATOR_BYTES, "device_bf16": DEVICE_BF16_ACCUMULATOR_BYTES}
#: ZenFlow's host passes in host AdamWs of core work where they are not measured (`hf_zenflow.estimate.host_rates`
#: times the engine's own passes against a fused AdamW): the window's AdamW pass (the window's sum read, its last
#: gradient folded in, the mean taken, AdamW), one step's accumulation, and the rounding of the master into the bf16
#: write-back buffer (counted by its bytes alone when not measured).
WINDOW_PASS_VS_ADAMW = 1.0
ACCUMULATE_VS_ADAMW = 0.54
ROUNDING_VS_ADAMW = 0.0


@dataclass(frozen=True)
class Rates:
    """The speeds the model weighs, for one rank: its device's memory bandwidth and its link (GB/s, per direction),
    the host AdamW rate of the cores its host work runs on (parameters/s) and their memory bandwidth (GB/s), and what
    ZenFlow's host passes cost in host AdamWs of core work."""

    device_mem_gbps: float
    link_gbps: float
    host_core_params_per_s: float
    host_mem_gbps: float
    window_adamws: float = WINDOW_PASS_VS_ADAMW
    accumulate_adamws: float = ACCUMULATE_VS_ADAMW
    rounding_adamws: float = ROUNDING_VS_ADAMW

    def host_pass_ms(self, elements: float, adamws: float, nbytes: float) -> tuple[float, float]:
        """(core ms, memory ms) of one host pass over `elements` offloaded elements."""
        core = adamws * elements / self.host_core_params_per_s * 1e3
        memory = nbytes * elements / (self.host_mem_gbps * 1e9) * 1e3
        return core, memory


def host_state_bytes(host_moments: str) -> float:
    """Bytes per offloaded parameter the window's host AdamW pass reads and writes of its state: the fp32 master and
    the two moments, each read and written (24 with fp32 moments, 16 with bf16 ones)."""
    return 2 * (FP32_BYTES + 2 * MOMENT_BYTES[host_moments])


def zenflow_host_passes(update_interval: float, on_device: bool, bf16_sums: bool = False,
                        host_moments: str = "bfloat16", window_adamws: float = WINDOW_PASS_VS_ADAMW,
                        accumulate_adamws: float = ACCUMULATE_VS_ADAMW, rounding_adamws: float = ROUNDING_VS_ADAMW,
                        grad_bytes: float = BF16_BYTES) -> list[tuple[str, float, float, float]]:
    """ZenFlow's host work in one window, pass by pass: (pass, how many per window, core work in host AdamWs, host
    memory bytes per offloaded parameter), with gradients of `grad_bytes` (a bf16 model: 2) and host moments in
    `host_moments`; the window's AdamW pass costs `window_adamws` host AdamWs of core work, one step's accumulation
    `accumulate_adamws`, the write-back rounding `rounding_adamws` (the same whatever the moments' dtype).

    Besides what each pass reads and writes (`host_state_bytes`, ...), the DMA that runs beside the passes takes the
    same memory bandwidth and is counted in the pass it overlaps: with host accumulation each step's gradient lands
    while the worker is busy with earlier ones; the write-back copy reads the bf16 buffer (2) while the worker may
    run the next window. The fp32 window sums' landing (``accumulate_on="device"``) is not counted: the host step
    waits for it (the chain in `zenflow_step`), so it overlaps no pass. With `bf16_sums`
    (``accumulate_on="device_bf16"``) the window's AdamW pass reads the landed bf16 sum (2 B instead of 4).

    Example:
        >>> [(name, n, b) for name, n, _, b in zenflow_host_passes(4, on_device=True)]
        [('window AdamW', 1.0, 22.0), ('write-back rounding', 1.0, 6.0)]
    """
    u = max(1.0, float(update_interval))
    state = host_state_bytes(host_moments)
    rounding = ("write-back rounding", 1.0, rounding_adamws, float(HOST_ROUNDING_BYTES))
    if on_device:
        landed = BF16_BYTES if bf16_sums else FP32_BYTES
        return [("window AdamW", 1.0, window_adamws, float(landed + state + BF16_BYTES)), rounding]
    landing = grad_bytes
    passes = []
    if u > 1:
        # the window's first gradient is written into the sum (read it, write fp32), later ones added to it
        passes.append(("first accumulation", 1.0, accumulate_adamws, float(landing + grad_bytes + FP32_BYTES)))
    if u > 2:
        passes.append(("accumulation", u - 2, accumulate_adamws, float(landing + grad_bytes + 2 * FP32_BYTES)))
    # the last gradient folded into the AdamW pass: the sum read unless the window is that gradient alone
    window = landing + grad_bytes + (FP32_BYTES if u > 1 else 0) + state + BF16_BYTES
    return [*passes, ("window AdamW", 1.0, window_adamws, float(window)), rounding]


def _bound(parts: dict[str, float]) -> tuple[float, str]:
    side = max(parts, key=lambda k: parts[k])
    return parts[side], side


def zenflow_step(rates: Rates, compute_ms: float, device_elements: float, selected_elements: float,
                 host_elements: float, update_interval: float, accumulate_on: str, host_moments: str = "bfloat16",
                 allgather_ms: float = 0.0, grad_bytes: float = BF16_BYTES,
                 writeback_from_master: bool = False) -> dict[str, Any]:
    """One ZenFlow step's sides, per step (ms): ``device_ms``, ``link_ms``, ``host_ms`` (the larger of the host's
    passes, ``host_work_ms``, and the chain the write-back waits for, ``host_chain_ms``, over the window), the step
    (``step_ms``, the slowest side) and the side that sets it (``bound``), and what bounds the host passes
    (``host_limit``: "memory" or "cores").

    `compute_ms`: the forward+backward; `device_elements`: the parameters the device holds (each gradient read
    once); `selected_elements`: those updated by AdamW on the device each step (selected columns, whole matrices and
    1-D parameters); `host_elements`: this rank's offloaded elements (its host state); `accumulate_on`: "host",
    "device" or "device_bf16"; `allgather_ms`: the all-gather of a window's updated rows (several ranks), on the
    device's stream once per window; `grad_bytes`: a gradient element's bytes as it crosses the link;
    `writeback_from_master`: the write-back reads the fp32 master: its rounding pass runs on the training thread at
    the write-back instead of on the host worker beside the device's steps. Either way the training thread fills the
    pinned ring's chunks (rounding the master, or copying the buffer: a read and a write of its bytes at the host's
    memory bandwidth) while the link copies the chunks filled before, and the device waits for the weights: the
    write-back lasts the longer of the two.
    """
    u = max(1.0, float(update_interval))
    sum_bytes = SUM_BYTES[accumulate_on]
    on_device = sum_bytes > 0
    device_bw, link_bw = rates.device_mem_gbps * 1e9, rates.link_gbps * 1e9
    selected = (selected_elements * DEVICE_ADAMW_BYTES_PER_PARAM + device_elements * LINK_BYTES_PER_PARAM) \
        / device_bw * 1e3
    link = host_elements * LINK_BYTES_PER_PARAM / link_bw * 1e3  # a write-back (bf16 weights), one direction
    grads_link = host_elements * grad_bytes / link_bw * 1e3  # every offloaded gradient of a step
    sums_link = host_elements * sum_bytes / link_bw * 1e3  # the sums cross in their own dtype
    traffic = DEVICE_ACCUMULATE_TRAFFIC if sum_bytes == DEVICE_ACCUMULATOR_BYTES else DEVICE_BF16_ACCUMULATE_TRAFFIC
    # the write-back of a window's result (and under DDP its all-gather) runs on the device's stream: on the
    # device timeline, its link copies overlapped with the training thread's fill of the ring (`fill`, below)
    device = compute_ms + selected + allgather_ms / u + (
        host_elements * traffic / device_bw * 1e3 if on_device else 0.0)
    fill = host_elements * 2 * LINK_BYTES_PER_PARAM / (rates.host_mem_gbps * 1e9) * 1e3  # (the buffer's copy)
    if on_device:
        # the device keeps one sum per matrix: the next window's first add, after its first forward+backward,
        # waits until the copy of the closed window's sums has read them
        device += max(0.0, sums_link - compute_ms) / u
    link_down = sums_link / u if on_device else grads_link  # one sum per window, or every gradient
    work = core_total = memory_total = 0.0
    chain = sums_link if on_device else grads_link  # what the host step waits for: the sums, or the last gradient
    for name, count, adamws, nbytes in zenflow_host_passes(u, on_device, sum_bytes == BF16_BYTES, host_moments,
                                                           rates.window_adamws, rates.accumulate_adamws,
                                                           rates.rounding_adamws, grad_bytes):
        core, memory = rates.host_pass_ms(host_elements, adamws, nbytes)
        if writeback_from_master and name == "write-back rounding":
            fill = max(core, memory)  # (on the training thread, at the write-back: not the worker's)
            continue
        work += count * max(core, memory)
        core_total += count * core
        memory_total += count * memory
        if name in ("window AdamW", "write-back rounding"):
            chain += max(core, memory)
    device += max(link, fill) / u
    host = max(work, chain) / u
    step, side = _bound({"device": device, "link": link_down, "host": host})
    return {"step_ms": step, "bound": side, "device_ms": device, "link_ms": link_down, "host_ms": host,
            "host_work_ms": work / u, "host_chain_ms": chain,
            "host_limit": "memory" if memory_total > core_total else "cores", "allgather_ms": allgather_ms / u}


__all__ = ["ACCUMULATE_VS_ADAMW", "DEVICE_ACCUMULATE_TRAFFIC", "DEVICE_ACCUMULATOR_BYTES",
           "DEVICE_ADAMW_BYTES_PER_PARAM", "DEVICE_BF16_ACCUMULATE_TRAFFIC", "DEVICE_BF16_ACCUMULATOR_BYTES",
           "HOST_ROUNDING_BYTES", "LINK_BYTES_PER_PARAM", "MOMENT_BYTES", "ROUNDING_VS_ADAMW",
           "SUM_BYTES", "WINDOW_PASS_VS_ADAMW", "Rates", "host_state_bytes", "zenflow_host_passes", "zenflow_step"]
