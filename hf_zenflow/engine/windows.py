"""The host side of a ZenFlow step: the windows' state, the host state attached to each offloaded matrix, how a
window closes and how its result gets back into the weights. One gradient's way, in the order of this module:

1. **from its backward hook to the step's hand-off** (`backward.BackwardHandOff`, `HostWindows.backward`): its copy
   to the host started in backward, or the gradient freed there; the step's copies; the hand-off held until the step
   knows whether it closes the window;
2. **into the window** (`HostWindows.hand_off`): the host worker adds the handed-off gradients into the window sums,
   or, with ``accumulate_on="device"`` or ``"device_bf16"``, the device sums the window
   (`accumulation.add_to_device_sums`);
3. **window close** (`close_window`): the window's host AdamW is submitted to the worker, the closing step's
   gradients folded into the same pass over the host state;
4. **write-back** (`write_back`): at once (``overlap_step=False``) or ``writeback_lag`` steps into the next window
   (`apply_previous_window`), while the device trains on; the device columns go back on top.

What crosses the link goes through one `Transport` per device type (`Transports`); the host jobs run in order on one
`HostAdamWorker`, whose life `WorkerKeeper` keeps. With several data-parallel ranks each rank's host side covers its
share of every matrix, and the write-back all-gathers the shares (`distributed/sharding.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from .._base import by_device
from ..distributed.replica_check import note_host_split
from ..distributed.sharding import RankGroup
from ..settings.config import ZenFlowConfig, sums_on_device
from ..transport import Transport, Transports
from ..transport.cpu_device.rounding import matrix_key
from .accumulation import add_to_device_sums, resumed_choice, ship_device_sums
from .backward import BackwardHandOff, offloaded
from .device_budget import estimate_peak
from .device_memory import DeviceMemoryMeter
from .device_state import DeviceColumns, scatter_columns
from .host import GRAD_SLOTS, HostLayout, HostMatrix, grad_slots, host_adamw_window
from .host_guard import HostStepGuard
from .host_lr import LrScaleRecord, host_hyper, peak_lr, window_lag
from .params import is_split
from .planner import RunSizes, plan_accumulation
from .schedule import WindowSchedule
from .selection import num_selected
from .split_matrix import SplitMatrix
from .telemetry import StepTimer, ZenFlowStats
from .worker import HostAdamWorker, WorkerKeeper, cuda_device_of


__all__ = ["HostWindows"]


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
        #: each gradient of an offloaded matrix from its backward hook to the step's hand-off (`backward.py`)
        self.backward = BackwardHandOff(self)
        self.pending: Any = None  # Future of the host step whose result awaits write-back (overlap mode)
        self.writeback_pending = False
        self.unapplied_steps: list[int] = []  # sizes of windows submitted but not yet written back
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
        #: the run's schedule: None until the first step (or a load) makes it (`StateMaker.ensure_schedule`), and
        #: again after a reset
        self.schedule: WindowSchedule | None = None
        #: the epoch length in optimizer steps, the data's (`ZenFlowAdamW.set_steps_per_epoch`): select_strategy
        #: "epoch" and "auto" re-select by it; None: unknown
        self.steps_per_epoch: int | None = None
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
        """Where windows are summed: the explicit rule, or "auto"'s choice (None before it is made)."""
        rule = self.config.rules.accumulate_on
        return self.accumulate_chosen if rule == "auto" else rule

    def reset(self) -> None:
        """Forget every window in flight (the optimizer's state is being replaced; the worker is idle). The
        transports go too, their pinned blocks unlocked now: a reload never keeps two copies page-locked."""
        self.pending, self.writeback_pending, self.unapplied_steps = None, False, []
        self.guard = HostStepGuard()
        self.backward.release()
        self.transports.forget()
        self.backward.in_flight.clear()  # (closing the transports waited for every copy)
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
        cores stay claimed and the transports keep their pinned rings), and a host worker's failure is
        forgotten (`engine/failure.py`)."""
        worker = self.worker
        if worker is not None and (worker.threads, worker.background) != (threads, background):
            self.stop_worker()
        self.keeper.failure = None

    def guard_factor(self) -> float:
        """The host lr's factor under the configured `host_step_guard` (`HostStepGuard.factor_for`)."""
        return self.guard.factor_for(self.config.rules.host_step_guard)

    def stop_worker(self) -> None:
        """Stop the worker thread only (a later step starts a new one, e.g. with other settings); the run goes on:
        the cores stay claimed and the pinned link buffers stay pinned. The slot of copies started in backward goes
        back first: it is the stopped worker's."""
        self.backward.release()
        self.keeper.stop()

    def close(self) -> None:
        """The end of a run: stop the worker and give the training thread its cores back, and unlock the pinned link
        buffers (a later step starts a new worker and works on ordinary memory, with synchronous copies)."""
        self.backward.release()
        self.keeper.close()
        self.transports.close()
        self.backward.in_flight.clear()  # (closing waited for every copy)

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
            may_replace_inline=self.backward.early is None,
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
                             self.backward.free_kind is not None, copies_lag=self.copies_lag()).beside_window_sums

    def _decide(self, splits: list[SplitMatrix], shares: dict) -> None:
        local = [getattr(p, "_local_tensor", p) for g in self.groups for p in g["params"] if p.requires_grad]
        elements = float(sum(p.numel() for p in local))
        sizes = RunSizes(splits, shares, self.transport_of, elements,
                         elements * (self.param_shards.ranks if self.param_shards is not None else 1),
                         peak=max(self.meter.peak_bytes if self.meter is not None else 0, self.limit_peak()),
                         frees_gradients=self.backward.free_kind is not None)
        self.accumulate_chosen = plan_accumulation(self.config, sizes, self.reduce_group)

    def prepare_first_state(self, entries: list[tuple[dict, torch.Tensor]], schedule: WindowSchedule) -> None:
        """Before the first step's state is made in its backward hooks (`BackwardHandOff.grad_ready`), for the matrices
        of `entries` that will have host state: ``accumulate_on="auto"``'s choice over all of them."""
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

    def attach_host(self, splits: list[SplitMatrix]) -> None:
        """Create the host state of `splits`."""
        shares = {id(s): self.shards.share(1 - s.axis, s.matrix(s.param).shape[1 - s.axis]) for s in splits}
        if self.accumulate_on is None and splits:
            # "auto" decides at the first host state: the first step's gradients exist (its forward and backward
            # have run), and every rank creates its first host state at the same step
            self._decide(splits, shares)
        accumulate_on = self.accumulate_on
        layout = HostLayout.of(self.config)
        ordinals = {id(p): i for i, p in enumerate(p for g in self.groups for p in g["params"])}
        for split in splits:
            # (the parameter's place in the param groups, and its rows' place under FSDP2: what every rank and a
            # resumed run agree on)
            ordinal = ordinals.get(id(split.owner), ordinals.get(id(split.param), 0))
            first_row = (self.param_shards.share(0, split.owner.shape[0]).start
                         if self.param_shards is not None and split.owner is not split.param else 0)
            stream = split.random_stream(matrix_key(self.rounding_seed, ordinal), shares[id(split)], first_row)
            split.attach_host(accumulate_on, self.transport_of(split), shares[id(split)], split.grad_dtype, layout,
                              stream, self.slots)

    # ---- 2. into the window -----------------------------------------------------------------------------------------

    def hand_off(
        self, entries: list[tuple[dict, torch.Tensor]], grads: list[torch.Tensor], coef: float | None,
    ) -> None:
        """This step's gradients of the offloaded matrices (times `coef`) into the window: to the host worker
        (`BackwardHandOff.hand_off`), or into the device window sums (`accumulation.add_to_device_sums`)."""
        if not sums_on_device(self.accumulate_on):
            self.backward.hand_off(entries, grads, coef)
        elif work := offloaded(self.splits, entries, grads):
            add_to_device_sums(work, coef, self.transport_of)

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
                                              self.guard.factor_for(self.config.rules.host_step_guard))
                    self.lr_scale.note(self.config.rules.host_lr_scale, scale, peak_lr(group), lag, full)
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
                landed = ship_device_sums([s for s in self.splits.values() if s.host is not None],
                                          self.by_transport, self.stats)

        # What waits for this AdamW job: only the write-back `writeback_steps` later (`apply_previous_window`, in
        # `step()`). The job keeps the closing step's hand-off slot until it has run, and the jobs of the steps up
        # to that write-back queue behind it on the in-order worker with a slot each: one slot for each of those
        # steps beside it, or a backward hook of one of them would wait in `take_slot` for the AdamW (the device
        # idle meanwhile).
        self.provide_slots(grad_slots(schedule.writeback_steps(self.config.overlap_step)))
        # (with this step's gradients folded in)
        future = self.backward.held.submit_close(worker, work, landed, host_adamw_window)
        self.unapplied_steps.append(steps)
        self.pending, self.writeback_pending = future, True
        if sequential:
            with timer.phase("wait"):
                worker.wait(future)
            with timer.phase("writeback"):
                self.write_back()

    def provide_slots(self, count: int) -> None:
        """At least `count` hand-off slots (`host.grad_slots`): each matrix whose transport stages gradients gets
        its landing buffers for the new slots, then the worker's pool the new indices. In `step()`, between backward
        passes, so no hook takes a slot meanwhile."""
        if count <= self.slots:
            return
        for split in self.splits.values():
            if split.host is not None:
                split.host.add_staging(count)
        self.slots = count
        if self.worker is not None:
            self.worker.provide_slots(count)

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
