"""The order of one `ZenFlowAdamW` step, after `step()` has taken the worker (`StepSequence._step`):

1. one read of every gradient (norms, Zen-auto's masses, the selected columns on an ordinary step);
2. an ordinary step launches its device update and the hand-off to the host before it waits;
3. the step's one device->host sync (the non-finite check, the clip coefficient); warm-up, selection and matrices
   waiting for columns decide on those numbers first, then update;
4. the previous window's host result is written back when the schedule says (``writeback_lag`` steps into the
   window), this step's gradients go to the host, and the window closes on schedule (its host AdamW submitted).

`StepSequence` is mixed into `ZenFlowAdamW` (`zenflow.py`), whose parts (`_host`, `_split`, `_dense`, `_reads`, the
schedule, the stats) it drives.
"""

from __future__ import annotations

import torch

from ..engine import amp
from ..engine.device_budget import announce_limit
from ..engine.device_step import ParamWrites, device_update
from ..engine.gradients import read_gradients
from ..engine.handoff import HandOff
from ..engine.offload_report import announce_offload
from ..engine.params import announce_high_lr_rule, create_state
from ..engine.reselection import reselect, select_waiting
from ..engine.schedule import StepKind
from ..engine.telemetry import StepTimer


class StepSequence:
    """`ZenFlowAdamW._step`: one step in the order the module docstring gives."""

    def _step(self, loss: float | None) -> float | None:
        timer = StepTimer()
        unscale, found_inf = amp.scaler_args(self)  # (called by `GradScaler.step`)
        if unscale is not None or found_inf is not None:
            self._note_scaler()
        # what `clip_grad_norm_` measured, keyed by the gradients it saw (a freed gradient's stand-in)
        measured_on = {p: f.stand_in for p, f in self._host.freed.items()}
        if self._host.freed and (self._host.accumulate_on != "host"
                                 or self._ensure_schedule().kind() is not self._host.free_kind):
            # the step needs whole gradients after all (a re-selection forced by a resume or a changed setting):
            # the freed ones come back from the host, the same values
            self._host.restore_freed()
        freed = self._host.freed  # gradients freed in backward: their stand-ins take their place below
        entries = [(group, p) for group in self.param_groups for p in group["params"]
                   if p.grad is not None or self._fsdp.local(p) in freed]
        if not entries:
            return loss
        for _, p in entries:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError("ZenFlowAdamW does not support sparse gradients")
        entries, grads = self._fsdp.entries(entries)  # (FSDP2: this rank's shards; else unchanged)
        grads = [freed[p].stand_in if p in freed else g for (_, p), g in zip(entries, grads)]
        cached_norms, cached_total, clip = self._norm_cache.take([measured_on.get(p, g)
                                                                  for (_, p), g in zip(entries, grads)])
        first = self._schedule is None or (self._schedule.steps == 0 and bool(self._made_in_backward))
        if first and found_inf is not None and not self._fsdp.active and found_inf.item():
            # Sync point (first step only, which waits for its scalars before any update anyway): the very first
            # step overflowed (a GradScaler starting too high does this a few times); it is skipped before any state
            # exists, so that it changes nothing at all (state its backward hooks made goes again). (Not under
            # FSDP2, where each rank's flag covers its own shards only: there the step's all-reduced norm makes
            # every rank skip alike, after creating the state.)
            self._forget_backward_state()
            self._stats.skip_step(timer, steps=0)
            return loss
        schedule = self._ensure_schedule()
        self._pick_up_outside_changes()
        create_state(entries, self._split, self._dense, self.config, schedule, self._host.attach_host,
                     self._fsdp if self._fsdp.active else None)
        self._auto_lag.maybe_choose(self.config, schedule, self._host)  # (first step: from the host columns' sizes)
        announce_high_lr_rule(schedule, self.config, self.param_groups)
        announce_offload(self.param_groups, self.config, schedule)
        if schedule.limit_min_offload_numel is not None and not schedule.limit_announced:
            schedule.limit_announced = True  # (once per run: a resumed run says what it restored)
            announce_limit(self.param_groups, self.config, schedule.limit_min_offload_numel,
                           self._host.free_kind is not None, self._host.accumulate_on)

        # ---- 1. one read of every gradient ------------------------------------------------------------------------
        kind = schedule.kind()
        warm_up, selecting = kind is StepKind.WARM_UP, kind is StepKind.SELECT
        gather_now = kind is StepKind.ORDINARY
        with timer.phase("norms"):
            reads = read_gradients(self._split, self._reads, entries, grads, (cached_norms, cached_total, clip),
                                   gather_now, auto=self.config.is_auto_interval, ranks=self._host.param_shards,
                                   unscale=unscale, found_inf=found_inf,
                                   gathered_already=set(freed) if gather_now else None)
        total, gathered, clip = reads.total, reads.gathered, reads.clip  # (clip: with the scaler's 1 / scale)
        # the inverse scale on the copies made in backward before a GradScaler's unscale_ (read in the sync below)
        copies_factor = self._host.early.factor if self._host.early is not None else None

        # ---- 2. an ordinary step launches its device work before it waits -------------------------------------
        # The fused AdamW takes the non-finite flag as a device tensor and changes nothing when it is set, so the
        # update need not wait for the check: the device computes while the host waits below. (Warm-up, selection
        # and matrices waiting for columns decide on host numbers first: they take the sync-first path.)
        early = schedule.launches_before_sync(waiting_for_columns=bool(reads.waiting))
        started: HandOff | None = None
        writes: ParamWrites | None = None
        try:
            rewritten = False
            if early:
                bad = ~torch.isfinite(total) if clip is None else ~(torch.isfinite(total) & torch.isfinite(clip))
                rewritten = schedule.boundary_writes_back(self.config.overlap_step, self._host.writeback_pending)
                with timer.phase("device_update"):
                    # (the masters only: the parameters receive them after the check below, a skipped step
                    # leaves them untouched)
                    writes = device_update(self._split, self._dense, entries, grads, clip, gathered,
                                           rewritten=rewritten, found_inf=bad.float())
                # (the device's peak of the step: every gradient still held, the state updated, and the widened
                # copies of the gathered gradients the update held at its peak)
                self._meter.note(writes.widened_bytes)
                with timer.phase("handoff"):
                    started = self._host.start_hand_off(entries, grads)

            # ---- 3. the one device->host sync of the step ---------------------------------------------------------
            with timer.phase("norms"):
                # Sync point, the only one of an ordinary step: the caller waits for the backward pass (and the norms)
                # to finish and reads a few scalars (`StepReads.sync`).
                synced = reads.sync(clipped=clip is not None, entries=len(entries), copies_factor=copies_factor)
                self._host.copies_factor = synced.copies_factor
            if not synced.finite:
                if started is not None:
                    self._host.abandon_hand_off(started)
                self._stats.skip_step(timer, steps=schedule.steps)
                return loss
            coef = synced.coef
            if writes is not None:
                writes.apply()
            if not warm_up:
                # the first gradient after a write-back tells whether the host result overshot (`host_guard.py`);
                # this step's own write-back, below, comes after
                self._host.guard.observe(synced.total, schedule.steps, self.config.host_step_guard)

            if warm_up:
                self._meter.note()  # (the state exists; the gradients are still held)
                self._host.warm_up_step(entries, grads, coef, timer, schedule, self._dense)
            else:
                if not early:
                    with timer.phase("select"):
                        if selecting:
                            gathered |= reselect(self._host, self._schedule, entries, grads)
                        else:
                            select_waiting(self._host, entries, grads, synced.waiting_norms)
                    rewritten = schedule.boundary_writes_back(self.config.overlap_step, self._host.writeback_pending)
                    with timer.phase("device_update"):
                        writes = device_update(self._split, self._dense, entries, grads, coef, gathered,
                                               rewritten=rewritten)
                        writes.apply()
                if rewritten and self.config.overlap_step:
                    # The previous window's result goes into the weights before this step's gradients are handed to
                    # the worker: the write-back does not depend on them, and this way its scatter does not compete
                    # with the worker's accumulation for cores and memory bandwidth (`close_window` then finds no
                    # write-back pending).
                    self._host.apply_previous_window(timer)
                if not early:
                    self._meter.note(writes.widened_bytes)  # (the device's peak of the step, as above)
                with timer.phase("handoff"):
                    if started is not None:
                        self._host.finish_hand_off(started, coef)
                    else:
                        self._host.hand_off(entries, grads, coef)
                schedule.window_steps += 1
                if schedule.window_closes(reads.votes(synced)):
                    # (folds this step's hand-off into the window's host AdamW job: one pass over the host state)
                    self._host.close_window(self._schedule, timer, sequential=not self.config.overlap_step)
                self._host.held.submit()  # a step that does not close the window: its accumulation job
        except BaseException:
            self._host.held.abandon(self._host.abandon_hand_off)
            # an interrupt (Ctrl-C) or a failure between taking a hand-off slot and submitting its job must not leak
            # the slot: the next step would wait for it forever
            if started is not None and not started.done:
                self._host.abandon_hand_off(started)
            raise
        schedule.steps += 1
        self._made_in_backward.clear()
        self._host.reserved_ahead = False  # (later host state reserves its own buffers)
        self._auto_lag.maybe_advise(self.config, schedule, self._host)
        self._mark_weights()
        self._stats.finish_step(timer, staleness=sum(self._host.unapplied_steps) + schedule.window_steps)
        return loss


__all__ = ["StepSequence"]
