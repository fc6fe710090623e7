"""Saying so when ZenFlow offloads nothing, or almost nothing: once per run, at its first step, with the reason and
the setting that changes it (`announce_offload`). Such a run is AdamW on the device (or synchronous offload, with
one-step windows), which is fine for a small model or LoRA adapters but not what a user of ZenFlow expects silently.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ..settings.config import ZenFlowConfig
from .params import is_split
from .schedule import WindowSchedule
from .selection import num_selected


logger = logging.getLogger("hf_zenflow")

#: Below this fraction of the trainable parameters with host columns, a run offloads "almost nothing".
ALMOST_NOTHING = 0.05


def offloaded_fraction(groups: list[dict[str, Any]], config: ZenFlowConfig,
                       min_numel: int | None = None) -> tuple[float, list[str]]:
    """(the fraction of the trainable parameters' elements whose columns live on the host, the reasons the rest do
    not), from shapes and settings alone. `min_numel`: the run's `min_offload_numel` (a device memory limit's
    choice), default the setting."""
    min_numel = config.min_offload_numel if min_numel is None else min_numel
    total = hosted = small = small_count = largest_small = vectors = 0
    all_selected = 0
    for group in groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            total += p.numel()
            if p.ndim < 2:
                vectors += p.numel()
                continue
            if not is_split(p, group, config, min_numel=min_numel):
                if p.numel() < min_numel:
                    small, small_count = small + p.numel(), small_count + 1
                    largest_small = max(largest_small, p.numel())
                continue
            columns = p.shape[0] if group.get("select_rows", False) else math.prod(p.shape[1:])
            if columns == 0:
                continue
            kept = num_selected(config.topk_ratio, columns)
            hosted += p.numel() * (columns - kept) // columns
            all_selected += p.numel() if kept >= columns else 0
    reasons = []
    if small:
        reasons.append(f"{small_count} trainable matri{'x has' if small_count == 1 else 'ces have'} fewer elements "
                       f"than min_offload_numel={min_numel} ({small / total:.0%} of the trainable "
                       f"parameters; the largest has {largest_small}): they are updated whole on the device. "
                       f"min_offload_numel={largest_small} or lower offloads them (0: every matrix)")
    if all_selected:
        reasons.append(f"topk_ratio={config.topk_ratio:g} keeps every column of the other matrices on the device: "
                       "a smaller topk_ratio offloads the rest")
    if vectors:
        reasons.append(f"{vectors / total:.0%} of the trainable parameters are 1-D (biases, norms), always updated "
                       "on the device")
    return (hosted / total if total else 0.0), reasons


def announce_offload(groups: list[dict[str, Any]], config: ZenFlowConfig, schedule: WindowSchedule) -> None:
    """A warning when nothing or almost nothing is offloaded (`ALMOST_NOTHING`), or when ``high_lr_rule="auto"``
    shortened the windows to one step (the host AdamW then runs at every step); `run_start.RunStart` calls it once
    per run, at its first step."""
    fraction, reasons = offloaded_fraction(groups, config, schedule.offload_threshold(config))
    if fraction < ALMOST_NOTHING:
        what = "nothing" if fraction == 0 else f"almost nothing ({fraction:.1%} of the trainable parameters)"
        logger.warning("ZenFlowAdamW offloads %s: the run is AdamW on the device (stats(): selected_fraction, "
                       "bytes_to_host). %s. Fine for small matrices such as LoRA adapters, whose state costs "
                       "little on the device.", what, "; ".join(reasons) or "no trainable matrix")
    elif schedule.high_lr_window == 1 and config.update_interval != 1:
        logger.warning('ZenFlowAdamW: high_lr_rule="auto" shortened the host windows from update_interval=%s to 1 '
                       "step at this learning rate: the host AdamW runs at every step, like synchronous offload. "
                       'host_step="zenflow" keeps the configured windows (with ZenFlow\'s host step, one AdamW step '
                       'per window at the learning rate: BENCHMARKS.md "Quality: high learning rates"), or lower the '
                       "learning rate.", config.update_interval)
