"""`ZenFlowAdamW`: AdamW with ZenFlow's importance-aware device/host split.

Each optimizer step:

1. each gradient's norm is read as backward produces it (`engine/gradients.py`: hooks; the clip norm reuses it) and the
   host reads a few scalars in the step's one sync: the non-finite check, the clip coefficient, Zen-auto's masses;
2. **device path** (`engine/device_step.py`): the top-k input columns of every matrix (by gradient norm) and every 1-D
   parameter get a fused AdamW update on the device, on fp32 master values and moments;
3. **host path** (`engine/host.py`): the whole matrix gradient is handed to the host worker, which adds it to a window
   accumulator (or, with ``accumulate_on="device"``, "auto"'s usual choice where device memory allows, the window is
   summed on the device and crosses once); every `update_interval` steps the window closes and the host AdamW
   updates the matrix on the window's mean gradient, the closing step's gradient folded into the same pass, with the
   learning rate in force when the window closed;
4. the host result is written back into the device weights ``writeback_lag`` steps into the next window
   (``overlap_step=True``: the host step runs while the device trains on; ``writeback_lag=None`` = at the next
   window's end, ZenFlow's own schedule; "auto" = the smallest lag the measured host step fits in) or at once
   (``overlap_step=False``); the columns on the device keep their device values.

The selection is refreshed on schedule; the master values and moments of columns that enter or leave the device
set migrate with them, so with ``update_interval=1`` the split is invisible (AdamW is elementwise).
"""

from __future__ import annotations

import atexit
import logging
import numbers
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import checkpoint
from .._base import GradNormCache, check_hyperparameters, clip_coefficient, grad_norms
from ..distributed.fsdp import LocalShards, global_norm
from ..engine import amp
from ..engine.backward import HandOff
from ..engine.device_memory import DeviceMemoryMeter
from ..engine.device_state import DenseDeviceState
from ..engine.device_step import ParamWrites, device_update
from ..engine.engine_state import EngineState
from ..engine.failure import drop_failed_worker, refuse_after_failure
from ..engine.gradients import GradientReads, StepReads, Synced, read_gradients
from ..engine.graph_guard import refuse_captured_step
from ..engine.params import (
    check_group_params,
    check_param_group,
    create_state,
    offloads_any,
    resolve_config,
)
from ..engine.planner import LimitChoice
from ..engine.reselection import reselect, select_waiting
from ..engine.run_start import RunStart
from ..engine.schedule import StepKind, WindowSchedule
from ..engine.split_matrix import SplitMatrix, master_value
from ..engine.state_maker import StateMaker
from ..engine.step_plan import StepPlan, plan_step
from ..engine.telemetry import StepTimer, ZenFlowStats, device_state_bytes
from ..engine.weight_marks import WeightMarks, rekey, reread_masters
from ..engine.windows import HostWindows
from ..engine.worker import wait_for_closed_workers
from ..engine.writeback_lag import AutoWritebackLag
from ..settings.config import ZenFlowConfig, sums_on_device
from .ownership import take_over
from .stats import optimizer_stats


logger = logging.getLogger(__name__)

_LIVE_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()

#: What `train()` (which a Trainer calls before each step) says when nothing drains the optimizer.
UNDRAINED_MESSAGE = ("ZenFlowAdamW is stepped by a Trainer that neither waits for its host worker before checkpoints "
                     "nor flushes the last window at the end: pass callbacks=[ZenFlowCallback()] (hf_zenflow) with "
                     "optimizers=(...), or use ZenFlowTrainer. (A loop of your own that calls train() sets drained_by "
                     "and calls flush() and close() at its end.)")


