"""One planner: the schedule a run takes, chosen once at its first step, and the same rule in `hf-zenflow estimate`.

What it chooses, where the settings leave it free:

* where a window is summed (``accumulate_on="auto"``): on the host, or on the device in fp32 (``"device"``) or in
  bf16 (``"device_bf16"``); with it whether the offloaded gradients are freed in backward (host sums on one process,
  `free_gradients_in_backward`: device sums keep them until `step()`), which the device bytes of each option count;
* under ``device_memory_limit_bytes``, the run's `min_offload_numel` (`choose_min_offload_numel`): the largest
  threshold whose estimated peak fits the limit (`device_budget.estimate_peak`), so that a matrix leaves the device
  only to make room (a matrix kept whole gets AdamW's update at every step; the model below does not weigh quality).

The rule (`choose`): **the fastest option that fits the device memory and the host RAM it can see, then the
smallest** (options within `SAME_SPEED` of the fastest count as equally fast; of those the one with the fewest
bytes). When none fits, the one that overflows the device least (an out-of-memory error), then the host least
(swapping). "Fastest" is the bound model of a step (`step_model.zenflow_step`) on a node's figures: in `hf-zenflow
estimate` its profile's, in a run `RUNTIME_NODE`'s (a PCIe Gen5 GPU server: `hf-zenflow estimate`'s default
profile), never a timing of the run, so the same script makes the same choice and trains to the same weights. "Fits":

* device: the room the step leaves (`accumulation.available_bytes`): under `device_memory_limit_bytes` the limit less
  the estimated peak beside the window sums (`device_budget.estimate_peak`; on CUDA also less the peak measured so
  far, and at most the measured room); without a limit on CUDA the free memory and the caching allocator's reserve
  less the peak so far, on a CPU device unknown, so nothing that needs device room fits; less `MARGIN` of the
  device (of the limit under one);
* host: the RAM this process can still take (`host_ram.available_host_bytes`: ``MemAvailable``, capped by its
  cgroup v1/v2 limits), shared by the ranks of the node (``LOCAL_WORLD_SIZE``), less `MARGIN` of it; the host
  state of each option counted from its settings (`host_footprint.host_bytes_per_element`).

With the window summed on the host the device holds nothing more, and with this package's host passes a server's
host keeps up with forward and backward at a few thousand tokens per step: host sums are then the fastest and the
smallest on the device, and device sums are chosen where the host RAM is short (they need 4 B less per offloaded
parameter on the host) or the host is the bound. Several ranks agree: each rank's overflows and step times are summed
over the ranks (one all-reduce), so every rank chooses alike. The choice is logged, in ``stats()["accumulate_on"]``
and in checkpoints (a resumed run keeps it).

Example:
    >>> fast = Option("host", step_ms=656.0, device_bytes=0.0, host_bytes=126e9)
    >>> slow = Option("device", step_ms=691.0, device_bytes=28e9, host_bytes=98e9)
    >>> choose([fast, slow]).accumulate_on
    'host'
    >>> choose([Option("host", 656.0, 0.0, 126e9, host_over=11e9), slow]).accumulate_on  # the host is short
    'device'
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..settings.config import DEVICE_SUM_DTYPES, ZenFlowConfig
from .accumulation import MARGIN, available_bytes, device_bytes_needed
from .device_budget import PeakEstimate, estimate_peak
from .host import HostLayout, grad_slots
from .host_footprint import host_bytes_per_element
from .host_ram import available_host_bytes
from .params import is_split
from .schedule import planned_writeback_steps
from .step_model import Rates, zenflow_step


if TYPE_CHECKING:
    from ..distributed.sharding import RankGroup, Share
    from ..transport import Transport
    from .split_matrix import SplitMatrix

logger = logging.getLogger("hf_zenflow")

#: Options within this fraction of the fastest one's step time count as equally fast: the smallest of them is taken.
SAME_SPEED = 0.01
#: Where a window may be summed, in the order the log lists them.
SUM_PLACES = ("host", "device", "device_bf16")


@dataclass(frozen=True)
class Option:
    """One schedule the planner weighs: where it sums the window, its modelled step time, the device bytes it adds
    to what every option holds, its host bytes, and by how much it overflows the device's room and the host's
    (0: it fits)."""

    accumulate_on: str
    step_ms: float
    device_bytes: float
    host_bytes: float
    device_over: float = 0.0
    host_over: float = 0.0

    @property
    def fits(self) -> bool:
        return self.device_over <= 0 and self.host_over <= 0


def choose(options: Sequence[Option]) -> Option:
    """The fastest of `options` that fits, then the smallest (see the module docstring); when none fits, the one
    that overflows the device least, then the host."""
    fitting = [o for o in options if o.fits]
    if not fitting:
        return min(options, key=lambda o: (o.device_over, o.host_over, o.step_ms))
    fastest = min(o.step_ms for o in fitting)
    near = [o for o in fitting if o.step_ms <= fastest * (1 + SAME_SPEED)]
    return min(near, key=lambda o: (o.device_bytes + o.host_bytes, o.step_ms))


@dataclass(frozen=True)
class Node:
    """A node's speeds as the planner weighs them in a run (the memory is what the run sees, `Option`): its device's
    dense bf16 TFLOP/s and the fraction of them a step reaches, the device's memory bandwidth and its link (GB/s),
    the host's cores, its AdamW rate per core for this package's host passes and its memory bandwidth (GB/s), and the
    tokens of a step (forward+backward = 6 x params x tokens FLOPs)."""

    device_tflops: float
    mfu: float
    device_mem_gbps: float
    link_gbps: float
    host_cores: int
    host_adamw_per_core: float
    host_mem_gbps: float
    tokens_per_step: float

    def rates(self) -> Rates:
        return Rates(self.device_mem_gbps, self.link_gbps, self.host_adamw_per_core * self.host_cores,
                     self.host_mem_gbps)

    def compute_ms(self, params: float) -> float:
        return 6.0 * params * self.tokens_per_step / (self.device_tflops * 1e12 * self.mfu) * 1e3


#: What a run plans on: the device, link and host of `hf-zenflow estimate`'s default profile (``h100-80gb-pcie5``:
#: a PCIe Gen5 GPU with a 2-socket server, `hf_zenflow.estimate.profiles.PROFILES`), a host AdamW rate per core of
#: 1e9 parameters/s (the order of this package's fused passes on one core of a current server; the passes are bound
#: by the memory bandwidth there anyway) and `hf-zenflow estimate`'s default 4096 tokens per step. The run knows none
#: of these without timing itself, which would make its choice differ from run to run.
RUNTIME_NODE = Node(device_tflops=756.0, mfu=0.4, device_mem_gbps=2000.0, link_gbps=50.0, host_cores=96,
                    host_adamw_per_core=1e9, host_mem_gbps=460.8, tokens_per_step=4096.0)


def host_room(margin: float = MARGIN) -> float | None:
    """The host RAM this rank may fill with host state: what the process can still take (`available_host_bytes`),
    shared by the node's ranks (``LOCAL_WORLD_SIZE``), less `margin` of it; None when unknown."""
    available = available_host_bytes()
    if available is None:
        return None
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return available / local_ranks * (1 - margin)


