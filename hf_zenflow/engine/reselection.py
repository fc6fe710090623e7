"""Choosing device columns during training: the scheduled re-selection of every matrix, and matrices that get their
first columns late (first gradient after warm-up, or every gradient so far exactly zero). With the host state
shared by several ranks, one all-reduce of the scores and one all-gather of the incoming columns' state per
selection, for all matrices at once (`distributed/sharding.py`); under FSDP2 the all-reduce of the scores only
(`distributed/fsdp.py`)."""

from __future__ import annotations

import torch

from ..transport.cpu_device import kernels
from .schedule import WindowSchedule
from .selection import indices_on_host, num_selected, top_columns
from .split_matrix import SplitMatrix
from .telemetry import StepTimer
from .windows import HostWindows


def row_scores(items: list[tuple[SplitMatrix, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Selection scores of the matrices whose selectable units are contiguous rows (column-major weights,
    `select_rows`), on a CPU device: one threaded kernel pass over all of them instead of a chunked torch sweep
    per matrix. Others are left to `column_scores` in `select_columns`."""
    rows = [(split, m) for split, m in items if split.axis == 0 and kernels.supports(m) and m.ndim == 2]
    if not rows or kernels.library() is None:
        return {}
    return {id(split): s for (split, _), s in zip(rows, kernels.row_scores([m for _, m in rows]))}


def reselect(host: HostWindows, schedule: WindowSchedule, entries: list[tuple[dict, torch.Tensor]],
             grads: list[torch.Tensor]) -> set[torch.Tensor]:
    """Choose new device columns from this step's gradients and migrate state to match.

    The open window is closed first and every host result applied, so the host master is current for all columns
    it owns; then the outgoing device columns are copied into the host state and the incoming ones gathered from it
    (master values, moments, no reset). Returns the matrices whose gradients were freed in backward: their
    selected columns are gathered from the host copies (`select_columns`).
    """
    if schedule.window_steps > 0:
        host.close_window(schedule, StepTimer(), sequential=True)
    host.drain_and_apply()
    schedule.force_select = False
    for split in host.splits.values():  # (a resumed run may have a new topk_ratio)
        split.k = num_selected(host.config.topk_ratio, split.columns)
    pairs = [(host.splits[p], g) for (_, p), g in zip(entries, grads) if p in host.splits]
    gathered = select_columns(host, pairs)
    schedule.reselections += 1
    return gathered


def select_waiting(host: HostWindows, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor],
                   norms: list[float]) -> None:
    """Matrices without device columns get them now: seen for the first time after warm-up (their first gradient came
    late), or every gradient of theirs at selection time was zero (`select_columns`). Only matrices whose gradient
    is not zero now are tried (`norms`: this step's gradient norms, already on the host)."""
    todo = [(split, g) for i, ((_, p), g) in enumerate(zip(entries, grads))
            if (split := host.splits.get(p)) is not None and split.device is None and split.k > 0 and norms[i] > 0]
    if not todo:
        return
    if any(split.host is not None for split, _ in todo):
        # Sync point: the worker may still be updating these matrices' host master and moments, from which the new
        # device columns are read.
        host.ensure_worker().synchronize()
    select_columns(host, todo)


def select_columns(host: HostWindows, pairs: list[tuple[SplitMatrix, torch.Tensor]]) -> set[torch.Tensor]:
    """Choose each matrix's device columns from its gradient and migrate the state to match: the outgoing device
    columns' master values and moments go to the host state, the incoming columns' come from it (no reset). The
    caller has drained the host worker. A gradient freed in backward brings its scores from the hook, and its
    selected columns are then gathered from its host copy (returned: those matrices).

    Sync point (selection only): the scores are read on the host (an all-zero gradient ranks nothing, e.g. LoRA's
    lora_A while lora_B is still zero: the matrix keeps its columns, or waits for a later step), and the state
    moves with blocking copies.
    """
    ranks = host.shards
    freed = host.backward.freed
    todo = [(split, g) for split, g in pairs if split.release_columns(host.attach_host)]
    scored = [(split, g) for split, g in todo if split.offloaded]
    # one threaded kernel pass for the contiguous row-scored matrices of a CPU device (one rank: whole matrices)
    fast = row_scores([(split, split.matrix(g)) for split, g in scored if split.param not in freed]) \
        if ranks.ranks == 1 else {}
    scores = [freed[split.param].scores if split.param in freed else fast[id(split)] if id(split) in fast
              else split.local_scores(g) for split, g in scored]
    # Collective: the ranks' partial sums (their shares of the rows under DDP, their FSDP2 shards) summed, so that
    # every rank selects the same columns
    host.reduce_group.all_reduce_sum(scores)
    # (Sync point, selection only: whether each matrix's scores are not all zero, read once for all matrices)
    nonzero = torch.stack([s.any().to(scores[0].device) for s in scores]).tolist() if scores else []
    ranked = [(split, s) for (split, _), s, ok in zip(scored, scores, nonzero) if ok]
    chosen = [(split, top_columns(s, split.k)) for split, s in ranked]
    if ranked:
        # Sync point (selection only): the chosen columns' share of each matrix's squared gradient norm, read on the
        # host once for all matrices (`stats()["selected_grad_share"]`)
        shares = torch.stack([s.index_select(0, index).sum() / s.sum() for (_, s), (_, index) in zip(ranked, chosen)])
        for (split, _), share in zip(ranked, shares.tolist()):
            split.selected_share = share
    chosen += [(split, torch.arange(split.k, device=split.param.device)) for split, _ in todo if not split.offloaded]
    on_host = indices_on_host([index for _, index in chosen])  # (Sync point, selection only: one copy per device)
    hosted = [(split, index) for (split, _), index in zip(chosen, on_host) if split.host is not None]
    parts = [(split.share, t.index_select(split.axis, index).float()) for split, index in hosted
             for t in (split.host.master, split.host.exp_avg, split.host.exp_avg_sq)]
    # Collective: on the parameters' device (the pieces are host state, which NCCL refuses); the full columns land
    # there, where `install_columns` wants them
    device = hosted[0][0].param.device if hosted else torch.device("cpu")
    whole = ranks.gather(parts, "device-column all-gather", device)
    cols = {id(split): whole[3 * i:3 * i + 3] for i, (split, _) in enumerate(hosted)}
    for (split, index), index_on_host in zip(chosen, on_host):
        split.install_columns(index, cols.get(id(split)), index_on_host)
    # the freed gradients' selected columns (new or kept) come back from their host copies for this step's update
    regathered: set[torch.Tensor] = set()
    for split, _ in pairs:
        record = freed.get(split.param)
        if record is not None and split.device is not None:
            record.landed.wait()  # Sync point (re-selection only): the freed gradient has landed on the host
            record.gather_selected(split)
            regathered.add(split.param)
    return regathered
