"""The device's estimated peak in a step, from sizes alone (`estimate_peak`): what `device_memory_limit_bytes` is held
to. Without a limit, matrices with fewer than `min_offload_numel` elements are updated whole on the device (dense
AdamW state, their gradient held until `step()`), the rest are split. Under a limit the run's threshold is lowered
until the estimated peak fits (`planner.choose_min_offload_numel`): matrices under `min_offload_numel` are offloaded
too, largest first (all matrices of one size together: the 24 attention matrices of a BERT-sized model are one
step), and the largest threshold that fits is kept, so as few matrices as possible leave the device. When none fits,
the threshold with the smallest estimated peak is kept and a warning names the limit and that peak.

The estimate (`estimate_peak`) is an upper bound of what `DeviceMemoryMeter` counts at its peak: the weights of
every parameter of the param groups, the optimizer's device state (a split matrix's selected columns: fp32 master,
two moments and the gathered gradient, 16 B per element, 14 when the gradient is bf16 or fp16; a whole matrix's or
a 1-D parameter's two fp32 moments and its fp32 master when the parameter is not fp32; device-side window sums),
every gradient held until `step()`, and the largest transient: with the gradients of split matrices freed in their
backward hook, those still in flight to the host (`in_flight.in_flight_count` of the largest: where copies lag
backward, as CUDA's side-stream copies can, the freed gradients whose copy has not read them yet, at most
`in_flight.FREED_IN_FLIGHT`, and the one autograd has just produced; with synchronous copies that one alone); with
bf16 or fp16 gradients, the device update's fp32 copy of the largest matrix's selected columns.
Activations and kernels' temporaries are not in it (on CUDA the meter's `max_memory_allocated` counts them: leave
room for them under the limit). It is decided from shapes, dtypes and settings alone, so the same script chooses
the same threshold; once per run, at its first step, kept in `stats()["min_offload_numel"]` and in checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..settings.config import DEVICE_SUM_DTYPES, ZenFlowConfig, sums_on_device
from .accumulation import SELECTED_BYTES, selected_bytes
from .in_flight import in_flight_count
from .params import is_split
from .selection import num_selected


@dataclass(frozen=True)
class PeakEstimate:
    """The parts of the estimated peak, in bytes (see the module docstring)."""

    weights: int
    state: int
    held_gradients: int
    in_flight_gradient: int
    #: the part of `state` that is the offloaded matrices' selected columns (`planner.plan_accumulation` counts it
    #: itself)
    offloaded_selected: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.state + self.held_gradients + self.in_flight_gradient

    @property
    def beside_window_sums(self) -> int:
        """What the step holds whatever `accumulate_on="auto"` chooses and `planner.plan_accumulation` does not count
        itself (the selected columns' state, and the offloaded gradients that device sums keep): the peak its
        device sums must fit on top of."""
        return self.total - self.offloaded_selected - self.in_flight_gradient


def _local(p: torch.Tensor) -> torch.Tensor:
    return getattr(p, "_local_tensor", p)  # (an FSDP2 DTensor: this rank's shard is what the device holds)


def estimate_peak(groups: list[dict[str, Any]], config: ZenFlowConfig, min_numel: int, frees: bool,
                  accumulate_on: str = "host", copies_lag: bool = False) -> PeakEstimate:
    """The peak the device holds in a step with matrices of at least `min_numel` elements split. `frees`: the
    gradients of offloaded matrices leave the device in their backward hook (`free_gradients_in_backward`);
    `accumulate_on`: where windows are summed ("host", "device" or "device_bf16"); `copies_lag`: the copies to the
    host run beside backward and may lag it (a transport that stages gradients: CUDA)."""
    weights = state = held = scratch = selected = narrow_selected = largest_split = 0
    freed: list[int] = []
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
                scratch = max(scratch, 4 * selected_elements)
                narrow_selected += selected_elements
            largest_split = max(largest_split, nbytes)
            state += columns_state
            offloaded = k < columns or config.full_warm_up_rounds > 0
            selected += columns_state if offloaded else 0
            if offloaded and sums_on_device(accumulate_on):
                state += local.numel() * DEVICE_SUM_DTYPES[accumulate_on].itemsize
            if frees and offloaded and not sums_on_device(accumulate_on):
                freed.append(nbytes)
            else:
                held += nbytes
    scratch = max(scratch, min(4 * narrow_selected, largest_split))
    in_flight = sum(sorted(freed)[-in_flight_count(copies_lag):]) if freed else 0
    return PeakEstimate(weights, state, held, max(in_flight, scratch), selected)


__all__ = ["PeakEstimate", "estimate_peak"]
