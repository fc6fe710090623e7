"""Choosing device columns during training: the scheduled re-selection of every matrix, and matrices that get their
first columns late (first gradient after warm-up, or every gradient so far exactly zero)."""

from __future__ import annotations

import torch

from .schedule import WindowSchedule
from .selection import num_selected, row_scores
from .telemetry import StepTimer
from .windows import HostWindows


def reselect(host: HostWindows, schedule: WindowSchedule, entries: list[tuple[dict, torch.Tensor]],
             grads: list[torch.Tensor]) -> None:
    """Choose new device columns from this step's gradients and migrate state to match.

    The open window is closed first and every host result applied, so the host master is current for all columns
    it owns; then the outgoing device columns are copied into the host state and the incoming ones gathered from it
    (master values, moments, no reset).
    """
    if schedule.window_steps > 0:
        host.close_window(schedule, StepTimer(), sequential=True)
    host.drain_and_apply()
    schedule.force_select = False
    for split in host.splits.values():  # (a resumed run may have a new topk_ratio)
        split.k = num_selected(host.config.topk_ratio, split.columns)
    pairs = [(host.splits[p], g) for (_, p), g in zip(entries, grads) if p in host.splits]
    scores = row_scores([(split, split.matrix(g)) for split, g in pairs if split.offloaded])
    for split, g in pairs:
        split.select(g, scores.get(id(split)), host.attach_host)
    schedule.reselections += 1


def select_waiting(host: HostWindows, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor],
                   norms: list[float]) -> None:
    """Matrices without device columns get them now: seen for the first time after warm-up (their first gradient came
    late), or every gradient of theirs at selection time was zero (`SplitMatrix.select`). Only matrices whose gradient
    is not zero now are tried (`norms`: this step's gradient norms, already on the host)."""
    todo = [(split, g) for i, ((_, p), g) in enumerate(zip(entries, grads))
            if (split := host.splits.get(p)) is not None and split.device is None and split.k > 0 and norms[i] > 0]
    if not todo:
        return
    if any(split.host is not None for split, _ in todo):
        # Sync point: the worker may still be updating these matrices' host master and moments, from which the new
        # device columns are read.
        host.ensure_worker().synchronize()
    for split, g in todo:
        split.select(g, None, host.attach_host)
