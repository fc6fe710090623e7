"""`ZenFlowAdamW`: AdamW with ZenFlow's importance-aware device/host split.

Each optimizer step:

1. one pass over the gradients gives per-tensor norms: the non-finite check, the clip norm and Zen-auto's masses;
2. **device path** (`device_step.py`): the top-k input columns of every matrix (by gradient norm) and every 1-D
   parameter get a fused AdamW update on the device, on fp32 master values and moments;
3. **host path** (`host.py`): the whole matrix gradient is handed to the host worker, which adds it to a window
   accumulator; every `update_interval` steps the window closes and the host AdamW updates the matrix on the window's
   mean gradient, with the learning rate in force when the window closed;
4. the host result is written back into the device weights at the next window boundary (``overlap_step=True``: the
   host step runs while the device trains on) or at once (``overlap_step=False``); the columns on the device keep
   their device values.

The selection is refreshed on schedule; the master values and moments of columns that enter or leave the device
set migrate with them, so with ``update_interval=1`` the split is invisible (AdamW is elementwise).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from . import _native, checkpoint
from ._base import (
    GradNormCache,
    check_hyperparameters,
    clip_coefficient,
    fused_adamw_,
    grad_norms,
    l2_norm,
)
from .config import ZenFlowConfig
from .device_step import DenseDeviceState, DeviceColumns, gather_columns, scatter_columns
from .distributed_check import warn_if_replicated
from .host import GradSlot, HostAdamWorker, HostMatrix, accumulate_into, host_adamw_window, wait_for_closed_workers
from .schedule import StepKind, WindowSchedule, host_lr_scale
from .selection import column_scores, num_selected, selection_axis, top_columns
from .split_matrix import SplitMatrix
from .telemetry import StepTimer, ZenFlowStats
from .transport import Landed, Transport, transport_for


logger = logging.getLogger(__name__)

_LIVE_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # the host threads are daemons; this just lets in-flight jobs end cleanly
    for opt in list(_LIVE_OPTIMIZERS):
        opt.close()


@dataclass
class HandOff:
    """One step's gradients on their way to the host worker: the slot they hold, the (matrix, gradient) pairs,
    what the host job reads and what it waits for."""

    grant: GradSlot
    work: list[tuple[SplitMatrix, torch.Tensor]]
    sources: list[tuple[HostMatrix, torch.Tensor]]
    landed: Landed
    done: bool = False  # submitted or abandoned: the slot is accounted for


def _by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def _to(value: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """A number as it is; a tensor on `device` (a non-blocking copy when it lives elsewhere)."""
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW whose important columns are updated on the device every step and the rest by a host AdamW every
    `update_interval` steps, overlapped with training.

    Args:
        params: parameters or param groups (per-group ``lr``, ``betas``, ``eps``, ``weight_decay``).
        lr, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay, as `torch.optim.AdamW`).
        config: a `ZenFlowConfig`; keyword arguments named like its fields override it.
        host_executor: ``"thread"`` (default) runs the host work on a background thread; ``"inline"`` runs the same
            jobs in the calling thread, in the same order (the sequential reference of the overlapped schedule).

    Matrices (parameters with ``ndim >= 2``, viewed as ``[out, in]``) are split by input column, whether stored
    row-major or column-major (`column_major_`, where each input column is contiguous); 1-D parameters and other
    layouts are updated entirely on the device. A param group with ``select_rows=True`` splits its matrices by row
    instead: for an embedding table ``[vocab, hidden]`` the input channels are the rows (tokens), contiguous in
    memory (``hf-zenflow compare`` uses it for the word embeddings on a CPU device). `step()` takes ownership of the
    gradients of split matrices (it sets their ``.grad`` to None) so that the host worker can read them after
    `step()` returns.

    Example:
        >>> import torch
        >>> from hf_zenflow import ZenFlowAdamW
        >>> model = torch.nn.Linear(64, 64)
        >>> opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1, update_interval=4)
        >>> model(torch.randn(8, 64)).square().mean().backward()
        >>> grad_norm = opt.clip_grad_norm_(1.0)
        >>> opt.step(); opt.zero_grad()
        >>> opt.flush()  # end of training: every gradient seen is now in the weights
        >>> opt.close()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        config: ZenFlowConfig | None = None,
        host_executor: str = "thread",
        **config_overrides: Any,
    ) -> None:
        check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        config = config if config is not None else ZenFlowConfig()
        if config_overrides:
            known = {f.name for f in dataclasses.fields(ZenFlowConfig)}
            unknown = sorted(set(config_overrides) - known)
            if unknown:
                raise ValueError(f"ZenFlowAdamW got unknown argument(s) {unknown}: ZenFlowConfig fields are "
                                 f"{sorted(known)}.")
            config = dataclasses.replace(config, **config_overrides)
        if host_executor not in ("thread", "inline"):
            raise ValueError(f'ZenFlowAdamW host_executor={host_executor!r} is invalid: allowed is "thread" or '
                             '"inline".')
        self.config = config
        self.host_executor = host_executor
        self._worker: HostAdamWorker | None = None
        self._split: dict[torch.Tensor, SplitMatrix] = {}
        self._dense: dict[torch.Tensor, DenseDeviceState] = {}
        self._schedule: WindowSchedule | None = None
        self._pending = None  # Future of the host step whose result awaits write-back (overlap mode)
        self._writeback_pending = False
        self._unapplied_steps: list[int] = []  # sizes of windows submitted but not yet written back
        self._norm_cache = GradNormCache()
        self._transports: dict[str, Transport] = {}  # by device type (see `transport.py`)
        self._stats = ZenFlowStats()
        # (version counter, storage) of every parameter with an fp32 master of its own, after the optimizer's last
        # write: a difference means the weights were changed from outside (see `_pick_up_outside_changes`)
        self._weight_marks: dict[torch.Tensor, tuple[int, int]] = {}
        self._told_outside_change = False
        self._param_names: dict[torch.Tensor, str] = {
            p: name for g in self.param_groups for name, p in zip(g.get("param_names", ()), g["params"])
        }
        _LIVE_OPTIMIZERS.add(self)

    # ------------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group.get("select_rows", False), bool):
            raise ValueError(f"ZenFlowAdamW param group select_rows={param_group['select_rows']!r} is invalid: "
                             "allowed are True and False.")
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in param_group:
                check_hyperparameters(
                    param_group.get("lr", self.defaults["lr"]), param_group.get("betas", self.defaults["betas"]),
                    param_group.get("eps", self.defaults["eps"]),
                    param_group.get("weight_decay", self.defaults["weight_decay"]),
                )
                break
        super().add_param_group(param_group)

    def set_steps_per_epoch(self, steps: int) -> None:
        """Epoch length in optimizer steps, for ``select_strategy="epoch"`` or ``"auto"``."""
        self.config = dataclasses.replace(self.config, steps_per_epoch=int(steps))
        if self._schedule is not None:
            self._schedule.select_period = self.config.select_period()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm of ALL gradients (what `torch.nn.utils.clip_grad_norm_` returns) and, when it exceeds
        `max_norm`, the same scale applied to both the device and the host path inside the next `step()`.

        The gradients themselves are not rewritten: the coefficient is folded into the gather of the selected
        columns and into the host accumulation, which read the gradient anyway.
        """
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norms, total = grad_norms(grads, norm_type)
        coef = clip_coefficient(total, float(max_norm)) if max_norm != float("inf") else None
        if norm_type == 2.0:
            self._norm_cache.store(grads, norms, total, coef)
        else:
            self._norm_cache.store(grads, [], None, coef)
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        worker = self._ensure_worker()
        worker.check()
        worker.hold()
        try:
            return self._step(loss)
        finally:
            # The host jobs this step submitted (accumulation, the window's host AdamW) start now, overlapping the
            # caller's next forward/backward.
            worker.release()

    def _step(self, loss: float | None) -> float | None:
        timer = StepTimer()
        entries = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not entries:
            return loss
        for _, p in entries:
            if p.grad.is_sparse:
                raise RuntimeError("ZenFlowAdamW does not support sparse gradients")
        grads = [p.grad for _, p in entries]
        cached_norms, cached_total, clip = self._norm_cache.take(grads)
        schedule = self._ensure_schedule()
        self._pick_up_outside_changes()
        self._ensure_state(entries)

        # ---- 1. one read of every gradient ------------------------------------------------------------------------
        kind = schedule.kind()
        warm_up, selecting = kind is StepKind.WARM_UP, kind is StepKind.SELECT
        gather_now = kind is StepKind.ORDINARY
        # matrices still waiting for their first columns (`_select_new_matrices`): is their gradient non-zero?
        waiting = [i for i, (_, p) in enumerate(entries)
                   if gather_now and (split := self._split.get(p)) is not None and split.device is None
                   and split.k > 0]
        gathered: set[torch.Tensor] = set()
        with timer.phase("norms"):
            if cached_norms:
                norms = cached_norms
                if gather_now:
                    # the selected columns are needed before the sync either way: Zen-auto votes on their mass
                    self._gather_selected(entries, grads, gathered)
            else:
                norms = self._norms_and_gather(entries, grads, gather_now, gathered)
                first = norms[0].device
                total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]))
            total = cached_total if cached_norms else total
            auto_split = [
                (i, self._split[p]) for i, (_, p) in enumerate(entries) if p in gathered and self._split[p].offloaded
            ] if self.config.is_auto_interval else []
            critical = [split.device.grad.square().sum() for _, split in auto_split]
            probe = [total, total if clip is None else clip] + [norms[i].square() for i, _ in auto_split] + critical
            probe += [norms[i] for i in waiting]

        # ---- 2. an ordinary step launches its device work before it waits -------------------------------------
        # The fused AdamW takes the non-finite flag as a device tensor and changes nothing when it is set, so the
        # update need not wait for the check: the device computes while the host waits below. (Warm-up, selection
        # and matrices waiting for columns decide on host numbers first: they take the sync-first path.)
        early = schedule.launches_before_sync(waiting_for_columns=bool(waiting))
        started: HandOff | None = None
        try:
            rewritten = False
            if early:
                bad = ~torch.isfinite(total) if clip is None else ~(torch.isfinite(total) & torch.isfinite(clip))
                rewritten = schedule.boundary_writes_back(self.config.overlap_step, self._writeback_pending)
                with timer.phase("device_update"):
                    self._device_update(entries, grads, clip, gathered, rewritten=rewritten, found_inf=bad.float())
                with timer.phase("handoff"):
                    started = self._start_hand_off(entries, grads)

            # ---- 3. the one device->host sync of the step ---------------------------------------------------------
            with timer.phase("norms"):
                # Sync point, the only one of an ordinary step: the caller waits for the backward pass (and the norms)
                # to finish and reads a few scalars: whether the step is skipped, Zen-auto's masses, the clip
                # coefficient for the host accumulation, which waiting matrices have a gradient.
                values = torch.stack([v.float().to(probe[0].device) for v in probe]).tolist()
            coef = values[1] if clip is not None else None
            waiting_norms = [0.0] * len(entries)
            for i, value in zip(waiting, values[len(values) - len(waiting):]):
                waiting_norms[i] = value
            if not math.isfinite(values[0]) or (coef is not None and not math.isfinite(coef)):
                if started is not None:
                    self._abandon_hand_off(started)
                self._stats.skipped_steps += 1
                self._stats.finish_step(timer, skipped=True)
                return loss
            if coef == 1.0:
                coef = None  # multiplying by exactly 1 changes nothing; skip the pass

            if warm_up:
                self._warm_up_step(entries, grads, coef, timer)
            else:
                if not early:
                    with timer.phase("select"):
                        if selecting:
                            self._reselect(entries, grads)
                        else:
                            self._select_new_matrices(entries, grads, waiting_norms)
                    rewritten = schedule.boundary_writes_back(self.config.overlap_step, self._writeback_pending)
                    with timer.phase("device_update"):
                        self._device_update(entries, grads, coef, gathered, rewritten=rewritten)
                if rewritten and self.config.overlap_step:
                    # The previous window's result goes into the weights before this step's gradients are handed to
                    # the worker: the write-back does not depend on them, and this way its scatter does not compete
                    # with the worker's accumulation for cores and memory bandwidth (`_close_window` then finds no
                    # write-back pending).
                    self._apply_previous_window(timer)
                with timer.phase("handoff"):
                    if started is not None:
                        self._finish_hand_off(started, coef)
                    else:
                        self._hand_off(entries, grads, coef)
                schedule.window_steps += 1
                votes: list[bool] = []
                n = len(auto_split)
                for j, (_, split) in enumerate(auto_split):
                    votes.append(split.auto.update(values[2 + n + j], values[2 + j], split.k, split.columns))
                if schedule.window_closes(votes):
                    self._close_window(timer, sequential=not self.config.overlap_step)
        except BaseException:
            # an interrupt (Ctrl-C) or a failure between taking a hand-off slot and submitting its job must not leak
            # the slot: the next step would wait for it forever
            if started is not None and not started.done:
                self._abandon_hand_off(started)
            raise
        schedule.steps += 1
        self._mark_weights()
        self._stats.finish_step(timer, staleness=sum(self._unapplied_steps) + schedule.window_steps)
        return loss

    def synchronize(self) -> None:
        """Wait until the host worker is idle and re-raise its failure, if any. Does not change the schedule: a
        host result still waiting for its window boundary stays pending (and is part of `state_dict()`)."""
        if self._worker is not None:
            self._worker.synchronize()
        else:
            wait_for_closed_workers()  # a worker closed without waiting (Ctrl-C) may still run its last job

    @torch.no_grad()
    def flush(self) -> None:
        """Close the open window and write every host result into the weights now, so that the model reflects
        every gradient seen. Call it at the end of training; mid-training it shortens the current window."""
        if self._schedule is None:
            return
        self._pick_up_outside_changes()
        if self._schedule.window_steps > 0:
            self._close_window(StepTimer(), sequential=True)
        self._drain_and_apply()
        self._mark_weights()

    def train(self) -> None:
        """HF calls this before every training step: only surface a worker failure. (Waiting here would serialise
        the host step with every training step.)"""
        if self._worker is not None:
            self._worker.check()

    def eval(self) -> None:
        """HF calls this before evaluation: wait for the host worker."""
        self.synchronize()

    def close(self) -> None:
        """Stop the host worker thread (a later `step()` starts a new one)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def __del__(self) -> None:  # noqa: D105
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    def stats(self) -> dict[str, float]:
        """Telemetry of the last step (see `telemetry.ZenFlowStats`)."""
        split = [s for s in self._split.values()]
        total = sum(s.param.numel() for s in split)
        on_device = sum(s.param.numel() * (s.k / s.columns) for s in split if s.device is not None)
        schedule = self._schedule
        host_bytes = sum(s.host.nbytes() for s in split if s.host is not None)
        device_bytes = sum(s.device.nbytes() for s in split if s.device is not None) + sum(
            d.nbytes() for d in self._dense.values()
        ) + sum(s.window_sum.numel() * 4 for s in split if s.window_sum is not None)
        worker_ms = self._worker.last_job_ms if self._worker is not None else {}
        return self._stats.as_dict(
            selected_fraction=(on_device / total) if total else 1.0,
            # the last closed window; before the first one, the configured interval (auto: the open window so far)
            update_interval=float(schedule.last_interval if schedule and schedule.last_interval else (
                schedule.window_steps if self.config.is_auto_interval and schedule else
                (0 if self.config.is_auto_interval else self.config.update_interval))),
            host_threads=self.config.resolved_cpu_threads,
            steps=schedule.steps if schedule else 0,
            windows=schedule.windows if schedule else 0,
            reselections=schedule.reselections if schedule else 0,
            host_step_ms=worker_ms.get("host_adamw", 0.0),
            accumulate_ms=worker_ms.get("accumulate", 0.0),
            host_state_bytes=host_bytes,
            # per element of the matrices with host state: 16 B of state plus the link buffers
            host_bytes_per_param=host_bytes / hosted if (hosted := sum(
                s.param.numel() for s in split if s.host is not None)) else 0.0,
            pinned_host_bytes=sum(getattr(getattr(t, "arena", None), "nbytes", 0) for t in self._transports.values()
                                  if getattr(getattr(t, "arena", None), "pin", False)),
            device_state_bytes=device_bytes,
        )

    @torch.no_grad()
    def sync_from_weights(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Re-read the fp32 master values from the weights, for `params` (default: every parameter).

        Changes made through the parameters themselves (``model.load_state_dict``, ``param.copy_``, the Trainer's
        ``load_best_model_at_end``, a storage swap) are picked up automatically at the next `step()`, `flush()` or
        `state_dict()`; call this after writing through ``param.data``, which torch does not track. The moments are
        kept (as `torch.optim.AdamW` keeps them when weights are loaded); what was computed from the old weights and
        is not in them yet (a pending host result, the open window's gradient sum) is dropped for these parameters.
        """
        self._reread_masters(list(self._split) + list(self._dense) if params is None else list(params))
        self._mark_weights()

    def _pick_up_outside_changes(self) -> None:
        changed = [p for p, mark in self._weight_marks.items() if (p._version, p.data_ptr()) != mark]
        if not changed:
            return
        if not self._told_outside_change:
            self._told_outside_change = True
            logger.warning(
                "ZenFlowAdamW: %d parameter(s) were changed outside the optimizer (model.load_state_dict, "
                "load_best_model_at_end, an in-place edit...): their fp32 masters are re-read from the weights; "
                "host results and window gradients still pending for them are dropped.", len(changed),
            )
        self._reread_masters(changed)
        self._mark_weights()

    def _reread_masters(self, params: list[torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.synchronize()  # Sync point: the worker must not be writing the host masters we replace
        for p in params:
            dense = self._dense.get(p)
            if dense is not None:
                if dense.master is not None:
                    dense.master.copy_(p.detach())
                continue
            split = self._split.get(p)
            if split is None:
                continue
            current = split.matrix(p.detach())
            if split.host is not None:
                host = split.host
                host.master.copy_(current)
                if host.writeback_free is not None:
                    host.writeback_free.synchronize()  # type: ignore[attr-defined]  # a write-back copy still reads it
                host.writeback.copy_(current)  # a pending write-back now rewrites these very values
                host.writeback_fresh = False
                # the open window's gradients were taken at the old weights: dropped, as the pending result is
                host.accum_count, split.window_count = 0, 0
            if split.device is not None:
                cols = split.device
                cols.master.copy_(current.index_select(cols.axis, cols.index))

    def _mark_weights(self) -> None:
        """Remember the version and storage of every parameter with a master of its own, after our own writes."""
        marks = {p: (p._version, p.data_ptr()) for p in self._split}
        marks.update({p: (p._version, p.data_ptr()) for p, d in self._dense.items() if d.master is not None})
        self._weight_marks = marks

    def master_weight(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master value of `param` (host columns from the host master, device columns from the device),
        on the host. Call `synchronize()` first in overlap mode."""
        self._pick_up_outside_changes()
        if param in self._dense:
            return self._dense[param].master_of(param).detach().float().cpu().clone()
        split = self._split.get(param)
        if split is None:
            return param.detach().float().cpu().clone()
        full = split.full_state()[0]
        return split.unmatrix(full)

    # ------------------------------------------------------------------------------------------------------------
    # Step internals
    # ------------------------------------------------------------------------------------------------------------
    def _ensure_worker(self) -> HostAdamWorker:
        if self._worker is None:
            warn_if_replicated()  # several processes each keep a full host copy (once per process)
            self._worker = HostAdamWorker(
                self.config.resolved_cpu_threads,
                background=self.config.overlap_step and self.host_executor == "thread",
            )
        return self._worker

    def _ensure_schedule(self) -> WindowSchedule:
        if self._schedule is None:
            cfg = self.config
            self._schedule = WindowSchedule(
                warm_up=cfg.full_warm_up_rounds,
                update_interval=None if cfg.is_auto_interval else int(cfg.update_interval),
                auto_ratio=cfg.auto_ratio,
                auto_max_interval=cfg.auto_max_interval,
                select_period=cfg.select_period(),
            )
        return self._schedule

    def _ensure_state(self, entries: list[tuple[dict, torch.Tensor]]) -> None:
        needs_host: list[SplitMatrix] = []
        for group, p in entries:
            if p in self._split or p in self._dense:
                continue
            rows = bool(group.get("select_rows", False))
            if rows and not p.is_contiguous():
                raise ValueError(f"ZenFlowAdamW param group select_rows=True needs row-major (contiguous) parameters; "
                                 f"got one of shape {tuple(p.shape)} with strides {p.stride()} (do not combine it "
                                 "with column_major_ on the same weight).")
            if self._splits(p, group):
                split = SplitMatrix(p, 0, rows=rows)
                split.k = num_selected(self.config.topk_ratio, split.columns)
                if split.offloaded or self._schedule.in_warm_up():
                    needs_host.append(split)
                self._split[p] = split
            else:
                self._dense[p] = DenseDeviceState.fresh(p)
        self._attach_host(needs_host)

    def _transport_of(self, split: SplitMatrix) -> Transport:
        kind = split.param.device.type
        if kind not in self._transports:
            self._transports[kind] = transport_for(split.param.device)
        return self._transports[kind]

    def _attach_host(self, splits: list[SplitMatrix]) -> None:
        """Create the host state of `splits`, their link buffers from one reservation per transport."""
        accumulate_on = self.config.accumulate_on
        by_transport: dict[int, tuple[Transport, list[SplitMatrix]]] = {}
        for split in splits:
            transport = self._transport_of(split)
            by_transport.setdefault(id(transport), (transport, []))[1].append(split)
        for transport, group in by_transport.values():
            transport.reserve(sum(HostMatrix.link_bytes(s.matrix(s.param), s.grad_dtype, accumulate_on, transport)
                                  for s in group))
            for split in group:
                split.attach_host(accumulate_on, transport)

    def _splits(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether `p` is split between the device and the host (a large enough matrix in a layout we can split),
        or updated wholly on the device."""
        return (p.ndim >= 2 and (bool(group.get("select_rows", False)) or selection_axis(p) is not None)
                and p.numel() >= self.config.min_offload_numel)

    def _group_of(self) -> dict[torch.Tensor, dict]:
        return {p: g for g in self.param_groups for p in g["params"]}

    def _norms_and_gather(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], gather_now: bool,
        gathered: set[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Per-gradient L2 norms, and the selected columns gathered in the same sweep (added to `gathered`).

        On a CPU device one C kernel does both row by row (the strided gather then costs almost nothing on top of
        the streaming read); elsewhere each gradient's norm is followed right away by its gather, so the gather
        finds the gradient in cache where it fits.
        """
        norms: list[torch.Tensor | None] = [None] * len(grads)
        want = [
            (i, split) if gather_now and (split := self._split.get(p)) is not None and split.device is not None
            else (i, None)
            for i, (_, p) in enumerate(entries)
        ]
        # the kernels gather the strided columns of row-major matrices; they read any contiguous gradient
        reads = [(i, grads[i] if split is None else split.matrix(grads[i]),
                  split if split is not None and split.axis == 1 else None) for i, split in want]
        native = [(i, matrix, split) for i, matrix, split in reads if _native.supports(matrix)]
        if native and _native.library() is not None:
            sums = _native.norms_and_gather(
                [matrix for _, matrix, _ in native],
                [split.device.grad if split is not None else None for _, _, split in native],
                [split.device.index if split is not None else None for _, _, split in native],
            )
            for (i, _, split), total in zip(native, sums):
                norms[i] = torch.tensor(math.sqrt(total), dtype=torch.float32)
                if split is not None:
                    gathered.add(entries[i][1])
        for i, split in want:
            if norms[i] is None:
                norms[i] = l2_norm(grads[i])
            if split is not None and entries[i][1] not in gathered:
                # whole rows (column-major weights, `select_rows`), or no kernels: torch's own gather
                split.device.gather_grad(split.matrix(grads[i]))
                gathered.add(entries[i][1])
        return norms  # type: ignore[return-value]

    def _gather_selected(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], gathered: set[torch.Tensor],
    ) -> None:
        """Gather the selected columns of every split matrix with device columns (added to `gathered`)."""
        items = []
        for (_, p), g in zip(entries, grads):
            split = self._split.get(p)
            if split is not None and split.device is not None and p not in gathered:
                items.append((split.device, split.matrix(g)))
                gathered.add(p)
        gather_columns(items)

    def _device_update(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | torch.Tensor | None,
        gathered: set[torch.Tensor], rewritten: bool = False, found_inf: torch.Tensor | None = None,
    ) -> None:
        """Fused AdamW on the selected columns and the dense parameters, one kernel launch per group and device.
        `coef`: the clip coefficient, a number or a device tensor; `found_inf`: a device tensor that, when set,
        makes the update change nothing. `rewritten`: a write-back follows in this step, so matrices with host
        columns are not scattered now."""
        batches: dict[tuple[int, torch.device], tuple[dict, list[list[torch.Tensor]]]] = {}
        scatters: list[tuple[DeviceColumns, torch.Tensor]] = []
        dense_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        to_gather: list[tuple[DeviceColumns, torch.Tensor]] = []
        updates: list[tuple[dict, torch.Tensor, SplitMatrix | None, torch.Tensor]] = []
        for (group, p), g in zip(entries, grads):
            split = self._split.get(p)
            if split is not None:
                if split.device is None:
                    continue
                if p not in gathered:
                    to_gather.append((split.device, split.matrix(g)))
            updates.append((group, p, split, g))
        gather_columns(to_gather)
        dense = [(p, g if g.dtype == torch.float32 else g.float()) for _, p, split, g in updates if split is None]
        dense_grads = [g for _, g in dense]
        if coef is not None:
            # one batched multiply per kind and device: the selected columns' own buffers in place; the dense
            # parameters' gradients into new tensors (the caller's gradients are never modified)
            selected = [split.device.grad for _, _, split, _ in updates if split is not None]
            for group in _by_device(selected):
                torch._foreach_mul_(group, _to(coef, group[0].device))
            scaled = {id(g): h for group in _by_device(dense_grads)
                      for g, h in zip(group, torch._foreach_mul(group, _to(coef, group[0].device)))}
            dense_grads = [scaled[id(g)] for g in dense_grads]
        dense_grad = {id(p): g for (p, _), g in zip(dense, dense_grads)}
        for group, p, split, _ in updates:
            lists = batches.setdefault((id(group), p.device), (group, [[], [], [], [], []]))[1]
            if split is not None:
                cols = split.device
                tensors = (cols.master, cols.grad, cols.exp_avg, cols.exp_avg_sq, cols.step)
                if not (rewritten and split.host is not None):
                    scatters.append((cols, split.matrix(p)))
            else:
                state = self._dense[p]
                tensors = (state.master_of(p), dense_grad[id(p)], state.exp_avg, state.exp_avg_sq, state.step)
                if state.master is not None:
                    dense_copies.append((p, state.master))  # the parameter receives the rounded fp32 master
            for bucket, t in zip(lists, tensors):
                bucket.append(t)
        for (_, device), (group, (params, gs, m, v, steps)) in batches.items():
            flag = None if found_inf is None else _to(found_inf, device)
            fused_adamw_(params, gs, m, v, steps, group, found_inf=flag)
        scatter_columns(scatters)
        for p, master in dense_copies:
            p.copy_(master)

    def _hand_off(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | None,
    ) -> None:
        """Give this step's gradients of the offloaded matrices to the host worker, which adds them to the window
        (`_start_hand_off` then `_finish_hand_off`)."""
        started = self._start_hand_off(entries, grads)
        if started is not None:
            try:
                self._finish_hand_off(started, coef)
            except BaseException:
                if not started.done:
                    self._abandon_hand_off(started)
                raise
        elif self.config.accumulate_on == "device":
            work = self._offloaded(entries, grads)
            if work:
                self._accumulate_on_device(work, coef)

    def _offloaded(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor]
                   ) -> list[tuple[SplitMatrix, torch.Tensor]]:
        return [(self._split[p], g) for (_, p), g in zip(entries, grads)
                if p in self._split and self._split[p].host is not None]

    def _start_hand_off(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor]
                        ) -> HandOff | None:
        """Take a hand-off slot and start moving the offloaded matrices' gradients to the host (CUDA: a copy on a
        side stream into pinned memory, which the worker will wait for; CPU device: nothing to move, the worker
        reads the gradient tensors). Blocks (a stall) only while the worker is `GRAD_SLOTS` steps behind. None when
        nothing goes to the host worker this step (``accumulate_on="device"`` sums on the device instead)."""
        if self.config.accumulate_on == "device":
            return None
        work = self._offloaded(entries, grads)
        if not work:
            return None
        grant = self._worker.take_slot()
        try:
            sources, landed = self._hand_off_sources(work, grant.slot)
        except BaseException:
            grant.give_back()
            raise
        return HandOff(grant, work, sources, landed)

    def _abandon_hand_off(self, started: HandOff) -> None:
        """The step was skipped: no job, the slot goes back (a copy already enqueued into its buffers runs on the
        side stream before any later copy into them)."""
        started.done = True
        started.grant.give_back()

    def _finish_hand_off(self, started: HandOff, coef: float | None) -> None:
        """Submit the host job that adds the handed-off gradients (times `coef`) into the window sums."""
        sources, landed = started.sources, started.landed
        for split, _ in started.work:
            split.param.grad = None  # the worker owns this gradient now
        self._stats.bytes_to_host += sum(g.numel() * g.element_size() for _, g in started.work)
        started.work.clear()

        def accumulate() -> None:
            try:
                landed.wait()  # Sync point (worker waits on the device): the gradients have landed on the host
                HostMatrix.accumulate_all(sources, coef)
            finally:
                sources.clear()  # the gradients' memory goes now, not when the worker's next job replaces this one

        started.grant.submit("accumulate", accumulate)  # the job returns the slot when it has run
        started.done = True  # (interrupted before this line, `_abandon_hand_off` returns it and the job skips)

    def _hand_off_sources(self, work: list[tuple[SplitMatrix, torch.Tensor]], slot: int
                          ) -> tuple[list[tuple[HostMatrix, torch.Tensor]], Landed]:
        sources: list[tuple[HostMatrix, torch.Tensor]] = []
        landed = Landed()
        for transport, group in self._by_transport([split for split, _ in work]):
            mine = {id(split) for split in group}
            part, arrived = transport.hand_off([(s, g) for s, g in work if id(s) in mine], slot)
            sources += part
            landed.events += arrived.events
        return sources, landed

    def _accumulate_on_device(self, work: list[tuple[SplitMatrix, torch.Tensor]], coef: float | None) -> None:
        """``accumulate_on="device"``: add this step's gradients into the device-side window sums (the caller's
        stream, like the rest of the device update); nothing crosses the link until the window closes."""
        for split, g in work:
            if split.window_count == 0:
                self._transport_of(split).before_window_add(split)  # (CUDA: the last window's copy has read it)
            accumulate_into(split.window_sum, split.matrix(g), coef, first=split.window_count == 0)
            split.window_count += 1

    def _ship_window_sums(self, splits: list[SplitMatrix]) -> Landed:
        """``accumulate_on="device"``: move each closed window's device sum into its host accumulator, once per
        window; returns what the host step must wait for. The caller has made sure no host step still reads the
        accumulators."""
        shipped = [s for s in splits if s.window_sum is not None and s.window_count]
        landed = Landed()
        for transport, group in self._by_transport(shipped):
            landed.events += transport.ship_window_sums(group).events
        for split in shipped:
            split.host.accum_count, split.window_count = split.window_count, 0
            self._stats.bytes_to_host += split.host.accum.numel() * split.host.accum.element_size()
        return landed

    def _by_transport(self, splits: list[SplitMatrix]) -> list[tuple[Transport, list[SplitMatrix]]]:
        groups: dict[int, tuple[Transport, list[SplitMatrix]]] = {}
        for split in splits:
            transport = self._transport_of(split)
            groups.setdefault(id(transport), (transport, []))[1].append(split)
        return list(groups.values())

    def _close_window(self, timer: StepTimer, sequential: bool) -> None:
        """End the open window: submit its host AdamW; write back now (sequential) or at the next boundary."""
        schedule = self._schedule
        steps = schedule.close_window()
        for split in self._split.values():
            split.auto.reset()
        scale = host_lr_scale(self.config.host_lr_scale, steps)
        group_of = self._group_of()
        by_group: dict[int, tuple[dict, list[HostMatrix]]] = {}
        for p, split in self._split.items():
            if split.host is not None:
                group = group_of[p]
                if id(group) not in by_group:
                    # hyper-parameters are copied now: the lr in force when the window closed
                    hyper = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay")}
                    hyper["lr"] = hyper["lr"] * scale
                    by_group[id(group)] = (hyper, [])
                by_group[id(group)][1].append(split.host)
        work = list(by_group.values())
        worker = self._ensure_worker()  # (closed after training: `flush()` may still close a window)
        if not work:
            return  # every column lives on the device: no host step, nothing stale
        if not sequential:
            self._apply_previous_window(timer)
        landed = None
        if self.config.accumulate_on == "device":
            with timer.phase("handoff"):
                if self._pending is not None:
                    # Sync point: the previous window's host step reads the host accumulators; it must be done
                    # before this window's sums land there (only reached in sequential closes: an overlapped close
                    # waited above).
                    worker.wait(self._pending)
                landed = self._ship_window_sums([s for s in self._split.values() if s.host is not None])

        def host_step() -> None:
            if landed is not None:
                landed.wait()  # Sync point (worker waits on the device): the window's sums are on the host
            host_adamw_window(work)

        future = worker.submit("host_adamw", host_step)
        self._unapplied_steps.append(steps)
        self._pending, self._writeback_pending = future, True
        if sequential:
            with timer.phase("wait"):
                worker.wait(future)
            with timer.phase("writeback"):
                self._write_back()

    def _apply_previous_window(self, timer: StepTimer) -> None:
        """Overlapped schedule: write the previous window's host result back, if one is pending."""
        if not self._writeback_pending:
            return
        with timer.phase("wait"):
            # Sync point: the previous window's host step must be done before its result is written back.
            if self._pending is not None:
                self._ensure_worker().wait(self._pending)
        with timer.phase("writeback"):
            self._write_back()

    def _write_back(self) -> None:
        """Put each fresh host result into the weights, then the device columns back on top.

        Only matrices whose host step ran since the last write-back are written (`writeback_fresh`): a matrix that
        got no gradient in the window keeps its weights, including columns that left the device at a re-selection
        since. How a result gets into the weights is the transport's (CUDA: an asynchronous copy from pinned
        memory; CPU device: a storage swap).
        """
        columns_back: list[tuple[DeviceColumns, torch.Tensor]] = []
        written: list[SplitMatrix] = []
        for split in self._split.values():
            host = split.host
            if host is None:
                continue
            if host.writeback_fresh:
                self._transport_of(split).put_weights(split)
                written.append(split)
                self._stats.bytes_to_device += split.param.numel() * split.param.element_size()
            if split.device is not None:
                columns_back.append((split.device, split.matrix(split.param)))
            host.writeback_fresh = False
        scatter_columns(columns_back)
        for transport, group in self._by_transport(written):
            transport.after_write_back(group)
        self._writeback_pending = False
        self._pending = None
        self._unapplied_steps.clear()

    def _drain_and_apply(self) -> None:
        worker = self._ensure_worker()
        worker.synchronize()
        if self._writeback_pending:
            self._write_back()

    def _warm_up_step(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | None,
        timer: StepTimer,
    ) -> None:
        """Plain dense AdamW: every matrix column by the host, synchronously; 1-D parameters on the device."""
        with timer.phase("device_update"):
            self._device_update(entries, grads, coef, set())
        with timer.phase("handoff"):
            self._hand_off(entries, grads, coef)
        self._schedule.window_steps += 1
        self._close_window(timer, sequential=True)

    def _reselect(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor]) -> None:
        """Choose new device columns from this step's gradient and migrate state to match.

        The open window is closed first and every host result applied, so the host master is current for all
        columns it owns; then the outgoing device columns are copied into the host state and the incoming ones
        gathered from it (master values, moments, no reset).
        """
        schedule = self._schedule
        if schedule.window_steps > 0:
            self._close_window(StepTimer(), sequential=True)
        self._drain_and_apply()
        schedule.force_select = False
        for split in self._split.values():  # (a resumed run may have a new topk_ratio)
            split.k = num_selected(self.config.topk_ratio, split.columns)
        pairs = [(self._split[p], g) for (_, p), g in zip(entries, grads) if p in self._split]
        scores = self._row_scores([(split, split.matrix(g)) for split, g in pairs if split.offloaded])
        for split, g in pairs:
            self._select(split, g, scores.get(id(split)))
        schedule.reselections += 1

    @staticmethod
    def _row_scores(items: list[tuple[SplitMatrix, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """Selection scores of the matrices whose selectable units are contiguous rows (column-major weights,
        `select_rows`), on a CPU device: one threaded kernel pass over all of them instead of a chunked torch sweep
        per matrix. Others are left to `column_scores` in `_select`."""
        rows = [(split, m) for split, m in items if split.axis == 0 and _native.supports(m) and m.ndim == 2]
        if not rows or _native.library() is None:
            return {}
        return {id(split): s for (split, _), s in zip(rows, _native.row_scores([m for _, m in rows]))}

    def _select_new_matrices(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], norms: list[float],
    ) -> None:
        """Matrices without device columns get them now: seen for the first time after warm-up (their first
        gradient came late), or every gradient of theirs at selection time was zero (`_select`). Only matrices whose
        gradient is not zero now are tried (`norms`: this step's gradient norms, already on the host)."""
        todo = [(split, g) for i, ((_, p), g) in enumerate(zip(entries, grads))
                if (split := self._split.get(p)) is not None and split.device is None and split.k > 0 and norms[i] > 0]
        if not todo:
            return
        if any(split.host is not None for split, _ in todo):
            # Sync point: the worker may still be updating these matrices' host master and moments, from which the
            # new device columns are read.
            self._worker.synchronize()
        for split, g in todo:
            self._select(split, g)

    def _select(self, split: SplitMatrix, grad: torch.Tensor, scores: torch.Tensor | None = None) -> None:
        p = split.param
        if split.host is None and split.offloaded:
            # every column was on the device (a resumed run with a lower topk_ratio): the host state starts from the
            # weights and takes every device column below
            self._attach_host([split])
        host = split.host
        # Sync point (re-selection only, every `select_period` steps): the outgoing device columns are copied to the
        # host and the incoming ones up with blocking copies; the worker was drained by the caller first.
        axis = split.axis
        if split.device is not None and host is not None:
            idx = split.device.index.cpu()
            host.master.index_copy_(axis, idx, split.device.master.cpu())
            host.exp_avg.index_copy_(axis, idx, split.device.exp_avg.cpu())
            host.exp_avg_sq.index_copy_(axis, idx, split.device.exp_avg_sq.cpu())
            if split.k == 0:
                split.device = None  # (topk_ratio now 0) every column lives on the host
        if split.k == 0 or (split.device is not None and split.device.k == split.k == split.columns):
            return  # nothing on the device, or every column already there
        if split.offloaded:
            scores = column_scores(split.matrix(grad), axis) if scores is None else scores
            # Sync point (selection only): an all-zero gradient ranks nothing (LoRA's lora_A at its first step, while
            # lora_B is still zero). Keep the current columns, or none yet: `_select_new_matrices` retries at the
            # next step whose gradient of this matrix is not zero.
            if not bool(scores.any()):
                return
            index = top_columns(scores, split.k)
        else:
            index = torch.arange(split.k, device=p.device)
        if split.device is not None:
            step = split.device.step  # most device columns stay: keep the device path's count
        elif host is not None:
            step = host.step
        else:
            step = torch.zeros(())
        if host is not None:
            cpu_idx = index.cpu()
            cols = [t.index_select(axis, cpu_idx) for t in (host.master, host.exp_avg, host.exp_avg_sq)]
        else:
            master = split.matrix(p).detach().index_select(axis, index).float()
            cols = [master, torch.zeros_like(master), torch.zeros_like(master)]
        split.device = DeviceColumns.from_columns(index, *cols, step=step, device=p.device, axis=axis)
        if not split.offloaded:
            split.detach_host()  # every column on the device (topk_ratio=1): the host keeps nothing
        split.auto.reset()

    # ------------------------------------------------------------------------------------------------------------
    # Checkpointing
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: per-matrix selection, device and host masters and moments, the
        open window's accumulated gradient, a host result still waiting to be written back, counters and Zen-auto
        statistics, with shapes and checksums (`hf_zenflow.checkpoint`). Only tensors, numbers, strings, lists and
        dicts: loadable with ``torch.load(weights_only=True)``.

        Waits for the host worker first (`synchronize`), which does not change the schedule. Like torch's
        optimizers, the returned tensors are the live state: serialise it before stepping again.
        """
        self.synchronize()
        self._pick_up_outside_changes()
        return checkpoint.pack(self)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict()` of this or an earlier hf_zenflow, or continue a `torch.optim.AdamW` state dict
        (moments and step counts carried over). Tensors may be on any device.

        The state is checked first (shapes, dtypes, finite values, checksums): a damaged or foreign one raises
        `hf_zenflow.CheckpointError` naming the tensor, and nothing is changed. Settings of this optimizer that
        differ from the checkpoint's take effect (see `hf_zenflow.checkpoint`), with a logged note.
        """
        self.synchronize()
        before = (self.config.resolved_cpu_threads, self.config.overlap_step)
        checkpoint.unpack(self, state_dict)
        if self._worker is not None and (self._worker.threads, self._worker.background) != (
            before[0], before[1] and self.host_executor == "thread"
        ):
            self.close()  # restarted lazily with the current settings
        self._mark_weights()

    def name_parameters(self, named: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module) -> None:
        """Record parameter names (e.g. ``model.named_parameters()``, or the model): checkpoints then carry them and
        error messages name the parameter. Parameters passed as ``(name, param)`` pairs are named already."""
        pairs = named.named_parameters() if isinstance(named, torch.nn.Module) else named
        mine = {p for g in self.param_groups for p in g["params"]}
        self._param_names.update({p: name for name, p in pairs if p in mine})

    def _reset_state(self) -> None:
        self._split.clear()
        self._dense.clear()
        self._pending, self._writeback_pending, self._unapplied_steps = None, False, []
        self._schedule = None
