"""What fits: each schedule's device and host memory and step time at one model size (`what_fits`), and the largest
model each schedule trains on a profile's device and host RAM (`max_params`), from the bound model
(`hardware.schedule_model`, `memory.py`).

Example:
    >>> from hf_zenflow.estimate.profiles import PROFILES
    >>> max_params(PROFILES["h100-80gb-pcie5"], "no_offload", 4096)["limited_by"]
    'device memory'
"""

from __future__ import annotations

from typing import Any

from hf_zenflow.estimate.hardware import AUTO_ROWS, auto_accumulation, schedule_model
from hf_zenflow.estimate.memory import preset_layout
from hf_zenflow.estimate.profiles import HardwareProfile
from hf_zenflow.settings.rules import HOST_STATES


#: The schedules `what_fits` and `max_params` compare, each with its host-state rules: ZenFlow under each
#: ``host_state`` preset ("zenflow": the default, "auto"; "zenflow_fp32", "zenflow_lean"), its row the one the
#: planner's ``accumulate_on="auto"`` chooses at that size.
FIT_SCHEDULES: dict[str, tuple[str, dict[str, str] | None]] = {
    "no_offload": ("no_offload", None), "sync_offload": ("sync_offload", None),
    **{"zenflow" if preset == "auto" else f"zenflow_{preset}": ("zenflow", preset_layout(preset))
       for preset in HOST_STATES}}


def fit_row(profile: HardwareProfile, schedule: str, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
            update_interval: float = 4, ranks: int = 1, parallel: str = "ddp",
            gradients_freed_in_backward: bool | None = None, device_step_ms: float | None = None) -> dict[str, Any]:
    """`schedule_model`'s row of one of `FIT_SCHEDULES` at `params`; a ZenFlow row is the one ``accumulate_on="auto"``
    chooses at that size (its ``accumulate_on`` says which), with ``fits`` = fits the device and the host."""
    kind, host_state = FIT_SCHEDULES[schedule]
    rows = schedule_model(profile, params, tokens_per_step, topk_ratio, update_interval, device_step_ms, ranks,
                          parallel, None, gradients_freed_in_backward, host_state)
    key = kind
    choice = None
    if kind == "zenflow":
        choice = auto_accumulation(profile, params, tokens_per_step, topk_ratio, ranks, parallel, rows=rows)["choice"]
        key = AUTO_ROWS[choice]
    row = dict(rows[key], params=float(params), accumulate_on=choice)
    row["fits"] = row["fits_device_memory"] and row["fits_host_memory"]
    row["step_vs_no_offload"] = row["step_ms"] / rows["no_offload"]["step_ms"]
    row["speedup_vs_sync"] = rows["sync_offload"]["step_ms"] / row["step_ms"]
    return row


def what_fits(profile: HardwareProfile, params: float, tokens_per_step: float, topk_ratio: float = 0.1,
              update_interval: float = 4, ranks: int = 1, parallel: str = "ddp",
              gradients_freed_in_backward: bool | None = None,
              device_step_ms: float | None = None) -> dict[str, dict[str, Any]]:
    """`fit_row` of every schedule of `FIT_SCHEDULES` at `params`: device and host GB, whether each fits, the step."""
    return {s: fit_row(profile, s, params, tokens_per_step, topk_ratio, update_interval, ranks, parallel,
                       gradients_freed_in_backward, device_step_ms) for s in FIT_SCHEDULES}


#: `max_params` searches between these sizes, to this relative precision.
MIN_PARAMS, MAX_PARAMS, PARAMS_PRECISION = 1e6, 1e15, 1e-4
#: How ``limited_by`` names a place a window is summed.
PLACE_WORDS = {"host": "host sums", "device": "fp32 device sums", "device_bf16": "bf16 device sums"}


def max_params(profile: HardwareProfile, schedule: str, tokens_per_step: float, topk_ratio: float = 0.1,
               update_interval: float = 4, ranks: int = 1, parallel: str = "ddp",
               gradients_freed_in_backward: bool | None = None) -> dict[str, Any] | None:
    """The largest model `schedule` (one of `FIT_SCHEDULES`) trains on `profile` with `ranks` ranks on its node: its
    `fit_row` there (its step time and memory), with ``limited_by`` ("device memory" or "host memory": what a model
    `PARAMS_PRECISION` larger would overflow; for ZenFlow, where the planner moves the sums at that size, what each
    place overflows, e.g. "device memory with bf16 device sums, host memory with host sums"). None when not even
    `MIN_PARAMS` fits.

    Memory grows with the size everywhere but at ``accumulate_on="auto"``'s switch from device sums to host sums
    (less device memory, more host memory), so the sizes that fit are one interval from 0: a bisection finds its end.
    """
    def row(n: float) -> dict[str, Any]:
        return fit_row(profile, schedule, n, tokens_per_step, topk_ratio, update_interval, ranks, parallel,
                       gradients_freed_in_backward)

    if not row(MIN_PARAMS)["fits"]:
        return None
    lo, hi = MIN_PARAMS, MIN_PARAMS
    while row(hi)["fits"]:
        lo, hi = hi, hi * 2
        if hi > MAX_PARAMS:
            return dict(row(lo), limited_by="the search's end")
    while hi / lo - 1 > PARAMS_PRECISION:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if row(mid)["fits"] else (lo, mid)
    largest, above = row(lo), row(hi)
    limited_by = "device memory" if not above["fits_device_memory"] else "host memory"
    kept = largest["accumulate_on"]
    if kept is not None and above["accumulate_on"] != kept:
        # the planner left `kept` at this size: what it overflows there as the planner counts it (the device with
        # the activations), then what the place it moved to overflows
        plan = auto_accumulation(profile, hi, tokens_per_step, topk_ratio, ranks, parallel,
                                 gradients_freed_in_backward, update_interval, host_state=FIT_SCHEDULES[schedule][1])
        left = next(o for o in plan["options"] if o.accumulate_on == kept)
        first = "device memory (activations counted)" if left.device_over > 0 else "host memory"
        limited_by = f"{first} with {PLACE_WORDS[kept]}, {limited_by} with {PLACE_WORDS[above['accumulate_on']]}"
    return dict(largest, limited_by=limited_by)


__all__ = ["FIT_SCHEDULES", "PARAMS_PRECISION", "PLACE_WORDS", "fit_row", "max_params", "what_fits"]
