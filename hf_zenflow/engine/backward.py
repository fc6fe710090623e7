"""Between a gradient's backward hook and the step's hand-off: what becomes of each gradient of an offloaded matrix
before the host worker adds it to its window, and what a GradScaler sees of it meanwhile. One `BackwardHandOff` per
`windows.HostWindows`, in the order of a step:

1. **in its hook** (`BackwardHandOff.grad_ready`, called by `gradients.GradientReads`): on a transport that copies
   (CUDA) the gradient's copy to the host starts at once (`EarlyCopies`); when the step may free it (`may_free`),
   its selected columns are gathered, the whole gradient goes to the host and ``p.grad`` is freed (`FreedGradient`;
   a later micro-batch's gradient brings it back first, `regather`);
2. **a GradScaler between backward and the step** (`engine/amp.py`): the compute stream waits for the copies before
   ``unscale_`` rewrites the gradients (`before_unscale`); the freed gradients and the copies follow the scale
   without a second copy (`unscaled`); the overflow of the freed gradients joins the scaler's check
   (`freed_overflow`);
3. **in the step** (`hand_off`, or `start` then `finish`): the copies not made in backward are made (a `HandOff` holds
   the slot, the pairs and what the host job waits for); the job that adds them into the window sums is held
   (`HeldHandOff`) until the step knows whether it closes the window, whose host AdamW job then takes them.

What it reads of the host side it belongs to (the window state, the transports, the worker) is `HostSide`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..distributed.sharding import RankGroup, local_grad, set_grad
from ..settings.config import sums_on_device
from ..transport import CopyEvents, Transport, Transports
from .host import HostMatrix, host_adamw_window
from .in_flight import FreedInFlight
from .schedule import StepKind
from .split_matrix import SplitMatrix, selection_scores
from .telemetry import ZenFlowStats
from .worker import GradSlot, HostAdamWorker


__all__ = ["BackwardHandOff", "EarlyCopies", "FreedGradient", "HandOff", "HeldHandOff", "HostSide", "non_finite",
           "offloaded"]


@dataclass
class HandOff:
    """One step's gradients on their way to the host worker: the slot they hold, the (matrix, gradient) pairs,
    what the host job reads and what it waits for."""

    slot: GradSlot
    work: list[tuple[SplitMatrix, torch.Tensor]]
    sources: list[tuple[HostMatrix, torch.Tensor]]
    landed: CopyEvents
    done: bool = False  # submitted or abandoned: the slot is accounted for
    #: sources copied in backward before a GradScaler's ``unscale_``: still scaled, the host multiplies them by the
    #: inverse scale (`HeldHandOff`) instead of copying them again
    scaled: list[tuple[HostMatrix, torch.Tensor]] = field(default_factory=list)


@dataclass
class FreedGradient:
    """A gradient that left the device in its backward hook (`BackwardHandOff.grad_ready`): the empty stand-in
    `step()` sees in its place (its dtype and device; the hooks' norm is keyed by it), the host copy the worker reads,
    what that copy waits for, and the gradient's shape and strides (to bring it back: `restore`)."""

    stand_in: torch.Tensor
    source: torch.Tensor
    landed: CopyEvents
    shape: torch.Size
    stride: tuple[int, ...]
    #: a re-selection's column scores of this gradient (`selection.column_scores_of`), taken in the hook
    scores: torch.Tensor | None = None
    #: the hook gathered the selected columns into the device columns' buffer
    gathered: bool = False
    #: 1.0 where the gradient holds an inf or NaN, else 0.0 (a device scalar), taken in the hook when a GradScaler
    #: is in use (its overflow check cannot see a freed gradient); None when not taken
    overflow: torch.Tensor | None = None
    #: the inverse scale still on the host copy (a GradScaler's ``unscale_`` ran after the hook), or None
    factor: torch.Tensor | None = None

    def restore(self, split: SplitMatrix, device: torch.device) -> torch.Tensor:
        """The gradient again, on `device`, in its own layout, from the host copy (which has landed), unscaled as
        ``unscale_`` unscaled the others when it ran after the hook (`factor`)."""
        out = torch.empty_strided(self.shape, self.stride, dtype=self.stand_in.dtype, device=device)
        split.matrix(out).copy_(self.source)
        if self.factor is not None:
            out.mul_(self.factor.to(device))
        return out

    def gather_selected(self, split: SplitMatrix) -> None:
        """The selected columns of this gradient into the device columns' buffer, from the host copy (which has
        landed): after a re-selection, which chose them from the scores."""
        cols = split.device
        if self.source.device == cols.grad.device:
            cols.gather_grad(self.source)
        else:  # (a copy to the device: the columns only)
            index = cols.host_index() if self.source.device.type == "cpu" else cols.index.to(self.source.device)
            cols.grad_buffer(self.source.dtype).copy_(torch.index_select(self.source, cols.axis, index))
        if self.factor is not None:
            cols.grad.mul_(self.factor.to(cols.grad.device))

    def has_overflow(self) -> torch.Tensor:
        """1.0 where this gradient holds an inf or NaN, else 0.0: the hook's flag, or (not taken) read from the
        host copy (which has landed; a pass over it)."""
        if self.overflow is not None:
            return self.overflow
        self.landed.wait()  # Sync point (rare: the first step with a GradScaler): the copy has landed on the host
        return non_finite(self.source)


def non_finite(g: torch.Tensor) -> torch.Tensor:
    """1.0 when `g` holds an inf or NaN, else 0.0, as a scalar on `g`'s device and without a sync: its largest
    magnitude (one read, no temporary) is finite exactly when every element is (what a GradScaler's overflow check
    finds; an L2 norm is no such test, as it can overflow in fp16 on finite values)."""
    if g.numel() == 0:  # (an empty FSDP2 shard)
        return torch.zeros((), device=g.device)
    return (~torch.isfinite(torch.linalg.vector_norm(g, float("inf")))).float()


@dataclass
class EarlyCopies:
    """Gradients whose copy to the host the backward hooks started before `step()` (on a transport that copies):
    the hand-off slot whose buffers they land in, and per parameter the gradient copied (a weak reference), its
    version then, the host buffer and what the host job must wait for."""

    slot: GradSlot
    copies: dict[torch.Tensor, tuple[weakref.ref, int, torch.Tensor, CopyEvents]] = field(default_factory=dict)
    #: the gradients freed in backward, by parameter
    freed: dict[torch.Tensor, FreedGradient] = field(default_factory=dict)
    #: the inverse scale still on these copies (a GradScaler's ``unscale_`` ran after them), or None
    factor: torch.Tensor | None = None


class HeldHandOff:
    """This step's hand-off (its slot, gradients and clip coefficient), not submitted yet."""

    def __init__(self) -> None:
        self.held: tuple[HandOff, float | None] | None = None
        self._factor: float | None = None  # the inverse scale on the held hand-off's `scaled` copies

    def hold(self, started: HandOff, coef: float | None, factor: float | None = None) -> None:
        """Hold `started` with its clip coefficient `coef`; `factor`: the inverse scale still on its `scaled`
        copies (they are added times ``coef * factor``)."""
        self.held, self._factor = (started, coef), factor

    def _scaled(self, started: HandOff, coef: float | None) -> tuple[list, float | None]:
        """The hand-off's copies made before a GradScaler's unscale_, and the multiplier they are added with."""
        factor = self._factor
        if not started.scaled:
            return [], None
        assert factor is not None, "copies made before unscale_ need the inverse scale"
        return started.scaled, factor if coef is None else coef * factor

    def submit(self) -> None:
        """Submit the job that adds the held gradients into the window sums (nothing when none is held)."""
        held, self.held = self.held, None
        if held is None:
            return
        started, coef = held
        sources, landed = started.sources, started.landed
        scaled, scaled_coef = self._scaled(started, coef)

        def accumulate() -> None:
            try:
                landed.wait()  # Sync point (worker waits on the device): the gradients have landed on the host
                HostMatrix.accumulate_all(sources, coef)
                if scaled:
                    HostMatrix.accumulate_all(scaled, scaled_coef)
            finally:
                sources.clear()  # the gradients' memory goes now, not when the worker's next job replaces this one
                scaled.clear()

        started.slot.submit("accumulate", accumulate)  # the job returns the slot when it has run
        started.done = True  # (interrupted before this line, `abandon` returns it and the job skips)

    def submit_close(self, worker: HostAdamWorker, work: list[tuple[dict, list[HostMatrix]]],
                     sums_landed: CopyEvents | None, window_step: Callable[..., None] = host_adamw_window) -> Future:
        """Submit the window's host AdamW job (`window_step`), with the held gradients (if any) folded into it."""
        held = self.held
        last, last_landed, coef = (held[0].sources, held[0].landed, held[1]) if held else ([], None, None)
        scaled, scaled_coef = self._scaled(held[0], coef) if held else ([], None)

        def host_step() -> None:
            try:
                if sums_landed is not None:
                    sums_landed.wait()  # Sync point (worker waits on the device): the window's sums are on the host
                if last_landed is not None:
                    last_landed.wait()  # Sync point (worker waits on the device): the last gradients have landed
                if scaled:  # (added first, with their multiplier; the window's pass then reads them from the sums)
                    HostMatrix.accumulate_all(scaled, scaled_coef)
                if last:
                    window_step(work, last, coef)
                else:
                    window_step(work)
            finally:
                last.clear()  # the gradients' memory goes now
                scaled.clear()

        if held is None:
            return worker.submit("host_adamw", host_step)
        future = held[0].slot.submit("host_adamw", host_step)  # (the job returns the hand-off slot)
        held[0].done, self.held = True, None
        return future

    def abandon(self, abandon_hand_off: Callable[[HandOff], None]) -> None:
        """The step failed after its hand-off: the held gradients are dropped and the slot goes back."""
        held, self.held = self.held, None
        if held is not None and not held[0].done:
            abandon_hand_off(held[0])


class HostSide(Protocol):
    """What a `BackwardHandOff` reads of the host side it belongs to (`windows.HostWindows`)."""

    splits: dict[torch.Tensor, SplitMatrix]
    stats: ZenFlowStats
    transports: Transports
    param_shards: RankGroup | None

    @property
    def accumulate_on(self) -> str | None: ...

    @property
    def worker(self) -> HostAdamWorker | None: ...

    def ensure_worker(self) -> HostAdamWorker: ...

    def transport_of(self, split: SplitMatrix) -> Transport: ...

    def by_transport(self, splits: list[SplitMatrix]) -> list[tuple[Transport, list[SplitMatrix]]]: ...


def offloaded(splits: dict[torch.Tensor, SplitMatrix], entries: list[tuple[dict, torch.Tensor]],
              grads: list[torch.Tensor]) -> list[tuple[SplitMatrix, torch.Tensor]]:
    """The (matrix, gradient) pairs of `entries` whose matrix has host state."""
    return [(splits[p], g) for (_, p), g in zip(entries, grads) if p in splits and splits[p].host is not None]


class BackwardHandOff:
    """The gradients of one host side's offloaded matrices from their backward hooks to the step's hand-off (see the
    module docstring). The hooks call `grad_ready`, `regather`, `copies_out` and `defers_norm`; the optimizer sets
    `free_kind` before each backward, and its GradScaler notices call `before_unscale`, `unscaled` and
    `freed_overflow`; the step reads `freed`, then hands off (`hand_off`, or `start` and `finish`)."""

    def __init__(self, host: HostSide) -> None:
        #: the host side (a weak reference: the host side owns this object, and a cycle would keep its host state
        #: alive past the optimizer until a garbage collection)
        self.host: HostSide = weakref.proxy(host)
        self.splits, self.stats, self.transports = host.splits, host.stats, host.transports
        self.early: EarlyCopies | None = None
        # Several devices in one process (``device_map="auto"``) run backward on one autograd thread each, so
        # `grad_ready` runs in several threads at once: taking the step's hand-off slot (and starting the worker)
        # is a check-then-act that must happen once, under this lock.
        self._early_lock = threading.Lock()
        self.held = HeldHandOff()  # this step's hand-off until the step knows whether it closes the window
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
        #: the gradients freed in backward whose copy to the host has not landed (their memory is still allocated)
        self.in_flight = FreedInFlight()

    # ---- 1. in the backward hooks -----------------------------------------------------------------------------------

    def grad_ready(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
        """Backward has finished `p`'s gradient (a `GradientReads` hook): on a transport that copies (CUDA), start
        its copy to the host now, so that it overlaps the rest of backward instead of following `step()`'s sync.
        The first such gradient of a step takes the hand-off slot (a stall only while the worker is behind by more
        than the window's host AdamW, which `HostWindows.provide_slots` leaves a slot beside for each step up to its
        write-back); `start` keeps the copies whose gradient has not changed since, and copies the rest.

        When the gradient may be freed (`may_free`), on any transport: the selected columns are gathered into the
        device columns' buffer, the whole gradient goes to the host, and ``p.grad`` is set to None. Returns the
        stand-in that `step()` then sees for it (an empty tensor of the gradient's dtype and device, `FreedGradient`),
        or None when the gradient stays."""
        host = self.host
        if sums_on_device(host.accumulate_on):
            return None
        split = self.splits.get(p)
        if split is None and self.free_kind is not None and self.create_in_backward is not None:
            # (the first step: its state now, so that its gradient can go; once at a time, as devices' autograd
            # threads may get here together)
            with self._create_lock:
                split = self.splits.get(p) or self.create_in_backward(p)
            if sums_on_device(host.accumulate_on):  # ("auto" decided just now)
                return None
        if split is None or split.host is None:
            return None
        transport = host.transport_of(split)
        free = self.may_free(split, g)
        if not (free or transport.stages_gradients):
            return None
        if free and host.worker is None and threading.current_thread() is self._home_thread:
            host.ensure_worker()  # (the first step, whose gradients are freed: the worker starts in its backward)
        with self._early_lock:
            if self.early is None:
                worker = host.worker
                if worker is None:
                    # (after `close()`) never started here: it would take this autograd thread for the training
                    # thread whose cores it shares (`settings/threads.py`); `step()` starts it and copies this step's
                    # grads.
                    return None
                self.early = EarlyCopies(worker.take_slot())
            early = self.early
        ((_, source),), landed = transport.hand_off([(split, g)], early.slot.index)
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
        split.owner.grad = None  # the device's memory for this gradient goes once its copy has read it
        # (at most `FREED_IN_FLIGHT` such copies pending: beyond them this hook waits for the oldest, `in_flight.py`)
        self.in_flight.add(g.numel() * g.element_size(), landed)
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
        sharded = self.host.param_shards is not None
        return sharded and self.free_kind is not None and (split is None or split.host is None)

    def defers_norm(self, g: torch.Tensor) -> bool:
        """Whether the norm of a gradient `g` that stays on the device is left to the step (`GradientReads.settle`:
        one batched launch per device and dtype instead of one per gradient in its hook): where the transport
        copies (the device's memory is not the host's; on a CPU device the hook reads the gradient while it is in
        cache). Not before the first step has made the device's transport (the hooks never make it: under FSDP2 its
        kind depends on the sharding, found at the first step)."""
        transport = self.transports.made(g.device)
        return transport is not None and transport.stages_gradients

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

    # ---- 2. what the step and a GradScaler see of them --------------------------------------------------------------

    @property
    def freed(self) -> dict[torch.Tensor, FreedGradient]:
        """The gradients freed in this step's backward, by parameter (empty when none)."""
        early = self.early
        return early.freed if early is not None else {}

    @property
    def early_factor(self) -> torch.Tensor | None:
        """The inverse scale still on the copies made in backward (a GradScaler's ``unscale_`` ran after them), or
        None: a device scalar, read in the step's one sync (`copies_factor`)."""
        return self.early.factor if self.early is not None else None

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

    def before_unscale(self) -> None:
        """Sync point (device streams only): the compute stream waits for the copies the hooks started of the
        gradients still in ``p.grad``, so that the in-place rewrite of them that follows (``unscale_``) runs after
        the copies have read them. Not for the gradients freed in backward: they are not in ``p.grad``, so
        ``unscale_`` never rewrites them, and their memory is kept for their copies by `record_stream`; the next
        forward does not wait for those copies."""
        early = self.early
        if early is None:
            return
        rewritten = [arrived for p, (*_, arrived) in early.copies.items() if p not in early.freed]
        self.transports.compute_waits_for(CopyEvents([e for arrived in rewritten for e in arrived.events]))

    @torch.no_grad()
    def unscaled(self, factor: torch.Tensor) -> None:
        """A GradScaler's ``unscale_`` multiplied every gradient in ``p.grad`` by `factor` in place, without a version
        bump. The gradients freed in backward follow without coming back: the selected columns their hooks gathered
        are multiplied now (the scaler's arithmetic on those elements: exact for its powers of two); their host copies
        keep the scale and carry `factor` (a restore or a re-selection's gather from them applies it). The copies the
        hooks started hold the values before (`before_unscale` made the rewrite wait for them): they are kept, and the
        host multiplies them by `factor` when it adds them (`HeldHandOff`; exact for the scaler's powers of two)
        instead of copying every gradient again."""
        early = self.early
        if early is None:
            return
        for p, freed in early.freed.items():
            freed.factor = factor
            if freed.gathered:
                cols = self.splits[p].device.grad
                cols.mul_(factor.to(cols.device))
        early.factor = factor

    def freed_overflow(self, norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]
                       ) -> dict[torch.device, torch.Tensor] | None:
        """Per device of the gradients freed in backward: 1.0 (a tensor there) when one of them holds an inf or NaN,
        else 0.0; None when none was freed. Added to a GradScaler's overflow check (`amp.install`), which reads only
        ``p.grad`` and keeps one flag per device (``device_map``: a model over several GPUs): the same element-wise
        test, made in each gradient's hook (or, for the hooks of the first step with a scaler, which did not know of
        it, from the host copies wherever the hook's norm, `norm` of the parameter and the stand-in, is not finite:
        a norm that is finite rules an inf or NaN out)."""
        freed = self.freed
        if not freed:
            return None
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for p, f in freed.items():
            device = f.stand_in.device  # (the gradient's)
            on_device = flags.setdefault(device, [])
            measured = norm(p, f.stand_in)
            # Sync point (only the first step with a scaler: its hooks made no check)
            if f.overflow is None and measured is not None and bool(torch.isfinite(measured)):
                continue
            on_device.append(f.has_overflow().to(device))
        return {device: torch.stack(found).amax() if found else torch.zeros((), device=device)
                for device, found in flags.items()}

    def release(self) -> None:
        """Give back the slot of copies started in backward that no `step()` used (skipped step, reset, close)."""
        with self._early_lock:
            early, self.early = self.early, None
        if early is not None:
            early.slot.give_back()

    # ---- 3. in the step ---------------------------------------------------------------------------------------------

    def hand_off(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | None,
    ) -> None:
        """Give this step's gradients of the offloaded matrices to the host worker, which adds them to the window
        (`start` then `finish`)."""
        started = self.start(entries, grads)
        if started is not None:
            try:
                self.finish(started, coef)
            except BaseException:
                if not started.done:
                    self.abandon(started)
                raise

    def start(self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor]) -> HandOff | None:
        """Take a hand-off slot and start moving the offloaded matrices' gradients to the host (CUDA: a copy on a
        side stream into pinned memory, which the worker will wait for; CPU device: nothing to move, the worker
        reads the gradient tensors). Blocks (a stall) only while every slot is held (`HostWindows.provide_slots`).
        None when nothing goes to the host worker this step (``accumulate_on="device"`` sums on the device instead)."""
        host = self.host
        if sums_on_device(host.accumulate_on):
            return None
        work = offloaded(self.splits, entries, grads)
        if not work:
            return None
        with self._early_lock:  # (backward has returned: no hook still adds to it)
            early, self.early = self.early, None
        worker = host.worker
        slot = early.slot if early is not None else worker.take_slot()
        try:
            sources: list[tuple[HostMatrix, torch.Tensor]] = []
            scaled: list[tuple[HostMatrix, torch.Tensor]] = []
            landed, todo = CopyEvents(), []
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
                more, arrived = self._sources(todo, slot.index)
                sources += more
                landed.events += arrived.events
            if not worker.background:
                # Sequential schedule (``overlap_step=False``, or the inline executor): the job that reads these
                # gradients runs right after the step's sync, in this thread. Ordering the compute stream after
                # their copies lets that one sync cover them too, instead of a second host wait in the job.
                self.transports.compute_waits_for(landed)
        except BaseException:
            slot.give_back()
            raise
        return HandOff(slot, work, sources, landed, scaled=scaled)

    def _sources(self, work: list[tuple[SplitMatrix, torch.Tensor]], slot: int
                 ) -> tuple[list[tuple[HostMatrix, torch.Tensor]], CopyEvents]:
        sources: list[tuple[HostMatrix, torch.Tensor]] = []
        landed = CopyEvents()
        for transport, group in self.host.by_transport([split for split, _ in work]):
            mine = {id(split) for split in group}
            part, arrived = transport.hand_off([(s, g) for s, g in work if id(s) in mine], slot)
            sources += part
            landed.events += arrived.events
        return sources, landed

    def abandon(self, started: HandOff) -> None:
        """The step was skipped: no job, the slot goes back (a copy already enqueued into its buffers runs on the
        side stream before any later copy into them)."""
        started.done = True
        started.slot.give_back()

    def finish(self, started: HandOff, coef: float | None) -> None:
        """The handed-off gradients (times `coef`) go to the worker: held until the step knows whether it closes
        the window, whose host AdamW job then takes them (`HeldHandOff`)."""
        if self.host.param_shards is None and any(g._base is not None for _, g in started.work):
            # A gradient that is a view of storage its owner keeps and writes again (DDP's gradient_as_bucket_view:
            # the reducer writes the next backward's gradients into the same bucket on the compute stream):
            # `record_stream` cannot protect it, since it is never freed. Sync point (device streams only): the
            # compute stream waits for the copies to the host before any later work, the next backward included.
            # Not under FSDP2, whose gradient shards are views of their module group's reduce-scatter output:
            # FSDP2 writes that output only before it makes the views (torch 2.13, `foreach_reduce`), keeps no
            # reference to it after, and adds a later backward into a shard only while the DTensor's ``.grad`` is
            # still set, which it no longer is (below). Its memory goes back to the caching allocator when the last
            # view goes, and the copies' `record_stream` keeps it from reuse until they have read it: nothing to wait
            # for here, and the next forward does not wait for the copies.
            self.transports.compute_waits_for(started.landed)
        for split, _ in started.work:
            split.owner.grad = None  # the worker owns this gradient now (FSDP2: the DTensor's, else it accumulates)
        started.work.clear()
        self.held.hold(started, coef, self.copies_factor)
