"""The host side of a ZenFlow step: how a gradient of an offloaded matrix reaches its window, how the window closes,
and how its result gets back into the weights. One gradient's way, in the order of this module:

1. **hand-off in backward** (`HostWindows.grad_ready`, from its hook in `gradients.py`): on a transport that copies
   (CUDA) its copy to the host starts at once; when the step may free it (`may_free`), its selected columns are
   gathered, the whole gradient goes to the host and ``p.grad`` is freed (`FreedGradient`, `EarlyCopies`);
2. **hand-off in the step** (`start_hand_off`, `finish_hand_off`): the copies not made in backward are made (a
   `HandOff` holds the slot, the pairs and what the host job waits for); the job that adds them into the window sums
   is held (`HeldHandOff`) until the step knows whether it closes the window (with ``accumulate_on="device"`` or
   ``"device_bf16"`` the device sums the window instead: `accumulate_on_device`);
3. **window close** (`close_window`): the window's host AdamW is submitted to the worker, the closing step's
   gradients folded into the same pass over the host state;
4. **write-back** (`write_back`): at once (``overlap_step=False``) or ``writeback_lag`` steps into the next window
   (`apply_previous_window`), while the device trains on; the device columns go back on top.

What crosses the link goes through one `Transport` per device type (`Transports`); the host jobs run in order on one
`HostAdamWorker`, whose life `WorkerKeeper` keeps. With several data-parallel ranks each rank's host side covers its
share of every matrix, and the write-back all-gathers the shares (`distributed/sharding.py`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from .._base import by_device
from ..distributed.replica_check import note_host_split
from ..distributed.sharding import RankGroup, local_grad, set_grad
from ..settings.config import ZenFlowConfig, sums_on_device
from ..transport import CopyEvents, Transport, Transports
from ..transport.cpu_device.rounding import matrix_key
from .accumulation import resumed_choice
from .device_budget import estimate_peak
from .device_memory import DeviceMemoryMeter
from .device_state import DenseDeviceState, DeviceColumns, scatter_columns
from .device_step import device_update
from .host import GRAD_SLOTS, HostLayout, HostMatrix, accumulate_into, grad_slots, host_adamw_window, link_grad_dtype
from .host_guard import HostStepGuard
from .host_lr import LrScaleRecord, host_hyper, peak_lr, window_lag
from .in_flight import FreedInFlight
from .params import is_split
from .planner import RunSizes, plan_accumulation
from .schedule import StepKind, WindowSchedule
from .selection import num_selected
from .split_matrix import SplitMatrix, selection_scores
from .telemetry import StepTimer, ZenFlowStats
from .worker import GradSlot, HostAdamWorker, WorkerKeeper, cuda_device_of


__all__ = ["EarlyCopies", "FreedGradient", "HandOff", "HeldHandOff", "HostWindows", "non_finite"]


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
    """A gradient that left the device in its backward hook (`HostWindows.grad_ready`): the empty stand-in `step()`
    sees in its place (its dtype and device; the hooks' norm is keyed by it), the host copy the worker reads, what
    that copy waits for, and the gradient's shape and strides (to bring it back: `restore`)."""

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


class HostWindows:
    """The host side of one `ZenFlowAdamW` (see the module docstring). `splits` and `groups` are the optimizer's
    own (live) collections; `config` is kept current by the optimizer."""

    def __init__(self, splits: dict[torch.Tensor, SplitMatrix], groups: list[dict[str, Any]], config: ZenFlowConfig,
                 stats: ZenFlowStats, host_executor: str, process_group: Any = None) -> None:
        self.splits, self.groups, self.stats = splits, groups, stats
        self.keeper = WorkerKeeper(config, host_executor)  # the host worker's life
        self.config = config
        self.process_group = process_group
        self._shards: RankGroup | None = None
        #: FSDP2's mesh when the parameters are sharded DTensors (`distributed/fsdp.py`): each rank's host state holds
        #: its local rows, nothing is shared across ranks, and per-rank partial sums are summed over this group instead
        self.param_shards: RankGroup | None = None
        # (`writeback_device_ms`: each transport's clock of device time spent on the write-back)
        self.transports = Transports(on_new=lambda t, clocks=stats.device_clocks: clocks.append(t.take_device_ms))
        self.pending: Any = None  # Future of the host step whose result awaits write-back (overlap mode)
        self.writeback_pending = False
        self.unapplied_steps: list[int] = []  # sizes of windows submitted but not yet written back
        self.early: EarlyCopies | None = None
        # Several devices in one process (``device_map="auto"``) run backward on one autograd thread each, so
        # `grad_ready` runs in several threads at once: taking the step's hand-off slot (and starting the worker)
        # is a check-then-act that must happen once, under this lock.
        self._early_lock = threading.Lock()
        self.held = HeldHandOff()  # this step's hand-off until the step knows whether it closes the window
        #: the hand-off slots (`host.grad_slots`): the worker's pool and each matrix's landing buffers, raised at a
        #: window's close when the write-back lag needs more (`provide_slots`); never lowered within a run
        self.slots = GRAD_SLOTS
        #: ``accumulate_on="auto"``'s choice, made when the first host state is created (`planner.py`)
        self.accumulate_chosen: str | None = None
        #: the host step's learning-rate multiplier of the last full window (`stats()["host_lr_scale"]`)
        self.lr_scale = LrScaleRecord()
        #: `host_step_guard`: the watch on each write-back and the host lr's factor it keeps
        self.guard = HostStepGuard()
        #: the seed of the random bits that round bf16 and 8-bit host moments (`rounding.RandomStream`): torch's
        #: initial seed when the optimizer is made (read, not drawn: the generator's sequence is left alone), so the
        #: same script and seed give the same weights; kept in checkpoints, which restore it
        self.rounding_seed = torch.initial_seed() & 0xFFFFFFFFFFFFFFFF
        #: the kind of the coming step when its gradients of offloaded matrices may be freed in backward, else None
        #: (`may_free`; set by the optimizer from `free_gradients_in_backward` and the schedule)
        self.free_kind: StepKind | None = None
        #: a GradScaler is in use: each gradient freed in backward has its overflow check made in its hook
        self.checks_overflow = False
        #: creates a matrix's state in its first backward hook (the first step, so that it can be freed too), or
        #: None (`StateMaker.in_backward`, set by the optimizer)
        self.create_in_backward: Callable[[torch.Tensor], SplitMatrix | None] | None = None
        #: the run's schedule: None until the first step (or a load) makes it (`StateMaker.ensure_schedule`), and
        #: again after a reset
        self.schedule: WindowSchedule | None = None
        #: the thread that may start the worker from a backward hook (the optimizer's; not a device's autograd thread)
        self._home_thread = threading.current_thread()
        self._create_lock = threading.Lock()
        #: this step's `Synced.copies_factor` (the inverse scale on the copies made before ``unscale_``), set after
        #: the step's sync
        self.copies_factor: float | None = None
        #: the first step's link buffers were reserved at once when its state is made in the backward hooks
        self.reserved_ahead = False
        #: the gradients freed in backward whose copy to the host has not landed (their memory is still allocated)
        self.in_flight = FreedInFlight()
        #: the optimizer's meter of what the device holds (set by the optimizer): its peak so far is what
        #: "auto" weighs against ``device_memory_limit_bytes`` (`planner.plan_accumulation`; None: a peak of 0)
        self.meter: DeviceMemoryMeter | None = None

    @property
    def config(self) -> ZenFlowConfig:
        return self._config

    @config.setter
    def config(self, value: ZenFlowConfig) -> None:
        self._config = self.keeper.config = value

    @property
    def worker(self) -> HostAdamWorker | None:
        """The host worker, None until a step needs it (`ensure_worker`) and after `close()`."""
        return self.keeper.worker

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
        self.transports.forget()
        self.in_flight.clear()  # (closing the transports waited for every copy)
        self.stats.device_clocks.clear()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the host side, as plain values under the keys of its ``zenflow`` block: the
        guard's state, the seed of the rounding bits, whether a host result awaits its write-back and the sizes of
        the windows it holds, where windows are summed, and the ranks the host state is split across (``ranks`` and
        ``rank`` with several, ``fsdp_ranks`` and ``fsdp_rank`` under FSDP2; `load` leaves those to the caller's
        rank checks)."""
        state: dict[str, Any] = {
            "host_step_guard": self.guard.state(), "rounding_seed": self.rounding_seed,
            "writeback_pending": self.writeback_pending, "unapplied_steps": list(self.unapplied_steps),
            "accumulate_on": self.accumulate_on,
        }
        if self.shards.ranks > 1:
            state.update(ranks=self.shards.ranks, rank=self.shards.rank)
        if self.param_shards is not None:
            state.update(fsdp_ranks=self.param_shards.ranks, fsdp_rank=self.param_shards.rank)
        return state

    def load(self, state: dict[str, Any]) -> None:
        """Restore what `state()` gave, from a checked checkpoint block (one written before the guard or the seed
        existed lacks them: theirs stay; ``config`` names the accumulation of one written before "auto"), after
        `reset` and before any host state is made: it is made for the accumulation chosen and rounds with the
        seed."""
        self.accumulate_chosen = resumed_choice(self.config, state)
        if "host_step_guard" in state:
            self.guard.load(state["host_step_guard"])  # (the factor it engaged to, a write-back it watches)
        if "rounding_seed" in state:
            self.rounding_seed = int(state["rounding_seed"])
        self.writeback_pending = bool(state["writeback_pending"])
        self.unapplied_steps = [int(n) for n in state["unapplied_steps"]]

    def loaded(self, threads: int, background: bool) -> None:
        """A whole, checked state was just loaded: a worker that no longer runs with `threads` threads in the
        `background` mode wanted stops (a later step starts one with the settings in force; the run goes on, its
        cores stay claimed and the state just loaded keeps its pinned buffers), and a host worker's failure is
        forgotten (`engine/failure.py`)."""
        worker = self.worker
        if worker is not None and (worker.threads, worker.background) != (threads, background):
            self.stop_worker()
        self.keeper.failure = None

    def guard_factor(self) -> float:
        """The host lr's factor under the configured `host_step_guard` (`HostStepGuard.factor_for`)."""
        return self.guard.factor_for(self.config.host_step_guard)

    def stop_worker(self) -> None:
        """Stop the worker thread only (a later step starts a new one, e.g. with other settings); the run goes on:
        the cores stay claimed and the pinned link buffers stay pinned. The slot of copies started in backward goes
        back first: it is the stopped worker's."""
        self.release_early()
        self.keeper.stop()

    def close(self) -> None:
        """The end of a run: stop the worker and give the training thread its cores back, and unlock the pinned link
        buffers (a later step starts a new worker and works on ordinary memory, with synchronous copies)."""
        self.release_early()
        self.keeper.close()
        self.transports.close()
        self.in_flight.clear()  # (closing waited for every copy)

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
        """The host worker (`WorkerKeeper.ensure`): a thread when the schedule overlaps and something is offloaded
        (planned, or host state exists after all: an inline worker then gives way unless copies started in backward
        hold one of its slots); otherwise inline, no thread."""
        return self.keeper.ensure(
            has_host_state=any(s.host is not None for s in self.splits.values()),
            may_replace_inline=self.early is None,
            cuda_device=cuda_device_of(p for g in self.groups for p in g["params"]),
            on_start=lambda: note_host_split(self.reduce_group.ranks, self.process_group),  # (once per process)
            slots=self.slots)

    def transport_of(self, split: SplitMatrix) -> Transport:
        return self.transports.of(split.param.device, fsdp_shard=self.param_shards is not None)

    def by_transport(self, splits: list[SplitMatrix]) -> list[tuple[Transport, list[SplitMatrix]]]:
        groups: dict[int, tuple[Transport, list[SplitMatrix]]] = {}
        for split in splits:
            transport = self.transport_of(split)
            groups.setdefault(id(transport), (transport, []))[1].append(split)
        return list(groups.values())

    def copies_lag(self) -> bool:
        """Whether the copies of gradients to the host run beside backward and may lag it (CUDA's side stream):
        then several freed gradients can be in flight at once (`engine/in_flight.py`). A CUDA parameter's copies
        do; other devices' as their transport says, once made (none is made here)."""
        return any(p.device.type == "cuda" for g in self.groups for p in g["params"]) or any(
            t.stages_gradients for t in self.transports.values())

    def limit_peak(self) -> int:
        """Under `device_memory_limit_bytes`: what a step at the run's threshold holds beside what
        `accumulate_on="auto"` counts for device sums (`PeakEstimate.beside_window_sums`); 0 without a limit. Asked
        when "auto" decides, which is at the first host state: the schedule exists by then."""
        if self.config.device_memory_limit_bytes is None:
            return 0
        return estimate_peak(self.groups, self.config, self.schedule.offload_threshold(self.config),
                             self.free_kind is not None, copies_lag=self.copies_lag()).beside_window_sums

    def _decide(self, splits: list[SplitMatrix], shares: dict) -> None:
        local = [getattr(p, "_local_tensor", p) for g in self.groups for p in g["params"] if p.requires_grad]
        elements = float(sum(p.numel() for p in local))
        sizes = RunSizes(splits, shares, self.transport_of, elements,
                         elements * (self.param_shards.ranks if self.param_shards is not None else 1),
                         peak=max(self.meter.peak_bytes if self.meter is not None else 0, self.limit_peak()),
                         frees_gradients=self.free_kind is not None)
        self.accumulate_chosen = plan_accumulation(self.config, sizes, self.reduce_group)

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
                self.accumulate_on, transport, HostLayout.of(self.config), self.slots) for s in group))
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
        ordinals = {id(p): i for i, p in enumerate(p for g in self.groups for p in g["params"])}
        for transport, group in self.by_transport(splits):
            if not self.reserved_ahead:  # (`decide_accumulation` reserved for the first step's matrices)
                transport.reserve(sum(HostMatrix.link_bytes(shares[id(s)].local(s.matrix(s.param)), linked[id(s)],
                                                            accumulate_on, transport, layout, self.slots)
                                      for s in group))
            for split in group:
                # (the parameter's place in the param groups, and its rows' place under FSDP2: what every rank and
                # a resumed run agree on)
                ordinal = ordinals.get(id(split.owner), ordinals.get(id(split.param), 0))
                first_row = (self.param_shards.share(0, split.owner.shape[0]).start
                             if self.param_shards is not None and split.owner is not split.param else 0)
                stream = split.random_stream(matrix_key(self.rounding_seed, ordinal), shares[id(split)], first_row)
                split.attach_host(accumulate_on, transport, shares[id(split)], linked[id(split)], layout, stream,
                                  self.slots)

    # ---- 1. hand-off in backward ------------------------------------------------------------------------------------

    def grad_ready(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
        """Backward has finished `p`'s gradient (a `GradientReads` hook): on a transport that copies (CUDA), start
        its copy to the host now, so that it overlaps the rest of backward instead of following `step()`'s sync.
        The first such gradient of a step takes the hand-off slot (a stall only while the worker is behind by more
        than the window's host AdamW, which `provide_slots` leaves a slot beside for each step up to its
        write-back); `start_hand_off` keeps the copies whose gradient has not changed since, and copies the rest.

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
        return self.param_shards is not None and self.free_kind is not None and (split is None or split.host is None)

    def defers_norm(self, g: torch.Tensor) -> bool:
        """Whether the norm of a gradient `g` that stays on the device is left to the step (`GradientReads.settle`:
        one batched launch per device and dtype instead of one per gradient in its hook): where the transport
        copies (the device's memory is not the host's; on a CPU device the hook reads the gradient while it is in
        cache). Not before the first step has made the device's transport (the hooks never make it: under FSDP2 its
        kind depends on the sharding, found at the first step)."""
        transport = self.transports.made(g.device)
        return transport is not None and transport.stages_gradients

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
            early.slot.give_back()

    # ---- 2. hand-off in the step ------------------------------------------------------------------------------------

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
        reads the gradient tensors). Blocks (a stall) only while every slot is held (`provide_slots`). None when
        nothing goes to the host worker this step (``accumulate_on="device"`` sums on the device instead)."""
        if sums_on_device(self.accumulate_on):
            return None
        work = self.offloaded(entries, grads)
        if not work:
            return None
        with self._early_lock:  # (backward has returned: no hook still adds to it)
            early, self.early = self.early, None
        slot = early.slot if early is not None else self.worker.take_slot()
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
            if not self.worker.background:
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
        for transport, group in self.by_transport([split for split, _ in work]):
            mine = {id(split) for split in group}
            part, arrived = transport.hand_off([(s, g) for s, g in work if id(s) in mine], slot)
            sources += part
            landed.events += arrived.events
        return sources, landed

    def abandon_hand_off(self, started: HandOff) -> None:
        """The step was skipped: no job, the slot goes back (a copy already enqueued into its buffers runs on the
        side stream before any later copy into them)."""
        started.done = True
        started.slot.give_back()

    def finish_hand_off(self, started: HandOff, coef: float | None) -> None:
        """The handed-off gradients (times `coef`) go to the worker: held until the step knows whether it closes
        the window, whose host AdamW job then takes them (`HeldHandOff`)."""
        if self.param_shards is None and any(g._base is not None for _, g in started.work):
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

    def accumulate_on_device(self, work: list[tuple[SplitMatrix, torch.Tensor]], coef: float | None) -> None:
        """``accumulate_on="device"`` / ``"device_bf16"``: add this step's gradients into the device-side window
        sums, fp32 / bf16 (the caller's stream, like the rest of the device update); nothing crosses the link until
        the window closes."""
        for split, g in work:
            if split.window_count == 0:
                self.transport_of(split).before_window_add(split)  # (CUDA: the last window's copy has read it)
            accumulate_into(split.window_sum, split.host_part(g), coef, first=split.window_count == 0)
            split.window_count += 1

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

    # ---- 3. window close --------------------------------------------------------------------------------------------

    def close_window(self, schedule: WindowSchedule, timer: StepTimer, sequential: bool) -> None:
        """End the open window: submit its host AdamW; write back now (sequential) or later (overlapped: the step
        `writeback_lag` into the next window, `apply_previous_window`)."""
        steps = schedule.close_window()
        for split in self.splits.values():
            split.auto.reset()
        # the run's lag, also for a window that `flush()` closes early: "auto" keeps one multiplier per run
        lag = window_lag(schedule, self.config.overlap_step, steps)
        full = schedule.update_interval is None or steps >= schedule.update_interval
        group_of = {p: g for g in self.groups for p in g["params"]}
        by_group: dict[int, tuple[dict, list[HostMatrix]]] = {}
        scales: list[float] = []
        for split in self.splits.values():
            if split.host is not None:
                group = group_of[split.owner]  # (the parameter in the group: a DTensor under FSDP2)
                if id(group) not in by_group:
                    # hyper-parameters are copied now: the lr in force when the window closed
                    hyper, scale = host_hyper(group, self.config, steps, lag, schedule.high_lr_window,
                                              self.guard.factor_for(self.config.host_step_guard))
                    self.lr_scale.note(self.config.host_lr_scale, scale, peak_lr(group), lag, full)
                    scales.append(scale)
                    by_group[id(group)] = (hyper, [])
                by_group[id(group)][1].append(split.host)
        work = list(by_group.values())
        # (what an overshoot of this window's result is measured against, and whether "auto" watches it)
        self.guard.closed(scales, schedule.high_lr_window)
        worker = self.ensure_worker()  # (closed after training: `flush()` may still close a window)
        if not work:
            return  # every column lives on the device: no host step, nothing stale
        if not sequential:
            self.apply_previous_window(timer)
        landed = None
        if sums_on_device(self.accumulate_on):
            with timer.phase("handoff"):
                if self.pending is not None:
                    # Sync point: the previous window's host step reads the host accumulators; it must be done
                    # before this window's sums land there (only reached in sequential closes: an overlapped close
                    # waited above).
                    worker.wait(self.pending)
                landed = self._ship_window_sums([s for s in self.splits.values() if s.host is not None])

        # What waits for this AdamW job: only the write-back `writeback_steps` later (`apply_previous_window`, in
        # `step()`). The job keeps the closing step's hand-off slot until it has run, and the jobs of the steps up
        # to that write-back queue behind it on the in-order worker with a slot each: one slot for each of those
        # steps beside it, or a backward hook of one of them would wait in `take_slot` for the AdamW (the device
        # idle meanwhile).
        self.provide_slots(grad_slots(schedule.writeback_steps(self.config.overlap_step)))
        # (with this step's gradients folded in)
        future = self.held.submit_close(worker, work, landed, host_adamw_window)
        self.unapplied_steps.append(steps)
        self.pending, self.writeback_pending = future, True
        if sequential:
            with timer.phase("wait"):
                worker.wait(future)
            with timer.phase("writeback"):
                self.write_back()

    def provide_slots(self, count: int) -> None:
        """At least `count` hand-off slots (`host.grad_slots`): each matrix whose transport stages gradients gets
        its landing buffers for the new slots (one reservation per transport: pinned on CUDA), then the worker's
        pool the new indices. In `step()`, between backward passes, so no hook takes a slot meanwhile."""
        if count <= self.slots:
            return
        staged = [split for split in self.splits.values() if split.host is not None and split.host.staging]
        for transport, group in self.by_transport(staged):
            transport.reserve(sum(split.host.staging_bytes(count) for split in group))
            for split in group:
                split.host.add_staging(transport, count)
        self.slots = count
        if self.worker is not None:
            self.worker.provide_slots(count)

    def _ship_window_sums(self, splits: list[SplitMatrix]) -> CopyEvents:
        """``accumulate_on="device"`` / ``"device_bf16"``: move each closed window's device sum to the host, once per
        window; returns what the host step must wait for. The caller has made sure no host step still reads the
        accumulators."""
        shipped = [s for s in splits if s.window_sum is not None and s.window_count]
        landed = CopyEvents()
        # the sum crosses the link in its own dtype: fp32, or bf16 with "device_bf16" (half the bytes)
        self.stats.bytes_to_host += sum(s.window_sum.nbytes for s in shipped)
        for transport, group in self.by_transport(shipped):
            landed.events += transport.ship_window_sums(group).events
        for split in shipped:
            split.host.accum_count, split.window_count = split.window_count, 0
            split.host.landing_full = split.host.landing is not None  # (the worker widens it: `host_adamw_window`)
        return landed

    # ---- 4. write-back ----------------------------------------------------------------------------------------------

    def apply_previous_window(self, timer: StepTimer) -> None:
        """Overlapped schedule: write the previous window's host result back, if one is pending."""
        if not self.writeback_pending:
            return
        with timer.phase("wait"):
            # Sync point: the previous window's host step must be done before its result is written back.
            if self.pending is not None:
                self.ensure_worker().wait(self.pending)
        with timer.phase("writeback"):
            self.write_back()

    def write_back(self) -> None:
        """Put each fresh host result into the weights, then the device columns back on top.

        Only matrices whose host step ran since the last write-back are written (`writeback_fresh`): a matrix that
        got no gradient in the window keeps its weights, including columns that left the device at a re-selection
        since. How a result gets into the weights is the transport's (CUDA: an asynchronous copy from pinned
        memory; CPU device: a storage swap); with several ranks, one all-gather of every rank's share of every
        hosted matrix per device and dtype (`distributed/sharding.py`), whose result is copied into the weights.
        """
        columns_back: list[tuple[DeviceColumns, torch.Tensor]] = []
        written: list[SplitMatrix] = []
        hosted = [split for split in self.splits.values() if split.host is not None]
        for split in hosted:
            if split.host.writeback_fresh:
                if self.shards.ranks == 1:
                    self.transport_of(split).put_weights(split)
                written.append(split)
                self.stats.bytes_to_device += split.host.writeback.numel() * split.param.element_size()
            if split.device is not None:
                columns_back.append((split.device, split.matrix(split.param)))
        if self.shards.ranks > 1:
            self._gather_weights(hosted, {id(split) for split in written})
        for split in hosted:
            split.host.writeback_fresh = False
        scatter_columns(columns_back)
        if written:
            self.guard.wrote_back()  # (the next step's gradient is the first to see these weights)
        for transport, group in self.by_transport(written):
            transport.after_write_back(group)
        self.writeback_pending = False
        self.pending = None
        self.unapplied_steps.clear()

    def _gather_weights(self, hosted: list[SplitMatrix], fresh: set[int]) -> None:
        """Every rank's share of the hosted matrices into the weights (the `fresh` ones): per device and dtype one
        all-gather per bucket of matrices (`RankGroup.buckets`), the same on every rank whichever are fresh."""
        for (device, _), group in by_device(hosted, lambda s: (s.param.device, s.param.dtype)):
            items = [(s.share, s.host.writeback, s.matrix(s.param) if id(s) in fresh else None) for s in group]
            # one all-gather per bucket of `GATHER_BUCKET_BYTES`, in the same order on every rank
            for bucket in self.shards.buckets(items):
                self.shards.gather_into(bucket, self.shards.device_for(device), "write-back all-gather", keep=True)

    def drain_and_apply(self) -> None:
        worker = self.ensure_worker()
        worker.synchronize()
        if self.writeback_pending:
            self.write_back()