@atexit.register
def _close_all() -> None:  # the host threads are daemons; this just lets in-flight jobs end cleanly
    for opt in list(_LIVE_OPTIMIZERS):
        opt.close()


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW whose important columns are updated on the device every step and the rest by a host AdamW every
    `update_interval` steps, overlapped with training.

    Args:
        params: parameters or param groups (per-group ``lr``, ``betas``, ``eps``, ``weight_decay``).
        lr, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay, as `torch.optim.AdamW`).
        config: a `ZenFlowConfig`; keyword arguments named like its fields override it.
        steps_per_epoch: the epoch length in optimizer steps (the data's, not a setting), by which
            ``select_strategy="epoch"`` and ``"auto"`` re-select; `ZenFlowTrainer` and `ZenFlowPlugin.prepare` set it
            from the dataloader (`set_steps_per_epoch`). None: unknown (``"auto"`` re-selects every 100 steps,
            ``"epoch"`` refuses the first step).
        host_executor: ``"thread"`` (default) runs the host work on a background thread; ``"inline"`` runs the same
            jobs in the calling thread, in the same order (the sequential reference of the overlapped schedule).
        process_group: the data-parallel ranks that share the host work (default: torch's default process group,
            when one of several ranks is initialised; DDP). Each rank then holds host state for, and runs the host
            AdamW on, 1/N of every offloaded matrix, and `step()`, `flush()`, `load_state_dict()` and
            `master_weight()` are collectives: call them on every rank (`hf_zenflow.distributed.sharding`). Under FSDP2
            (DTensor parameters from ``fully_shard``) each rank works on its own shards instead and this argument
            is not used: `step()` and `clip_grad_norm_()` are collectives over the mesh, and each rank's
            `state_dict()` holds its own shards (`hf_zenflow.distributed.fsdp`).

    Matrices (parameters with ``ndim >= 2``, viewed as ``[out, in]``) are split by input column, whether stored
    row-major or column-major (`column_major_`, where each input column is contiguous); 1-D parameters and other
    layouts are updated entirely on the device. A param group with ``select_rows=True`` splits its matrices by row
    instead: for an embedding table ``[vocab, hidden]`` the input channels are the rows (tokens), contiguous in
    memory (``hf-zenflow compare`` uses it for the word embeddings on a CPU device). `step()` takes ownership of the
    gradients of split matrices (it sets their ``.grad`` to None) so that the host worker can read them after
    `step()` returns.

    One ZenFlow optimizer per parameter: the backward hooks read each gradient and may take it off its parameter
    (``free_gradients_in_backward``), so two optimizers hooked on one parameter would race for its gradient and the
    later one would silently train nothing. A `ZenFlowAdamW` (or `SyncOffloadAdamW`) built over parameters an earlier
    `ZenFlowAdamW` holds takes them over: the earlier one is detached (closed, which lets its host worker finish its
    jobs; its hooks off; its `step()` refused from then on), and a warning says so once, naming how many parameters
    and the first, unless it had been closed with nothing left to apply. A take-over rather than a refusal because
    building the next optimizer over the same model (a notebook's next cell, a Trainer after a plain loop) says
    what the caller wants, while the earlier optimizer usually still lives in a variable: a refusal would leave
    ``del opt; gc.collect()`` as the remedy. The earlier one's host results not yet in the weights are not written
    then (they would change weights the caller may just have loaded): `flush()` it first to keep them. `close()` an
    optimizer before another kind (``torch.optim.AdamW``, a Trainer's ``adamw_torch``) trains its parameters.

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

    #: `torch.amp.GradScaler.step` passes the scale and the overflow flag instead of unscaling (`engine/amp.py`)
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        config: ZenFlowConfig | None = None,
        steps_per_epoch: int | None = None,
        host_executor: str = "thread",
        process_group: Any = None,
        **config_overrides: Any,
    ) -> None:
        check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        config = resolve_config(config, config_overrides, host_executor)
        self.host_executor = host_executor
        self._split: dict[torch.Tensor, SplitMatrix] = {}
        self._dense: dict[torch.Tensor, DenseDeviceState] = {}
        self._norm_cache = GradNormCache()
        self._stats = ZenFlowStats()
        self._auto_lag = AutoWritebackLag()
        self._run_start = RunStart()  # the once-per-run decisions and log lines of each schedule
        self._fsdp = LocalShards()  # FSDP2's DTensor parameters, found at the first use (`_find_param_shards`)
        self._host = HostWindows(self._split, self.param_groups, config, self._stats, host_executor, process_group)
        # the run's schedule (kept by the host side: `_schedule`) and the first step's state made in its backward hooks
        self._state = StateMaker(self._host, self._dense, self._fsdp)
        self.config = config
        self.drained_by: str | None = None  # what drains it: "ZenFlowCallback", "ZenFlowTrainer" (`train()` checks)
        # each gradient's norm (and on CUDA the start of its copy to the host) as backward produces it
        self._reads = GradientReads(p for g in self.param_groups for p in g["params"])
        self._reads.on_ready = self._host.backward.grad_ready
        # what the device holds at its peak in a step (`stats()["peak_device_bytes"]`)
        self._meter = DeviceMemoryMeter((p for g in self.param_groups for p in g["params"]),
                                        lambda split=self._split, dense=self._dense: device_state_bytes(split, dense),
                                        in_flight=self._host.backward.in_flight.bytes)
        self._reads.meter = self._host.meter = self._meter
        self._reads.on_arrival = self._host.backward.regather
        self._reads.defers_norm = self._host.backward.defers_norm
        self._reads.reduced_later = lambda host=self._host: host.shards.ranks > 1  # DDP rewrites them after the hooks
        #: the caller clips through `clip_grad_norm_` (free_gradients_in_backward="auto"), a GradScaler was seen
        self._clips_through_optimizer, self._scaled = False, False
        #: what the last `load_state_dict()` loaded: its steps and clip threshold (`checkpoint.SavedProgress`), for a
        #: resume to compare with the Trainer's state (`hf_zenflow.hf.resume.check_resumed_optimizer`); None: none
        self.loaded_progress: checkpoint.SavedProgress | None = None
        self._made_in_backward = self._state.made_in_backward  # the first step's state made in its backward hooks
        self._host.backward.create_in_backward = self._state.in_backward
        self._host.backward.free_kind = self._frees_next_step()
        self._weights = WeightMarks()  # notices weights changed from outside the optimizer
        names = {p: name for g in self.param_groups for name, p in zip(g.get("param_names", ()), g["params"])}
        # the state as one object (`engine_state`): the checkpoint code saves and restores it
        self._engine_state = EngineState(self._split, self._dense, self._host, self._fsdp, self._stats, names,
                                         self._state, self._weights)
        amp.install()  # scaler.unscale_(opt) tells `_grads_unscaled`
        _LIVE_OPTIMIZERS.add(self)
        self._hooks_off = False  # `close()` took the hooks off; the next `train()` or `step()` hooks again
        self._detached: str | None = None  # why another optimizer took the parameters over (`_detach`)
        take_over(self, self._held())  # (one ZenFlow optimizer per parameter: see the class docstring)
        # The thread rule's decision for the run, before its first forward (docs/threads.md)
        self._host.keeper.offload_planned = offloads_any(self.param_groups, config)
        self._host.keeper.claim_cores()
        if steps_per_epoch is not None:
            self.set_steps_per_epoch(steps_per_epoch)

    # ------------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        check_param_group(param_group, self.defaults)
        super().add_param_group(param_group)
        check_group_params(self.param_groups[-1])
        if hasattr(self, "_reads"):  # a group added after construction: its gradients are read in backward too
            take_over(self, self.param_groups[-1]["params"])
            if not self._hooks_off:
                self._reads.watch(self.param_groups[-1]["params"])
            self._state.group_of.update({p: self.param_groups[-1] for p in self.param_groups[-1]["params"]})
            self._host.keeper.offload_planned = offloads_any(self.param_groups, self.config)
            self._host.keeper.claim_cores()

    def clip_through_optimizer(self) -> None:
        """The caller clips only through `clip_grad_norm_` (or not at all), never with
        `torch.nn.utils.clip_grad_norm_` over the model, which cannot see gradients freed in backward: with
        ``free_gradients_in_backward="auto"`` they are freed from the first step on (`ZenFlowTrainer` and
        `hf-zenflow compare` say so; otherwise "auto" waits for the first `clip_grad_norm_`)."""
        self._clips_through_optimizer = True
        self._host.backward.free_kind = self._frees_next_step()

    @property
    def steps_per_epoch(self) -> int | None:
        """The epoch length in optimizer steps that ``select_strategy="epoch"`` / ``"auto"`` re-select by; None:
        unknown."""
        return self._host.steps_per_epoch

    def set_steps_per_epoch(self, steps: int) -> None:
        """Set the epoch length in optimizer steps, for ``select_strategy="epoch"`` or ``"auto"`` (the Trainer and
        `ZenFlowPlugin.prepare` do, from the dataloader); an integer >= 1."""
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"ZenFlowAdamW: steps_per_epoch={steps!r} is invalid: allowed is an integer >= 1.")
        self._host.steps_per_epoch = int(steps)
        if self._schedule is not None:
            self._schedule.select_period = self.config.select_period(int(steps))
            self._host.backward.free_kind = self._frees_next_step()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm of ALL gradients (what `torch.nn.utils.clip_grad_norm_` returns) and, when it exceeds
        `max_norm`, the same scale applied to both the device and the host path inside the next `step()`.

        The gradients themselves are not rewritten: the coefficient is folded into the gather of the selected
        columns and into the host accumulation, which read the gradient anyway.
        """
        self._find_param_shards()
        self._clips_through_optimizer = True
        self._engine_state.clip_max_norm = float(max_norm)  # (saved in checkpoints)
        freed = self._host.backward.freed  # (gradients freed in backward: their stand-ins, whose norms the hooks took)
        local = self._fsdp.local  # (FSDP2: the freed gradients are keyed by the local shards)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None or local(p) in freed]
        grads = [freed[local(p)].stand_in if local(p) in freed else self._fsdp.grad(p) for p in params]
        known = ([self._reads.norm(self._fsdp.local(p), g) for p, g in zip(params, grads)] if norm_type == 2.0
                 else None)
        norms, total = grad_norms(grads, norm_type, known)
        if self._fsdp.active:
            total = global_norm(total, norm_type, self._host.param_shards)  # Collective (FSDP2): every rank's rows
        coef = clip_coefficient(total, float(max_norm)) if max_norm != float("inf") else None
        if norm_type == 2.0:
            self._norm_cache.store(grads, norms, total, coef)
        else:
            self._norm_cache.store(grads, [], None, coef)
        return total

    def _grads_unscaled(self, inv_scale: torch.Tensor) -> None:
        """`GradScaler.unscale_` multiplied every gradient by `inv_scale` in place, without a version bump
        (`engine/amp.py`): what was read of them before must follow or go."""
        self._note_scaler()
        # gradients freed in backward (the scaler did not see them) and the copies started in backward: they follow
        # on the host, added times inv_scale, without a second copy (their overflow went to the scaler's check:
        # `amp.install`)
        self._host.backward.unscaled(inv_scale)
        self._reads.rescale(inv_scale)
        self._norm_cache.take([])  # a clip measured before unscale_ no longer describes the gradients

    def _note_scaler(self) -> None:
        """A GradScaler is in use: from now on the hooks make its overflow check of each gradient they free."""
        self._scaled = self._host.backward.checks_overflow = True

    def _before_unscale(self) -> None:
        """`GradScaler.unscale_` is about to rewrite the gradients in place: the copies to the host started in
        backward must have read them first (`amp.install`)."""
        self._host.backward.before_unscale()

    def _freed_overflow(self) -> dict[torch.device, torch.Tensor] | None:
        """Per device of the gradients freed in backward: 1.0 (a tensor there) when one of them holds an inf or NaN,
        else 0.0; None when none was freed. Added to a GradScaler's overflow check (`amp.install`), which reads only
        ``p.grad`` and keeps one flag per device (``device_map``: a model over several GPUs): the same element-wise
        test, made in each gradient's hook (or, for the hooks of the first step with a scaler, which did not know of
        it, from the host copies wherever the hook's norm is not finite: a norm that is finite rules an inf or NaN
        out: `BackwardHandOff.freed_overflow`, with the hooks' norms)."""
        return self._host.backward.freed_overflow(self._reads.norm)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        refuse_captured_step()  # (a CUDA graph capture: `engine/graph_guard.py`)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        refuse_after_failure(self._host)
        self._hook_again()
        self._auto_lag.tick()
        self._find_param_shards(final=True)
        worker = self._host.ensure_worker()
        worker.check()
        worker.hold()
        try:
            return self._step(loss)
        finally:
            self._host.backward.free_kind = self._frees_next_step()
            self._meter.finish_step()
            self._reads.clear()  # this backward's reads are used up
            self._host.backward.release()  # copies started in backward that this step did not take (skipped step)
            # The host jobs this step submitted (accumulation, the window's host AdamW) start now, overlapping the
            # caller's next forward/backward.
            worker.release()

    def _step(self, loss: float | None) -> float | None:
        """One step, after `step()` has taken the worker: read -> plan -> device update -> hand-off -> close.

        1. read: every gradient once (norms, Zen-auto's masses, the selected columns on an ordinary step);
        2. plan: the schedule's decisions for this step (`engine/step_plan.py`);
        3. device update: launched with the hand-off's copies before the step's one device->host sync (the non-finite
           check, the clip coefficient) where the plan says, else after it, on the columns chosen on its numbers;
        4. hand-off: the previous window's result goes into the weights first where the plan says (overlapped:
           ``writeback_lag`` steps into the window), then this step's gradients go to the host worker;
        5. close: the window closes where the plan says (its host AdamW submitted; the sequential schedule waits
           for it and writes it back at once).
        """
        timer = StepTimer()
        unscale, found_inf = self._scaler_args()
        taken = self._take_gradients()
        if taken is None:
            return loss
        entries, grads, measured, freed = taken
        if self._first_step_overflowed(found_inf):
            self._forget_backward_state()
            self._stats.skip_step(timer, steps=0)
            return loss
        schedule = self._prepare_state(entries)
        reads, copies_factor = self._read(schedule, entries, grads, measured, freed, unscale, found_inf, timer)
        plan = plan_step(schedule, self.config.overlap_step, self._host.writeback_pending, bool(reads.waiting))
        writes: ParamWrites | None = None
        started: HandOff | None = None
        try:
            if plan.launches_before_sync:
                writes, started = self._launch_before_sync(plan, entries, grads, reads, timer)
            synced = self._sync(reads, len(entries), copies_factor, timer)
            if not synced.finite:
                if started is not None:
                    self._host.backward.abandon(started)
                self._stats.skip_step(timer, steps=schedule.steps)
                return loss
            if writes is not None:
                writes.apply()  # (the update launched before the check: the parameters receive its masters now)
            if plan.warm_up:
                self._meter.note()  # (the state exists; the gradients are still held)
                self._warm_up_step(entries, grads, synced.coef, schedule, timer)
            else:
                # the first gradient after a write-back tells whether the host result overshot (`host_guard.py`);
                # this step's own write-back, below, comes after
                self._host.guard.observe(synced.total, schedule.steps, self.config.rules.host_step_guard)
                if not plan.launches_before_sync:
                    writes = self._update_after_sync(plan, schedule, entries, grads, reads, synced, timer)
                self._hand_off(plan, entries, grads, writes, started, synced, timer)
                self._close_if_due(plan, schedule, reads, synced, timer)
        except BaseException:
            self._host.backward.held.abandon(self._host.backward.abandon)
            # an interrupt (Ctrl-C) or a failure between taking a hand-off slot and submitting its job must not leak
            # the slot: the next step would wait for it forever
            if started is not None and not started.done:
                self._host.backward.abandon(started)
            raise
        self._finish_step(schedule, timer)
        return loss

    def _scaler_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What a GradScaler's `step` passes (`engine/amp.py`): 1 / the scale still on the gradients and the overflow
        flag, each None when absent."""
        unscale, found_inf = amp.scaler_args(self)
        if unscale is not None or found_inf is not None:
            self._note_scaler()
        return unscale, found_inf

    def _take_gradients(self) -> tuple[list[tuple[dict, torch.Tensor]], list[torch.Tensor], tuple, dict] | None:
        """The step's (group, parameter) entries with a gradient (under FSDP2 this rank's shards), their gradients (a
        freed gradient's stand-in in its place), what `clip_grad_norm_` measured of them (norms, total, clip
        coefficient) and the gradients freed in backward; None when no parameter has a gradient."""
        # what `clip_grad_norm_` measured, keyed by the gradients it saw (a freed gradient's stand-in)
        measured_on = {p: f.stand_in for p, f in self._host.backward.freed.items()}
        if self._host.backward.freed and (self._host.accumulate_on != "host"
                                          or self._ensure_schedule().kind() is not self._host.backward.free_kind):
            # the step needs whole gradients after all (a re-selection forced by a resume or a changed setting):
            # the freed ones come back from the host, the same values
            self._host.backward.restore_freed()
        freed = self._host.backward.freed  # gradients freed in backward: their stand-ins take their place below
        entries = [(group, p) for group in self.param_groups for p in group["params"]
                   if p.grad is not None or self._fsdp.local(p) in freed]
        if not entries:
            return None
        for _, p in entries:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError("ZenFlowAdamW does not support sparse gradients")
        entries, grads = self._fsdp.entries(entries)  # (FSDP2: this rank's shards; else unchanged)
        grads = [freed[p].stand_in if p in freed else g for (_, p), g in zip(entries, grads)]
        measured = self._norm_cache.take([measured_on.get(p, g) for (_, p), g in zip(entries, grads)])
        return entries, grads, measured, freed

    def _first_step_overflowed(self, found_inf: torch.Tensor | None) -> bool:
        """Whether the run's very first step overflowed (a GradScaler starting too high does this a few times): it is
        then skipped before any state exists, so that it changes nothing at all (state its backward hooks made goes
        again, `_forget_backward_state`). Not under FSDP2, where each rank's flag covers its own shards only: there
        the step's all-reduced norm makes every rank skip alike, after creating the state."""
        first = self._schedule is None or (self._schedule.steps == 0 and bool(self._made_in_backward))
        # Sync point (first step only, which waits for its scalars before any update anyway): the scaler's flag
        return first and found_inf is not None and not self._fsdp.active and bool(found_inf.item())

    def _prepare_state(self, entries: list[tuple[dict, torch.Tensor]]) -> WindowSchedule:
        """The schedule, with the state of every entry (weights changed from outside re-read first); at the run's
        first step, its once-per-run decisions and log lines (`engine/run_start.py`)."""
        schedule = self._ensure_schedule()
        self._pick_up_outside_changes()
        create_state(entries, self._split, self._dense, self.config, schedule, self._host.attach_host,
                     self._fsdp if self._fsdp.active else None)
        self._run_start.at_first_step(schedule, self.config, self.param_groups, self._host, self._auto_lag,
                                      self._copies_lag)
        return schedule

    def _read(self, schedule: WindowSchedule, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor],
              measured: tuple, freed: dict, unscale: torch.Tensor | None, found_inf: torch.Tensor | None,
              timer: StepTimer) -> tuple[StepReads, torch.Tensor | None]:
        """One read of every gradient (`engine/gradients.py`; an ordinary step gathers its selected columns too), and
        the inverse scale on the copies made in backward before a GradScaler's ``unscale_`` (read in the sync; the
        hand-off takes those copies)."""
        gather_now = schedule.kind() is StepKind.ORDINARY
        with timer.phase("norms"):
            reads = read_gradients(self._split, self._reads, entries, grads, measured, gather_now,
                                   auto=self.config.is_auto_interval, ranks=self._host.param_shards, unscale=unscale,
                                   found_inf=found_inf, gathered_already=set(freed) if gather_now else None)
        return reads, self._host.backward.early_factor

    def _launch_before_sync(self, plan: StepPlan, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor],
                            reads: StepReads, timer: StepTimer) -> tuple[ParamWrites, HandOff | None]:
        """An ordinary step's device update and the start of its hand-off, before the step's sync. The fused AdamW
        takes the non-finite flag as a device tensor and changes nothing when it is set, so the update need not wait
        for the check: the device computes while the host waits in the sync."""
        total, clip = reads.total, reads.clip
        bad = ~torch.isfinite(total) if clip is None else ~(torch.isfinite(total) & torch.isfinite(clip))
        with timer.phase("device_update"):
            # (the masters only: the parameters receive them after the check, a skipped step leaves them untouched)
            writes = device_update(self._split, self._dense, entries, grads, clip, reads.gathered,
                                   writes_back=plan.writes_back, found_inf=bad.float())
        # (the device's peak of the step: every gradient still held, the state updated, and the widened copies of
        # the gathered gradients the update held at its peak)
        self._meter.note(writes.widened_bytes)
        with timer.phase("handoff"):
            started = self._host.backward.start(entries, grads)
        return writes, started

    def _sync(self, reads: StepReads, entries: int, copies_factor: torch.Tensor | None, timer: StepTimer) -> Synced:
        """The step's one device->host sync (`StepReads.sync`)."""
        with timer.phase("norms"):
            # Sync point, the only one of an ordinary step: the caller waits for the backward pass (and the norms) to
            # finish and reads a few scalars.
            synced = reads.sync(clipped=reads.clip is not None, entries=entries, copies_factor=copies_factor)
            self._host.backward.copies_factor = synced.copies_factor
        return synced

    def _update_after_sync(self, plan: StepPlan, schedule: WindowSchedule, entries: list[tuple[dict, torch.Tensor]],
                           grads: list[torch.Tensor], reads: StepReads, synced: Synced,
                           timer: StepTimer) -> ParamWrites:
        """A re-selection's device update, or a step's with matrices waiting for their first columns: the columns
        chosen on the synced numbers, then the update, its parameters written at once."""
        with timer.phase("select"):
            if plan.selects:
                reads.gathered |= reselect(self._host, schedule, entries, grads)
            else:
                select_waiting(self._host, entries, grads, synced.waiting_norms)
        with timer.phase("device_update"):
            writes = device_update(self._split, self._dense, entries, grads, synced.coef, reads.gathered,
                                   writes_back=plan.writes_back)
            writes.apply()
        return writes

    def _hand_off(self, plan: StepPlan, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor],
                  writes: ParamWrites, started: HandOff | None, synced: Synced, timer: StepTimer) -> None:
        """The previous window's write-back where the plan says, then this step's gradients to the host worker."""
        if plan.writes_previous_window_back:
            # The previous window's result goes into the weights before this step's gradients are handed to the
            # worker: the write-back does not depend on them, and this way its scatter does not compete with the
            # worker's accumulation for cores and memory bandwidth (`close_window` then finds no write-back pending).
            self._host.apply_previous_window(timer)
        if not plan.launches_before_sync:
            self._meter.note(writes.widened_bytes)  # (the device's peak of the step, as in `_launch_before_sync`)
        with timer.phase("handoff"):
            if started is not None:
                self._host.backward.finish(started, synced.coef)
            else:
                self._host.hand_off(entries, grads, synced.coef)

    def _warm_up_step(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | None,
                      schedule: WindowSchedule, timer: StepTimer) -> None:
        """A warm-up step, plain dense AdamW: every matrix column by the host, synchronously (a one-step window);
        1-D parameters on the device."""
        with timer.phase("device_update"):
            device_update(self._split, self._dense, entries, grads, coef, set()).apply()
        with timer.phase("handoff"):
            self._host.hand_off(entries, grads, coef)
        schedule.window_steps += 1
        self._host.close_window(schedule, timer, sequential=True)
        self._host.guard.forget_write_back()  # (plain AdamW, no host multiplier: nothing for the guard to watch)
        self._host.backward.held.submit()  # (only when the close had no host work to fold it into)

    def _close_if_due(self, plan: StepPlan, schedule: WindowSchedule, reads: StepReads, synced: Synced,
                      timer: StepTimer) -> None:
        """This step joins the window, which closes where the plan says (Zen-auto: on this step's votes)."""
        schedule.window_steps += 1
        votes = reads.votes(synced)  # (Zen-auto's statistics take every step's masses)
        if plan.closes_window if plan.closes_window is not None else schedule.window_closes(votes):
            # (folds this step's hand-off into the window's host AdamW job: one pass over the host state)
            self._host.close_window(schedule, timer, sequential=plan.close_waits)
        self._host.backward.held.submit()  # a step that does not close the window: its accumulation job

    def _finish_step(self, schedule: WindowSchedule, timer: StepTimer) -> None:
        """A step taken: counted, the weights marked as the optimizer left them, its telemetry closed."""
        schedule.steps += 1
        self._made_in_backward.clear()
        self._auto_lag.maybe_advise(self.config, schedule, self._host)
        self._mark_weights()
        self._stats.finish_step(timer, staleness=sum(self._host.unapplied_steps) + schedule.window_steps)

    def _frees_next_step(self) -> StepKind | None:
        """The next step's kind when its gradients of offloaded matrices leave the device in backward
        (`free_gradients_in_backward`), else None: one process or FSDP2 ranks (not DDP, whose reducer rewrites the
        gradients after the hooks and keeps its buckets for the run), host window sums, and with "auto" a caller
        that clips through `clip_grad_norm_`. Before the first step (no schedule yet): "on" only."""
        rule = self.config.rules.free_gradients_in_backward
        wanted = rule == "on" or (rule == "auto" and self._clips_through_optimizer)
        if not wanted or self._host.several_ranks() or sums_on_device(self._host.accumulate_on):
            return None
        if self._schedule is None:
            return StepKind.WARM_UP if self.config.full_warm_up_rounds > 0 else StepKind.SELECT
        return self._schedule.kind()

    def _forget_backward_state(self) -> None:
        """The first step is skipped: the state its backward hooks made goes again, so that the step changes
        nothing at all (as when the state is made in `step()`)."""
        if not self._made_in_backward:
            return
        self._host.backward.release()
        for p in self._made_in_backward:
            self._split.pop(p, None)
        self._made_in_backward.clear()
        self._schedule = None
        self._host.accumulate_chosen = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`torch.optim.Optimizer.zero_grad`, and the gradients freed in backward (held on the host for the next
        `step()`) are dropped too."""
        super().zero_grad(set_to_none)
        self._host.backward.release()

    def synchronize(self) -> None:
        """Wait until the host worker is idle and re-raise its failure, if any. Does not change the schedule: a host
        result still waiting for its write-back step (`writeback_lag`) stays pending (it is part of `state_dict()`)."""
        refuse_after_failure(self._host)
        if self._host.worker is not None:
            self._host.worker.synchronize()
        else:
            wait_for_closed_workers()  # a worker closed without waiting (Ctrl-C) may still run its last job

    @torch.no_grad()
    def flush(self) -> None:
        """Close the open window and write every host result into the weights now, so that the model reflects
        every gradient seen. Call it at the end of training; mid-training it shortens the current window."""
        refuse_after_failure(self._host)
        if self._schedule is None:
            return
        self._find_param_shards()
        self._pick_up_outside_changes()
        if self._schedule.window_steps > 0:
            self._host.close_window(self._schedule, StepTimer(), sequential=True)
        self._host.drain_and_apply()
        self._mark_weights()

    def train(self) -> None:
        """HF calls this before every training step: surface a worker failure (waiting here would serialise the host
        step with every training step), and claim the cores again if a `close()` ended the last run, before this
        run's first forward (docs/threads.md); after a `close()`, the backward hooks go back on before it too."""
        self._hook_again()
        self._host.keeper.claim_cores()
        if self._host.worker is not None:
            self._host.worker.check()
        if self.drained_by is None:
            raise RuntimeError(UNDRAINED_MESSAGE)

    def eval(self) -> None:
        """HF calls this before evaluation: wait for the host worker."""
        self.synchronize()

    def close(self) -> None:
        """End of a run: stop the host worker thread once its jobs have run, take the backward hooks off the
        parameters (another optimizer may train them now), unlock pinned host memory and give the training thread its
        cores back (docs/threads.md). The state stays: a later `train()` or `step()` puts the hooks back and starts a
        new worker (that step reads its gradients itself), unless another ZenFlow optimizer has taken the parameters
        over since (see the class docstring): then it refuses."""
        self._host.close()
        if hasattr(self, "_reads"):  # (a constructor that failed early has none)
            self._reads.remove()
            self._hooks_off = True

    def _held(self) -> list[torch.Tensor]:
        """The parameters this optimizer holds (`ownership.py`)."""
        return [p for g in self.param_groups for p in g["params"]]

    def _unapplied_steps(self) -> int:
        """Steps whose host updates are not in the weights yet (the open window, host results awaiting write-back)."""
        if self._schedule is None:
            return 0
        return self._schedule.window_steps + sum(self._host.unapplied_steps)

    def _detach(self, reason: str) -> None:
        """Another optimizer took the parameters over (`ownership.take_over`): closed, hooks off, `step()` refused."""
        self.close()
        self._detached = reason

    def _hook_again(self) -> None:
        """Before a step after `close()`: the backward hooks go back on, unless the parameters were taken over."""
        if self._detached is not None:
            raise RuntimeError(f"ZenFlowAdamW: this optimizer no longer holds its parameters ({self._detached}); "
                               "each parameter is trained by one ZenFlow optimizer at a time. Step the later one, "
                               "or build a new ZenFlowAdamW over the parameters (load_state_dict(old.state_dict()) "
                               "carries this one's state over).")
        if self._hooks_off:
            self._reads.watch(self._held())
            self._hooks_off = False

    @property
    def config(self) -> ZenFlowConfig:
        """The settings in force (`ZenFlowConfig`)."""
        return self._config

    @config.setter
    def config(self, value: ZenFlowConfig) -> None:
        self._config = value
        self._host.config = value

    @property
    def host_windows(self) -> HostWindows:
        """The host side of this optimizer (`engine/windows.py`; also `engine_state.host`): its host worker, the
        ranks its host state is split across (`shards`, `param_shards`), its checkpoint values (`state()`)."""
        return self._host

    @property
    def engine_state(self) -> EngineState:
        """This optimizer's state besides its param groups and settings (`engine/engine_state.py`): each
        parameter's split matrix or dense device state, the host side with the run's schedule, FSDP2's shards, the
        parameters' names and the counters a checkpoint keeps; `state_dict()` and `load_state_dict()` save and
        restore it (`hf_zenflow.checkpoint`)."""
        return self._engine_state

    def __reduce_ex__(self, protocol: object) -> Any:
        """Refused: `copy.deepcopy` and pickle. The optimizer owns a host worker thread, backward hooks on its
        parameters, pinned transfer buffers and state keyed by the parameters themselves; a copy could share none
        of them correctly (torch's `Optimizer.__getstate__` keeps only the param groups, so the copy failed at its
        first step). `state_dict()` / `load_state_dict()` on a new optimizer make an exact, checked copy."""
        raise TypeError("ZenFlowAdamW cannot be copied or pickled (it owns a host worker thread and backward hooks "
                        "on its parameters): build a new ZenFlowAdamW over the target parameters and "
                        "load_state_dict(opt.state_dict()) into it.")

    def __del__(self) -> None:  # noqa: D105
        try:
            self.close()  # (the parameters outlive the optimizer: the hooks come off them)
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass

    def stats(self) -> dict[str, float | str]:
        """Telemetry of the last step (see `telemetry.ZenFlowStats`; ``"accumulate_on"`` is a string)."""
        return optimizer_stats(self._stats, self._schedule, self.config, self._split, self._dense, self._host,
                               self._meter)

    @torch.no_grad()
    def sync_from_weights(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Re-read the fp32 master values from the weights, for `params` (default: every parameter).

        Changes made through the parameters themselves (``model.load_state_dict``, ``param.copy_``, the Trainer's
        ``load_best_model_at_end``, a storage swap) are picked up automatically at the next `step()`, `flush()` or
        `state_dict()`; call this after writing through ``param.data``, which torch does not track. The moments are
        kept (as `torch.optim.AdamW` keeps them when weights are loaded); what was computed from the old weights and
        is not in them yet (a pending host result, the open window's gradient sum) is dropped for these parameters.
        """
        params = list(self._split) + list(self._dense) if params is None else [self._fsdp.local(p) for p in params]
        reread_masters(params, self._split, self._dense, self._host.worker)
        self._mark_weights()

    def _pick_up_outside_changes(self) -> None:
        moved = self._fsdp.moved() if self._fsdp.active else []
        if moved:  # FSDP2 re-allocated shards (model.to(), load_state_dict(assign=True)): the state follows them
            reread_masters(rekey(moved, (self._split, self._dense)), self._split, self._dense,
                           self._host.worker)
        changed = self._weights.changed()
        if changed:
            self._weights.tell_once(len(changed))
            reread_masters(changed, self._split, self._dense, self._host.worker)
            self._mark_weights()

    def _mark_weights(self) -> None:
        self._engine_state.mark_weights()

    def master_weight(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master value of `param` (host columns from the host master, device columns from the device),
        on the host; under FSDP2, of this rank's shard of `param`. Call `synchronize()` first in overlap mode."""
        self._find_param_shards()
        self._pick_up_outside_changes()
        return master_value(self._fsdp.local(param), self._split, self._dense, self._host.shards)

    # ------------------------------------------------------------------------------------------------------------
    # Step internals
    # ------------------------------------------------------------------------------------------------------------
    def _find_param_shards(self, final: bool = False) -> None:
        if self._fsdp.find_once(self.param_groups, self._host.use_param_shards, final):
            # accelerate swapped FSDP2's DTensors in after __init__: nothing may keep the whole parameters it
            # replaced alive (their names, the backward hooks on them)
            current = [p for g in self.param_groups for p in g["params"]]
            kept = {id(p) for p in current}
            names = self._engine_state.names
            self._engine_state.names = {p: n for p, n in names.items() if id(p) in kept}
            self._reads.remove()
            self._reads = GradientReads([] if self._hooks_off else current)
            self._reads.on_ready = self._host.backward.grad_ready
            self._state.group_of = {p: g for g in self.param_groups for p in g["params"]}
            self._meter = DeviceMemoryMeter(current, self._meter.state_bytes, in_flight=self._meter.in_flight)
            self._reads.meter = self._host.meter = self._meter
            self._reads.on_arrival = self._host.backward.regather
            self._reads.defers_norm = self._host.backward.defers_norm
            self._reads.copies_out = self._host.backward.copies_out
            self._reads.reduced_later = lambda host=self._host: host.shards.ranks > 1
            # (FSDP2's ranks free their shards from the next step on; ``accumulate_on="auto"``, deciding in this
            # step, weighs that)
            self._host.backward.free_kind = self._frees_next_step()

    @property
    def _schedule(self) -> WindowSchedule | None:
        """The run's schedule (None before the first step), kept by the host side (`HostWindows.schedule`), where
        the backward hooks that make the first step's state find it."""
        return self._host.schedule

    @_schedule.setter
    def _schedule(self, value: WindowSchedule | None) -> None:
        self._host.schedule = value

    def _ensure_schedule(self) -> WindowSchedule:
        return self._state.ensure_schedule()

    def _limit_choice(self) -> LimitChoice:
        """`device_memory_limit_bytes`'s choice of the run's `min_offload_numel` (`StateMaker.limit_choice`)."""
        return self._state.limit_choice()

    def _copies_lag(self) -> bool:
        """Whether the copies of gradients to the host may lag backward (`HostWindows.copies_lag`)."""
        return self._host.copies_lag()

    def _offload_threshold(self) -> int:
        """The run's `min_offload_numel`, before the schedule exists too (`StateMaker.offload_threshold`)."""
        return self._state.offload_threshold()

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
        self._find_param_shards()
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
        drop_failed_worker(self._host) or self.synchronize()  # (a failed worker's state is replaced: no wait)
        self._find_param_shards()
        self._host.backward.release()  # (gradients freed in a backward before the load belong to the old state)
        checkpoint.load(self, state_dict)
        self.loaded_progress = checkpoint.saved_progress(state_dict)
        self._host.backward.free_kind = self._frees_next_step()  # (the restored schedule's next step)

    def name_parameters(self, named: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module) -> None:
        """Record parameter names (e.g. ``model.named_parameters()``, or the model): checkpoints then carry them and
        error messages name the parameter. Parameters passed as ``(name, param)`` pairs are named already."""
        pairs = named.named_parameters() if isinstance(named, torch.nn.Module) else named
        mine = {p for g in self.param_groups for p in g["params"]}
        self._engine_state.names.update({p: name for name, p in pairs if p in mine})