# ---------------------------------------------------------------------------------------------------------------------
# Where windows are summed
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class RunSizes:
    """What a run's options are weighed on: its matrices with host state (`splits`, this rank's `shares` of them),
    the transport of each (`transport_of`), the trainable elements on the device (`device_elements`, the whole
    model's when FSDP2 shards it: `model_elements`), and the device's peak so far (`peak`) and whether host sums
    free the offloaded gradients in backward (`frees_gradients`, which device sums keep until `step()`)."""

    splits: list[SplitMatrix]
    shares: dict[int, Share]
    transport_of: Callable[[SplitMatrix], Transport]
    device_elements: float
    model_elements: float
    peak: int = 0
    frees_gradients: bool = False


def _options(config: ZenFlowConfig, sizes: RunSizes, ranks: int, node: Node) -> list[Option]:
    """Every place `config.rules.accumulate_on` allows, with its step time, bytes and overflows on this rank."""
    places = SUM_PLACES if config.rules.accumulate_on == "auto" else (config.rules.accumulate_on,)
    layout = HostLayout.of(config)
    splits = sizes.splits
    local = [sizes.shares[id(s)].local(s.matrix(s.param)).numel() for s in splits]
    selected = sum(s.k * (s.matrix(s.param).numel() // max(1, s.columns)) for s in splits)
    hosted = float(sum(local))
    grad_bytes = (sum(n * s.grad_dtype.itemsize for s, n in zip(splits, local)) / hosted) if hosted else 2.0
    interval = config.update_interval if isinstance(config.update_interval, int) else config.rules.auto_max_interval
    compute = node.compute_ms(sizes.model_elements)
    rooms = {device: available_bytes(device, config.device_memory_limit_bytes, sizes.peak)
             for device in {s.param.device for s in splits}}
    room_host = host_room()
    # (each transport once, with whether the write-back reads the master through it)
    masters = {id(t): (t, layout.applied(t, sizes.shares[id(s)].ranks).writeback_from_master)
               for s, t in zip(splits, map(sizes.transport_of, splits))}
    # (a write-back from the master rounds on the training thread: into the weights, or the ring of a GPU)
    from_master = any(m for _, m in masters.values())
    slots = grad_slots(planned_writeback_steps(config, int(hosted)))  # (landing buffers of host sums)
    options = []
    for place in places:
        sum_bytes = DEVICE_SUM_DTYPES[place].itemsize if place in DEVICE_SUM_DTYPES else 0
        device_over, device_bytes = 0.0, 0.0
        for device, (spare, size) in rooms.items():
            mine = [s for s in splits if s.param.device == device]
            need = 0.0
            if sum_bytes:
                # the sums and the selected columns' state, and the offloaded gradients device sums keep until the
                # step where host sums would free them in backward
                kept = sum(s.host_part(s.param).numel() * s.param.element_size() for s in mine) \
                    if sizes.frees_gradients else 0
                need = float(device_bytes_needed(mine, sizes.shares, sum_bytes) + kept)
                device_over += max(0.0, need - (spare - MARGIN * size)) if spare is not None and size is not None \
                    else math.inf
            device_bytes += need
        # (each transport's rings: the write-back's, and the device sums' or the gradients')
        fixed = sum(t.fixed_host_bytes(bool(sum_bytes)) for t, _ in masters.values())
        host = fixed + sum(n * host_bytes_per_element(layout, place, s.param.dtype, s.grad_dtype,
                                                      sizes.transport_of(s), sizes.shares[id(s)].ranks,
                                                      s.k / max(1, s.columns), slots)
                           for s, n in zip(splits, local))
        step = zenflow_step(node.rates(), compute, sizes.device_elements,
                            selected + sizes.device_elements - hosted, hosted, interval, place,
                            config.rules.host_moment_dtype, grad_bytes=grad_bytes,
                            writeback_from_master=from_master)["step_ms"]
        options.append(Option(place, step, device_bytes, host, device_over,
                              0.0 if room_host is None else max(0.0, host - room_host)))
    return options


def plan_accumulation(config: ZenFlowConfig, sizes: RunSizes, ranks: RankGroup, node: Node = RUNTIME_NODE) -> str:
    """Where this run sums its windows: `config.rules.accumulate_on` when explicit, else the planner's choice
    (`choose`) over the places, agreed by every rank of `ranks` (a collective when there are several: call it on
    every rank at the same step), logged once."""
    if config.rules.accumulate_on != "auto":
        return config.rules.accumulate_on
    options = _options(config, sizes, ranks.ranks, node)
    if ranks.ranks > 1:
        # one row per place: overflows and step times summed over the ranks, so that every rank chooses alike (an
        # overflow anywhere stays one after the sum; inf, unknown device memory, is sent as a large number)
        figures = torch.tensor([[min(o.device_over, 1e30), min(o.host_over, 1e30), o.step_ms] for o in options],
                               dtype=torch.float64, device=splits_device(sizes))
        ranks.all_reduce_sum([figures], "accumulate_on agreement")
        options = [Option(o.accumulate_on, f[2], o.device_bytes, o.host_bytes, f[0], f[1])
                   for o, f in zip(options, figures.tolist())]
    chosen = choose(options)
    logger.info('hf_zenflow: accumulate_on="auto" chose "%s": the fastest that fits, then the smallest (%s%s)',
                chosen.accumulate_on, "; ".join(_describe(o) for o in options),
                f"; agreed over {ranks.ranks} ranks" if ranks.ranks > 1 else "")
    return chosen.accumulate_on


def splits_device(sizes: RunSizes) -> torch.device:
    return sizes.splits[0].param.device if sizes.splits else torch.device("cpu")


def _describe(option: Option) -> str:
    fits = "fits" if option.fits else (
        "device memory unknown" if math.isinf(option.device_over) else
        f"over by {option.device_over / 2**20:.1f} MiB on the device, {option.host_over / 2**20:.1f} MiB on the host")
    return (f"{option.accumulate_on}: {option.step_ms:.3g} ms/step modelled, +{option.device_bytes / 2**20:.1f} MiB "
            f"on the device, {option.host_bytes / 2**20:.1f} MiB on the host, {fits}")


# ---------------------------------------------------------------------------------------------------------------------
# min_offload_numel under a device memory limit
# ---------------------------------------------------------------------------------------------------------------------
def _local(p: torch.Tensor) -> torch.Tensor:
    return getattr(p, "_local_tensor", p)  # (an FSDP2 DTensor: this rank's shard is what the device holds)


def candidate_thresholds(groups: list[dict[str, Any]], config: ZenFlowConfig) -> list[int]:
    """`min_offload_numel` and, below it, the size of each trainable matrix that could be split, largest first."""
    sizes = {math.prod(p.shape) for g in groups for p in g["params"]
             if p.requires_grad and is_split(_local(p), g, config, p.shape, 0)}
    return [config.min_offload_numel] + sorted((n for n in sizes if n < config.min_offload_numel), reverse=True)


@dataclass(frozen=True)
class LimitChoice:
    """What the limit chose: the run's `min_offload_numel`, its estimated peak, and whether that fits."""

    min_offload_numel: int
    estimate: PeakEstimate
    fits: bool


def choose_min_offload_numel(groups: list[dict[str, Any]], config: ZenFlowConfig, frees: bool,
                             accumulate_on: str | None = None, copies_lag: bool = False) -> LimitChoice:
    """The largest threshold whose estimated peak fits `config.device_memory_limit_bytes` (set), else the one with
    the smallest estimated peak. `accumulate_on`: where windows are summed when known; "auto" before its choice
    counts host sums (the smallest on the device: `plan_accumulation` then puts the sums on the device only when
    they fit on top); `copies_lag`: copies to the host may lag backward (`device_budget.estimate_peak`)."""
    limit = config.device_memory_limit_bytes
    sums = accumulate_on if accumulate_on in ("host", *DEVICE_SUM_DTYPES) else "host"
    best: LimitChoice | None = None
    for threshold in candidate_thresholds(groups, config):
        estimate = estimate_peak(groups, config, threshold, frees, sums, copies_lag)
        if estimate.total <= limit:
            return LimitChoice(threshold, estimate, True)
        if best is None or estimate.total < best.estimate.total:
            best = LimitChoice(threshold, estimate, False)
    return best


def announce_limit(groups: list[dict[str, Any]], config: ZenFlowConfig, threshold: int, frees: bool,
                   accumulate_on: str | None, copies_lag: bool = False) -> None:
    """Say once per run, at its first step, what the limit chose (`threshold`, info), or that nothing fits (a
    warning naming the limit and the smallest peak possible)."""
    sums = accumulate_on if accumulate_on in ("host", *DEVICE_SUM_DTYPES) else "host"
    estimate = estimate_peak(groups, config, threshold, frees, sums, copies_lag)
    limit = config.device_memory_limit_bytes
    if estimate.total <= limit:
        lowered = (f"min_offload_numel lowered from {config.min_offload_numel} to {threshold}"
                   if threshold < config.min_offload_numel else f"min_offload_numel={threshold} kept")
        logger.info("hf_zenflow: device_memory_limit_bytes=%d: %s, estimated peak %d bytes (%s)", limit, lowered,
                    estimate.total, _parts(estimate))
        return
    smallest = choose_min_offload_numel(groups, config, frees, accumulate_on, copies_lag)
    hint = "" if frees else ("; here the gradients stay on the device until the step (free_gradients_in_backward, "
                             "docs/memory.md): freeing them in backward lowers it")
    logger.warning("ZenFlowAdamW: device_memory_limit_bytes=%d cannot be met: the smallest peak possible is an "
                   "estimated %d bytes (%s), with min_offload_numel=%d%s. Training goes on over the limit.", limit,
                   smallest.estimate.total, _parts(smallest.estimate), smallest.min_offload_numel, hint)


def _parts(estimate: PeakEstimate) -> str:
    return (f"weights {estimate.weights / 2**20:.1f} MiB, optimizer state {estimate.state / 2**20:.1f} MiB, "
            f"gradients held until the step {estimate.held_gradients / 2**20:.1f} MiB, gradients in flight "
            f"{estimate.in_flight_gradient / 2**20:.1f} MiB")


__all__ = ["RUNTIME_NODE", "SAME_SPEED", "SUM_PLACES", "LimitChoice", "Node", "Option", "RunSizes",
           "announce_limit", "candidate_thresholds", "choose", "choose_min_offload_numel", "host_room",
           "plan_accumulation"]
