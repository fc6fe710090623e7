"""The host side of a ZenFlow step: hand-offs, windows and write-backs, and the worker that runs the host jobs.

`HostWindows` gives each step's gradients of the offloaded matrices to the host (or, with
``accumulate_on="device"`` or ``"device_bf16"``, adds them into device-side window sums), closes windows by
submitting the host AdamW, and writes host results back into the weights when the schedule says: at once
(``overlap_step=False``) or ``writeback_lag`` steps into the next window, while the device trains on (closing and
writing back: `window_close.py`). What crosses the link goes through a `Transport` per device type; the host jobs run
in order on one `HostAdamWorker`. With several data-parallel ranks each rank's host side covers its share of every
matrix, and the write-back all-gathers the shares (`distributed/sharding.py`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..distributed.replica_check import note_host_split
from ..distributed.sharding import RankGroup
from ..settings.config import ZenFlowConfig, sums_on_device
from ..settings.threads import claim_cores, release_cores
from ..transport import Landed, Transport, transport_for
from ..transport.cpu_device.transport import CpuShardTransport
from . import accumulation
from .device_state import DenseDeviceState
from .device_step import device_update
from .handoff import EarlyCopies, FreedGradient, HandOff, local_grad, non_finite, set_grad
from .held_handoff import HeldHandOff
from .host import HostLayout, HostMatrix, accumulate_into, link_grad_dtype
from .host_guard import HostStepGuard
from .host_lr import LrScaleRecord
from .params import is_split
from .schedule import StepKind, WindowSchedule
from .selection import num_selected
from .split_matrix import SplitMatrix, selection_scores
from .telemetry import StepTimer, ZenFlowStats
from .window_close import WindowCloses
from .worker import HostAdamWorker, HostWorkerError, cuda_device_of


__all__ = ["EarlyCopies", "HandOff", "HostWindows"]


class HostWindows(WindowCloses):
    """The host side of one `ZenFlowAdamW` (see the module docstring). `splits` and `groups` are the optimizer's
    own (live) collections; `config` is kept current by the optimizer."""

    def __init__(self, splits: dict[torch.Tensor, SplitMatrix], groups: list[dict[str, Any]], config: ZenFlowConfig,
                 stats: ZenFlowStats, host_executor: str, process_group: Any = None) -> None:
        self.splits, self.groups, self.config, self.stats = splits, groups, config, stats
        self.host_executor = host_executor
        self.process_group = process_group
        self._shards: RankGroup | None = None
        #: FSDP2's mesh when the parameters are sharded DTensors (`distributed/fsdp.py`): each rank's host state holds
        #: its local rows, nothing is shared across ranks, and per-rank partial sums are summed over this group instead
        self.param_shards: RankGroup | None = None
        self.worker: HostAdamWorker | None = None
        #: the failure of a worker stopped after it failed: the host state may be partly updated (`stop_worker`)
        self.failure: HostWorkerError | None = None
        self.transports: dict[str, Transport] = {}  # by device type
        self.pending: Any = None  # Future of the host step whose result awaits write-back (overlap mode)
        self.writeback_pending = False
        self.unapplied_steps: list[int] = []  # sizes of windows submitted but not yet written back
        self.early: EarlyCopies | None = None
        # Several devices in one process (``device_map="auto"``) run backward on one autograd thread each, so
        # `grad_ready` runs in several threads at once: taking the step's hand-off slot (and starting the worker)
        # is a check-then-act that must happen once, under this lock.
        self._early_lock = threading.Lock()
        #: whether the parameters will have host state (`params.offloads_any`, set by the optimizer): only then a
        #: background worker starts and the thread rule claims cores for it
        self.offload_planned, self._claimed = False, False
        self.held = HeldHandOff()  # this step's hand-off until the step knows whether it closes the window
        #: ``accumulate_on="auto"``'s choice, made when the first host state is created (`accumulation.py`)
        self.accumulate_chosen: str | None = None
        #: the host step's learning-rate multiplier of the last full window (`stats()["host_lr_scale"]`)
        self.lr_scale = LrScaleRecord()
        #: `host_step_guard`: the watch on each write-back and the host lr's factor it keeps
        self.guard = HostStepGuard()
        #: the kind of the coming step when its gradients of offloaded matrices may be freed in backward, else None
        #: (`may_free`; set by the optimizer from `free_gradients_in_backward` and the schedule)
        self.free_kind: StepKind | None = None
        #: a GradScaler is in use: each gradient freed in backward has its overflow check made in its hook
        self.checks_overflow = False
        #: creates a matrix's state in its first backward hook (the first step, so that it can be freed too), or
        #: None (set by the optimizer)
        self.create_in_backward: Callable[[torch.Tensor], SplitMatrix | None] | None = None
        #: the thread that may start the worker from a backward hook (the optimizer's; not a device's autograd thread)
        self._home_thread = threading.current_thread()
        self._create_lock = threading.Lock()
        #: this step's `Synced.copies_factor` (the inverse scale on the copies made before ``unscale_``), set after
        #: the step's sync
        self.copies_factor: float | None = None
        #: the first step's link buffers were reserved at once when its state is made in the backward hooks
        self.reserved_ahead = False
        #: the device's peak so far, for ``device_memory_limit_bytes`` (`accumulation.decide`; set by the optimizer)
        self.device_peak: Callable[[], int] = lambda: 0
        #: under ``device_memory_limit_bytes``, what the step holds beside the device sums of "auto" and what they
        #: keep (`device_budget.PeakEstimate.beside_window_sums`; 0 without a limit; set by the optimizer)
        self.limit_peak: Callable[[], int] = lambda: 0

    @property
    def accumulate_on(self) -> str | None:
        """Where windows are summed: the explicit setting, or "auto"'s choice (None before it is made)."""
        return self.accumulate_chosen if self.config.accumulate_on == "auto" else self.config.accumulate_on

    def reset(self) -> None:
        """Forget every window in flight (the optimizer's state is being replaced; the worker is idle). The
        transports go too, their pinned blocks unlocked now: a reload never keeps two copies page-locked."""
        self.pending, self.writeback_pending, self.unapplied_steps = None, False, []
        self.guard = HostStepGuard()
        self.release_early()
        self.close_transports()
        self.transports.clear()
        self.stats.device_clocks.clear()

    def stop_worker(self) -> None:
        """Stop the worker thread only (a later step starts a new one, e.g. with other settings); the run goes on:
        the cores stay claimed and the pinned link buffers stay pinned."""
        self.release_early()
        worker, self.worker = self.worker, None
        if worker is not None:
            if worker.failed and self.failure is None:
                try:
                    worker.check()
                except HostWorkerError as failure:
                    self.failure = failure
            worker.close()

    def close_transports(self) -> None:
        for transport in self.transports.values():
            transport.close()

    def close(self) -> None:
        """The end of a run: stop the worker, unlock the pinned link buffers (a later step starts a new worker and
        works on ordinary memory, with synchronous copies) and give the training thread its cores back
        (`threads.release_cores`)."""
        self.stop_worker()
        self.close_transports()
        if self._claimed:
            self._claimed = False
            release_cores(self)

    def claim_cores(self) -> None:
        """The thread rule's once-per-run decision (`threads.claim_cores`), when a background worker is planned.
        Idempotent; called when the optimizer is built and before each training step (before any forward)."""
        if not self._claimed and self.offload_planned and self._background():
            self._claimed = True
            claim_cores(self, self.config.resolved_cpu_threads)

    def _background(self) -> bool:
        return self.config.overlap_step and self.host_executor == "thread"

    @property
    def shards(self) -> RankGroup:
        """The ranks sharing the host work, found at first use (the process group may start after the optimizer).
        One rank under FSDP2, where each rank's parameters are already its own rows."""
        if self._shards is None:
            self._shards = RankGroup() if self.param_shards is not None else RankGroup.of(self.process_group)
        return self._shards

    def several_ranks(self) -> bool:
        """Whether several ranks share the host work, without fixing `shards` before the process group starts."""
        if self._shards is not None:
            return self._shards.ranks > 1
        return self.param_shards is None and RankGroup.of(self.process_group).ranks > 1

    @property
    def reduce_group(self) -> RankGroup:
        """The ranks over which per-rank partial sums (selection scores, gradient sums of squares) are summed: the
        FSDP2 mesh, or the ranks sharing the host work under DDP."""
        return self.param_shards if self.param_shards is not None else self.shards

    def use_param_shards(self, group: RankGroup) -> None:
        """The parameters are FSDP2 shards over `group` (before the first step's state exists)."""
        self.param_shards, self._shards = group, RankGroup()

    def ensure_worker(self) -> HostAdamWorker:
        """The host worker: a thread when the schedule overlaps and something is offloaded (planned, or host state
        exists after all: an inline worker then gives way, it has nothing in flight); otherwise inline, no thread."""
        worker = self.worker
        if worker is None or (not worker.background and self.early is None and self._wants_thread()):
            self.claim_cores()  # (a run continued after `close()`: the same claim again)
            note_host_split(self.reduce_group.ranks, self.process_group)  # (once per process)
            self.worker = HostAdamWorker(self.config.resolved_cpu_threads, background=self._wants_thread(),
                                         cuda_device=cuda_device_of(p for g in self.groups for p in g["params"]))
        return self.worker

    def _wants_thread(self) -> bool:
        return self._background() and (self.offload_planned or any(s.host is not None for s in self.splits.values()))

    def transport_of(self, split: SplitMatrix) -> Transport:
        kind = split.param.device.type
        if kind not in self.transports:
            # An FSDP2 shard is a view into FSDP2's flat sharded storage, from which it all-gathers the weights:
            # the write-back must copy into it (the CPU device's storage swap would detach the view); its gradients
            # are read in place like any CPU device's
            shard = self.param_shards is not None and kind == "cpu"
            self.transports[kind] = CpuShardTransport() if shard else transport_for(split.param.device)
            self.stats.device_clocks.append(self.transports[kind].take_device_ms)  # (`writeback_device_ms`)
        return self.transports[kind]

    def _decide(self, splits: list[SplitMatrix], shares: dict) -> None:
        self.accumulate_chosen = accumulation.decide(self.config, splits, shares, self.reduce_group,
                                                     peak=max(self.device_peak(), self.limit_peak()),
                                                     frees_gradients=self.free_kind is not None)

    def prepare_first_state(self, entries: list[tuple[dict, torch.Tensor]], schedule: WindowSchedule) -> None:
        """Before the first step's state is made in its backward hooks (`HostWindows.grad_ready`), for the matrices
        of `entries` that will have host state: ``accumulate_on="auto"``'s choice over all of them, and their link
        buffers' reservation."""
        splits = []
        for group, p in entries:
            if is_split(p, group, self.config, min_numel=schedule.offload_threshold(self.config)):
                split = SplitMatrix(p, 0, rows=bool(group.get("select_rows", False)))
                split.k = num_selected(self.config.topk_ratio, split.columns)
                if split.offloaded or schedule.in_warm_up():
                    splits.append(split)
        if not splits:
            return
        shares = {id(s): self.shards.share(1 - s.axis, s.matrix(s.param).shape[1 - s.axis]) for s in splits}
        if self.accumulate_on is None:
            self._decide(splits, shares)
        # the link buffers of every matrix in one reservation per transport (one pinned block, as when the state is
        # made in `step()`); the matrices' `attach_host` calls in their hooks then take from it
        for transport, group in self.by_transport(splits):
            transport.reserve(sum(HostMatrix.link_bytes(
                shares[id(s)].local(s.matrix(s.param)), link_grad_dtype(s.grad_dtype, self.config.host_grad_dtype),
                self.accumulate_on, transport, HostLayout.of(self.config)) for s in group))
        self.reserved_ahead = True

    def attach_host(self, splits: list[SplitMatrix]) -> None:
        """Create the host state of `splits`, their link buffers from one reservation per transport."""
        shares = {id(s): self.shards.share(1 - s.axis, s.matrix(s.param).shape[1 - s.axis]) for s in splits}
        if self.accumulate_on is None and splits:
            # "auto" decides at the first host state: the first step's gradients exist (its forward and backward
            # have run), and every rank creates its first host state at the same step
            self._decide(splits, shares)
        accumulate_on = self.accumulate_on
        linked = {id(s): link_grad_dtype(s.grad_dtype, self.config.host_grad_dtype) for s in splits}
        layout = HostLayout.of(self.config)
        for transport, group in self.by_transport(splits):
            if not self.reserved_ahead:  # (`decide_accumulation` reserved for the first step's matrices)
                transport.reserve(sum(HostMatrix.link_bytes(shares[id(s)].local(s.matrix(s.param)), linked[id(s)],
                                                            accumulate_on, transport, layout) for s in group))
            for split in group:
                split.attach_host(accumulate_on, transport, shares[id(split)], linked[id(split)], layout)

    def hand_off(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | None,
    ) -> None:
        """Give this step's gradients of the offloaded matrices to the host worker, which adds them to the window
        (`start_hand_off` then `finish_hand_off`)."""
        started = self.start_hand_off(entries, grads)
        if started is not None:
            try:
                self.finish_hand_off(started, coef)
            except BaseException:
                if not started.done:
                    self.abandon_hand_off(started)
                raise
        elif sums_on_device(self.accumulate_on):
            work = self.offloaded(entries, grads)
            if work:
                self.accumulate_on_device(work, coef)

    def offloaded(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor]
                   ) -> list[tuple[SplitMatrix, torch.Tensor]]:
        return [(self.splits[p], g) for (_, p), g in zip(entries, grads)
                if p in self.splits and self.splits[p].host is not None]

    def start_hand_off(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor]
                        ) -> HandOff | None:
        """Take a hand-off slot and start moving the offloaded matrices' gradients to the host (CUDA: a copy on a
        side stream into pinned memory, which the worker will wait for; CPU device: nothing to move, the worker
        reads the gradient tensors). Blocks (a stall) only while the worker is `GRAD_SLOTS` steps behind. None when
        nothing goes to the host worker this step (``accumulate_on="device"`` sums on the device instead)."""
        if sums_on_device(self.accumulate_on):
            return None
        work = self.offloaded(entries, grads)
        if not work:
            return None
        with self._early_lock:  # (backward has returned: no hook still adds to it)
            early, self.early = self.early, None
        grant = early.grant if early is not None else self.worker.take_slot()
        try:
            sources: list[tuple[HostMatrix, torch.Tensor]] = []
            scaled: list[tuple[HostMatrix, torch.Tensor]] = []
            landed, todo = Landed(), []
            for split, g in work:
                seen = early.copies.get(split.param) if early is not None else None
                if seen is not None and seen[0]() is g and seen[1] == g._version:
                    # copied in backward, and unchanged since (but for a GradScaler's unscale_: then still scaled)
                    (scaled if early.factor is not None else sources).append((split.host, seen[2]))
                    landed.events += seen[3].events
                else:
                    todo.append((split, g))
            if todo:
                # (counted where a copy starts: a copy from backward that the step throws away counted too)
                self.stats.bytes_to_host += sum(s.host_part(g).numel() * s.host.grad_dtype.itemsize for s, g in todo)
                more, arrived = self._sources(todo, grant.slot)
                sources += more
                landed.events += arrived.events
            if not self.worker.background:
                # Sequential schedule (``overlap_step=False``, or the inline executor): the job that reads these
                # gradients runs right after the step's sync, in this thread. Ordering the compute stream after
                # their copies lets that one sync cover them too, instead of a second host wait in the job.
                for transport in self.transports.values():
                    transport.compute_waits_for(landed)
        except BaseException:
            grant.give_back()
            raise
        return HandOff(grant, work, sources, landed, scaled=scaled)

    def grad_ready(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
        """Backward has finished `p`'s gradient (a `GradientReads` hook): on a transport that copies (CUDA), start
        its copy to the host now, so that it overlaps the rest of backward instead of following `step()`'s sync.
        The first such gradient of a step takes the hand-off slot (a stall only while the worker is two steps
        behind); `start_hand_off` keeps the copies whose gradient has not changed since, and copies the rest.

        When the gradient may be freed (`may_free`), on any transport: the selected columns are gathered into the
        device columns' buffer, the whole gradient goes to the host, and ``p.grad`` is set to None. Returns the
        stand-in that `step()` then sees for it (an empty tensor of the gradient's dtype and device, `FreedGradient`),
        or None when the gradient stays."""
        if sums_on_device(self.accumulate_on):
            return None
        split = self.splits.get(p)
        if split is None and self.free_kind is not None and self.create_in_backward is not None:
            # (the first step: its state now, so that its gradient can go; once at a time, as devices' autograd
            # threads may get here together)
            with self._create_lock:
                split = self.splits.get(p) or self.create_in_backward(p)
            if sums_on_device(self.accumulate_on):  # ("auto" decided just now)
                return None
        if split is None or split.host is None:
            return None
        transport = self.transport_of(split)
        free = self.may_free(split, g)
        if not (free or transport.stages_gradients):
            return None
        if free and self.worker is None and threading.current_thread() is self._home_thread:
            self.ensure_worker()  # (the first step, whose gradients are freed: the worker starts in its backward)
        with self._early_lock:
            if self.early is None:
                if self.worker is None:
                    # (after `close()`) never started here: it would take this autograd thread for the training
                    # thread whose cores it shares (`settings/threads.py`); `step()` starts it and copies this step's
                    # grads.
                    return None
                self.early = EarlyCopies(self.worker.take_slot())
            early = self.early
        ((_, source),), landed = transport.hand_off([(split, g)], early.grant.slot)
        with self._early_lock:  # two devices' autograd threads may count at once (`+=` is not atomic)
            self.stats.bytes_to_host += split.host_part(g).numel() * split.host.grad_dtype.itemsize
        if not free:
            early.copies[p] = (weakref.ref(g), g._version, source, landed)
            return None
        scores, gathered = None, False
        if self.free_kind is StepKind.SELECT:
            # a re-selection ranks the columns by this gradient: their scores stay on the device (one float per
            # column), the same computation `reselection.select_columns` makes
            scores = selection_scores(split, g)
        elif split.device is not None:
            # The selected columns stay on the device for their update (read from `g` on the compute stream before
            # it goes; CUDA: the copy to the host reads `g` on the side stream, which `record_stream` protects)
            split.device.gather_grad(split.matrix(g))
            gathered = True
        # a GradScaler's overflow check reads ``p.grad``, which will not hold this gradient: the check is made here
        overflow = non_finite(g) if self.checks_overflow else None
        if g.is_cuda:
            # (the reads above ran on the current stream; under FSDP2 `g` is a view of the reduce-scatter output,
            # whose memory may go with it: not reused before they have run)
            g.record_stream(torch.cuda.current_stream(g.device))
        stand_in = g.new_empty(0)
        early.copies[p] = (weakref.ref(stand_in), stand_in._version, source, landed)
        early.freed[p] = FreedGradient(stand_in, source, landed, g.shape, g.stride(), scores, gathered, overflow)
        split.owner.grad = None  # the device's memory for this gradient goes now
        return stand_in

    def may_free(self, split: SplitMatrix, g: torch.Tensor) -> bool:
        """Whether `split`'s gradient `g` leaves the device in its backward hook: freeing is on for the coming step
        (`free_kind`), the matrix's device update then needs at most its selected columns (an ordinary step: the
        matrix has its columns, or none are selected, k=0; warm-up: the host updates every column; a re-selection:
        the column scores, and the new columns' gradient comes back from the host), and the gradient crosses the
        link in its own dtype (so that it can come back exactly, `regather`). Under FSDP2 `g` is this rank's shard
        of the reduce-scattered gradient, and the DTensor's ``.grad`` goes."""
        kind = self.free_kind
        if kind is None or split.host is None or split.host.grad_dtype != g.dtype:
            return False
        if kind is StepKind.ORDINARY:
            return split.device is not None or split.k == 0
        return kind is StepKind.SELECT or split.device is None

    def copies_out(self, p: torch.Tensor) -> bool:
        """Whether `p`'s FSDP2 gradient shard, which stays on the device this step, should be copied out of the
        reduce-scatter output it is a view of: FSDP2 cuts every gradient of a module group from one output buffer,
        which is released only when none of them is left, so the small gradients that stay (1-D parameters, matrices
        kept whole on the device) must not hold it while the offloaded matrices' gradients leave (`may_free`)."""
        split = self.splits.get(p)
        return self.param_shards is not None and self.free_kind is not None and (split is None or split.host is None)

    @property
    def freed(self) -> dict[torch.Tensor, FreedGradient]:
        early = self.early
        return early.freed if early is not None else {}

    @torch.no_grad()
    def regather(self, p: torch.Tensor) -> None:
        """A gradient of `p` arrived while an earlier one of this step was freed (micro-batches of a plain loop):
        the freed one comes back from the host and the new one is added to it, in place, so that ``p.grad`` holds
        their sum as autograd would have made it (the same additions; exact, since the host copy is in the
        gradient's dtype). The sum is then read (and freed) like any gradient."""
        early = self.early
        freed = early.freed.pop(p, None) if early is not None else None
        if freed is None:
            return
        early.copies.pop(p, None)
        split = self.splits[p]
        freed.landed.wait()  # Sync point (micro-batches only): the freed gradient has landed on the host
        previous = freed.restore(split, p.device)
        local_grad(split.owner).add_(previous)

    @torch.no_grad()
    def restore_freed(self) -> None:
        """Every freed gradient of this step back into ``p.grad`` (the step turned out to need whole gradients: a
        re-selection or a setting changed between backward and `step()`), unscaled where a GradScaler's
        ``unscale_`` ran after its hook (`FreedGradient.factor`). The early copies go too: the step hands the
        restored gradients off again."""
        early = self.early
        if early is None or not early.freed:
            return
        for p, freed in list(early.freed.items()):
            freed.landed.wait()  # Sync point (rare): the freed gradient has landed on the host
            set_grad(self.splits[p].owner, freed.restore(self.splits[p], p.device))
        early.freed.clear()
        early.copies.clear()

    @torch.no_grad()
    def unscale_freed(self, factor: torch.Tensor) -> None:
        """A GradScaler's ``unscale_`` multiplied every gradient in ``p.grad`` by `factor`: the gradients freed in
        backward follow without coming back. The selected columns their hooks gathered are multiplied now (the
        scaler's arithmetic on those elements: exact for its powers of two); their host copies keep the scale and
        carry `factor` (the host adds them times it, `scale_early_copies`; a restore or a re-selection's gather
        from them applies it)."""
        early = self.early
        if early is None:
            return
        for p, freed in early.freed.items():
            freed.factor = factor
            if freed.gathered:
                cols = self.splits[p].device.grad
                cols.mul_(factor.to(cols.device))

    def scale_early_copies(self, factor: torch.Tensor) -> None:
        """The gradients were multiplied by `factor` in place without a version bump (`GradScaler.unscale_`): the
        copies the hooks started hold the values before (`order_after_early_copies` made the rewrite wait for
        them), so the host multiplies them by `factor` when it adds them (exact for the scaler's powers of two)
        instead of copying every gradient again."""
        if self.early is not None:
            self.early.factor = factor

    def order_after_early_copies(self) -> None:
        """Sync point (device streams only): the compute stream waits for the copies the hooks started, so that an
        in-place rewrite of the gradients that follows (``unscale_``) runs after they have read them."""
        early = self.early
        if early is None:
            return
        landed = Landed([e for *_, arrived in early.copies.values() for e in arrived.events])
        for transport in self.transports.values():
            transport.compute_waits_for(landed)

    def forget_early_copies(self) -> None:
        """The gradients were rewritten in place without a version bump (`GradScaler.unscale_`): the copies the
        hooks started may hold the old values, so `start_hand_off` copies again. It keeps the slot: on CUDA the new
        copies go on the same side stream into the same buffers, after the old ones (stream order), and after the
        rewrite (the side stream waits for the compute stream, `CudaTransport._copying`); the old copies may have
        raced the rewrite, but what they read is never used."""
        if self.early is not None:
            self.early.copies.clear()

    def release_early(self) -> None:
        """Give back the slot of copies started in backward that no `step()` used (skipped step, reset, close)."""
        with self._early_lock:
            early, self.early = self.early, None
        if early is not None:
            early.grant.give_back()

    def abandon_hand_off(self, started: HandOff) -> None:
        """The step was skipped: no job, the slot goes back (a copy already enqueued into its buffers runs on the
        side stream before any later copy into them)."""
        started.done = True
        started.grant.give_back()

    def finish_hand_off(self, started: HandOff, coef: float | None) -> None:
        """The handed-off gradients (times `coef`) go to the worker: held until the step knows whether it closes
        the window, whose host AdamW job then takes them (`held_handoff.py`)."""
        if any(g._base is not None for _, g in started.work):
            # A gradient that is a view of storage its owner keeps and writes again (DDP's gradient_as_bucket_view:
            # the reducer writes the next backward's gradients into the same bucket on the compute stream):
            # `record_stream` cannot protect it, since it is never freed. Sync point (device streams only): the
            # compute stream waits for the copies to the host before any later work, the next backward included.
            for transport in self.transports.values():
                transport.compute_waits_for(started.landed)
        for split, _ in started.work:
            split.owner.grad = None  # the worker owns this gradient now (FSDP2: the DTensor's, else it accumulates)
        started.work.clear()
        self.held.hold(started, coef, self.copies_factor)

    def _sources(self, work: list[tuple[SplitMatrix, torch.Tensor]], slot: int
                          ) -> tuple[list[tuple[HostMatrix, torch.Tensor]], Landed]:
        sources: list[tuple[HostMatrix, torch.Tensor]] = []
        landed = Landed()
        for transport, group in self.by_transport([split for split, _ in work]):
            mine = {id(split) for split in group}
            part, arrived = transport.hand_off([(s, g) for s, g in work if id(s) in mine], slot)
            sources += part
            landed.events += arrived.events
        return sources, landed

    def accumulate_on_device(self, work: list[tuple[SplitMatrix, torch.Tensor]], coef: float | None) -> None:
        """``accumulate_on="device"`` / ``"device_bf16"``: add this step's gradients into the device-side window
        sums, fp32 / bf16 (the caller's stream, like the rest of the device update); nothing crosses the link until
        the window closes."""
        for split, g in work:
            if split.window_count == 0:
                self.transport_of(split).before_window_add(split)  # (CUDA: the last window's copy has read it)
            accumulate_into(split.window_sum, split.host_part(g), coef, first=split.window_count == 0)
            split.window_count += 1

    def _ship_window_sums(self, splits: list[SplitMatrix]) -> Landed:
        """``accumulate_on="device"`` / ``"device_bf16"``: move each closed window's device sum to the host, once per
        window; returns what the host step must wait for. The caller has made sure no host step still reads the
        accumulators."""
        shipped = [s for s in splits if s.window_sum is not None and s.window_count]
        landed = Landed()
        # the sum crosses the link in its own dtype: fp32, or bf16 with "device_bf16" (half the bytes)
        self.stats.bytes_to_host += sum(s.window_sum.nbytes for s in shipped)
        for transport, group in self.by_transport(shipped):
            landed.events += transport.ship_window_sums(group).events
        for split in shipped:
            split.host.accum_count, split.window_count = split.window_count, 0
            split.host.landing_full = split.host.landing is not None  # (the worker widens it: `host_adamw_window`)
        return landed

    def by_transport(self, splits: list[SplitMatrix]) -> list[tuple[Transport, list[SplitMatrix]]]:
        groups: dict[int, tuple[Transport, list[SplitMatrix]]] = {}
        for split in splits:
            transport = self.transport_of(split)
            groups.setdefault(id(transport), (transport, []))[1].append(split)
        return list(groups.values())

    def warm_up_step(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | None,
                     timer: StepTimer, schedule: WindowSchedule, dense: dict[torch.Tensor, DenseDeviceState]) -> None:
        """A warm-up step, plain dense AdamW: every matrix column by the host, synchronously (a one-step window);
        1-D parameters on the device."""
        with timer.phase("device_update"):
            device_update(self.splits, dense, entries, grads, coef, set()).apply()
        with timer.phase("handoff"):
            self.hand_off(entries, grads, coef)
        schedule.window_steps += 1
        self.close_window(schedule, timer, sequential=True)
        self.guard.forget_write_back()  # (plain AdamW, no host multiplier: nothing for the guard to watch)
        self.held.submit()  # (only when the close had no host work to fold it into)
