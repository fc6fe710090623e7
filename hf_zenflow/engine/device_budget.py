"""`device_memory_limit_bytes`: which matrices stay whole on the device so that the step's peak fits the limit.

Without a limit, matrices with fewer than `min_offload_numel` elements are updated whole on the device (dense
AdamW state, their gradient held until `step()`), the rest are split. Under a limit the run's threshold is lowered
until the estimated peak fits: matrices under `min_offload_numel` are offloaded too, largest first (all matrices of
one size together: the 24 attention matrices of a BERT-sized model are one step), and the largest threshold that
fits is kept, so as few matrices as possible leave the device. When none fits, the threshold with the smallest
estimated peak is kept and a warning names the limit and that peak.

The estimate (`estimate_peak`) is an upper bound of what `DeviceMemoryMeter` counts at its peak: the weights of
every parameter of the param groups, the optimizer's device state (a split matrix's selected columns: fp32 master,
two moments and the gathered gradient, 16 B per element, 14 when the gradient is bf16 or fp16; a whole matrix's or
a 1-D parameter's two fp32 moments and its fp32 master when the parameter is not fp32; device-side window sums),
every gradient held until `step()`, and the largest transient: with the gradients of split matrices freed in their
backward hook, the largest of them in flight; with bf16 or fp16 gradients, the device update's fp32 copy of the
largest matrix's selected columns.
Activations and kernels' temporaries are not in it (on CUDA the meter's `max_memory_allocated` counts them: leave
room for them under the limit). It is decided from shapes, dtypes and settings alone, so the same script chooses
the same threshold; once per run, at its first step, kept in `stats()["min_offload_numel"]` and in checkpoints.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..settings.config import DEVICE_SUM_DTYPES, ZenFlowConfig, sums_on_device
from .accumulation import SELECTED_BYTES, selected_bytes
from .host import link_grad_dtype
from .params import is_split
from .selection import num_selected


logger = logging.getLogger("hf_zenflow")


@dataclass(frozen=True)
class PeakEstimate:
    """The parts of the estimated peak, in bytes (see the module docstring)."""

    weights: int
    state: int
    held_gradients: int
    in_flight_gradient: int
    #: the part of `state` that is the offloaded matrices' selected columns (`accumulation.decide` counts it itself)
    offloaded_selected: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.state + self.held_gradients + self.in_flight_gradient

    @property
    def beside_window_sums(self) -> int:
        """What the step holds whatever `accumulate_on="auto"` chooses and `accumulation.decide` does not count
        itself (the selected columns' state, and the offloaded gradients that device sums keep): the peak its
        device sums must fit on top of."""
        return self.total - self.offloaded_selected - self.in_flight_gradient


def _local(p: torch.Tensor) -> torch.Tensor:
    return getattr(p, "_local_tensor", p)  # (an FSDP2 DTensor: this rank's shard is what the device holds)


def estimate_peak(groups: list[dict[str, Any]], config: ZenFlowConfig, min_numel: int, frees: bool,
                  accumulate_on: str = "host") -> PeakEstimate:
    """The peak the device holds in a step with matrices of at least `min_numel` elements split. `frees`: the
    gradients of offloaded matrices leave the device in their backward hook (`free_gradients_in_backward`);
    `accumulate_on`: where windows are summed ("host", "device" or "device_bf16")."""
    weights = state = held = in_flight = selected = narrow_selected = largest_split = 0
    seen: set[int] = set()
    for group in groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = _local(p)
            nbytes = local.numel() * local.element_size()
            weights += nbytes
            if not p.requires_grad:
                continue
            if not is_split(local, group, config, p.shape, min_numel):
                state += local.numel() * (8 if p.dtype == torch.float32 else 12)
                held += nbytes
                continue
            columns = p.shape[0] if group.get("select_rows", False) else math.prod(p.shape[1:])
            k = num_selected(config.topk_ratio, columns)
            selected_elements = math.ceil(local.numel() * k / columns)
            columns_state = selected_bytes(p.dtype) * selected_elements
            if selected_bytes(p.dtype) < SELECTED_BYTES:
                # the device update widens bf16/fp16 gathered gradients into an fp32 scratch of at most one
                # matrix's selected columns, or of the largest split matrix's gradient bytes
                # (`device_step.device_update`): transient, like a gradient in flight
                in_flight = max(in_flight, 4 * selected_elements)
                narrow_selected += selected_elements
            largest_split = max(largest_split, nbytes)
            state += columns_state
            offloaded = k < columns or config.full_warm_up_rounds > 0
            selected += columns_state if offloaded else 0
            if offloaded and sums_on_device(accumulate_on):
                state += local.numel() * DEVICE_SUM_DTYPES[accumulate_on].itemsize
            if frees and offloaded and not sums_on_device(accumulate_on) \
                    and link_grad_dtype(p.dtype, config.host_grad_dtype) == p.dtype:
                in_flight = max(in_flight, nbytes)
            else:
                held += nbytes
    in_flight = max(in_flight, min(4 * narrow_selected, largest_split))
    return PeakEstimate(weights, state, held, in_flight, selected)


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
                             accumulate_on: str | None = None) -> LimitChoice:
    """The largest threshold whose estimated peak fits `config.device_memory_limit_bytes` (set), else the one with
    the smallest estimated peak. `accumulate_on`: where windows are summed when known; "auto" before its choice
    counts host sums (it puts the sums on the device only when they fit on top: `accumulation.decide`)."""
    limit = config.device_memory_limit_bytes
    sums = accumulate_on if accumulate_on in ("host", *DEVICE_SUM_DTYPES) else "host"
    best: LimitChoice | None = None
    for threshold in candidate_thresholds(groups, config):
        estimate = estimate_peak(groups, config, threshold, frees, sums)
        if estimate.total <= limit:
            return LimitChoice(threshold, estimate, True)
        if best is None or estimate.total < best.estimate.total:
            best = LimitChoice(threshold, estimate, False)
    return best


def announce_limit(groups: list[dict[str, Any]], config: ZenFlowConfig, threshold: int, frees: bool,
                   accumulate_on: str | None) -> None:
    """Say once per run, at its first step, what the limit chose (`threshold`, info), or that nothing fits (a
    warning naming the limit and the smallest peak possible)."""
    sums = accumulate_on if accumulate_on in ("host", *DEVICE_SUM_DTYPES) else "host"
    estimate = estimate_peak(groups, config, threshold, frees, sums)
    limit = config.device_memory_limit_bytes
    if estimate.total <= limit:
        lowered = (f"min_offload_numel lowered from {config.min_offload_numel} to {threshold}"
                   if threshold < config.min_offload_numel else f"min_offload_numel={threshold} kept")
        logger.info("hf_zenflow: device_memory_limit_bytes=%d: %s, estimated peak %d bytes (%s)", limit, lowered,
                    estimate.total, _parts(estimate))
        return
    smallest = choose_min_offload_numel(groups, config, frees, accumulate_on)
    hint = "" if frees else ("; here the gradients stay on the device until the step (free_gradients_in_backward, "
                             "docs/memory.md): freeing them in backward lowers it")
    logger.warning("ZenFlowAdamW: device_memory_limit_bytes=%d cannot be met: the smallest peak possible is an "
                   "estimated %d bytes (%s), with min_offload_numel=%d%s. Training goes on over the limit.", limit,
                   smallest.estimate.total, _parts(smallest.estimate), smallest.min_offload_numel, hint)


def _parts(estimate: PeakEstimate) -> str:
    return (f"weights {estimate.weights / 2**20:.1f} MiB, optimizer state {estimate.state / 2**20:.1f} MiB, "
            f"gradients held until the step {estimate.held_gradients / 2**20:.1f} MiB, largest gradient in flight "
            f"{estimate.in_flight_gradient / 2**20:.1f} MiB")


__all__ = ["LimitChoice", "PeakEstimate", "announce_limit", "candidate_thresholds", "choose_min_offload_numel",
           "estimate_peak"]
