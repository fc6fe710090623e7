"""Closing a window and writing its host result back: the part of `HostWindows` that submits a window's host
AdamW (with the closing step's gradients folded in, `held_handoff.py`), waits for it when the schedule says, and puts
the result into the weights (through the transport; with several ranks, one all-gather of the shares).

When: at once with ``overlap_step=False``; otherwise the step ``writeback_lag`` into the next window
(`schedule.WindowSchedule.boundary_writes_back`), while the device trains on. `WindowCloses` is mixed into
`HostWindows` (`windows.py`), whose state (splits, groups, worker, transports, shards, stats) it uses.
"""

from __future__ import annotations

import torch

from .._base import by_device
from ..settings.config import sums_on_device
from .device_state import DeviceColumns, scatter_columns
from .host import HostMatrix, host_adamw_window
from .host_lr import host_hyper, peak_lr, window_lag
from .schedule import WindowSchedule
from .split_matrix import SplitMatrix
from .telemetry import StepTimer


class WindowCloses:
    """Window closes and write-backs of `HostWindows` (see the module docstring)."""

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
        self.guard.closed(scales, schedule.high_lr_window)  # (what an overshoot of this window's result is measured
        # against, and whether "auto" watches it)
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

        # (with this step's gradients folded in)
        future = self.held.submit_close(worker, work, landed, host_adamw_window)
        self.unapplied_steps.append(steps)
        self.pending, self.writeback_pending = future, True
        if sequential:
            with timer.phase("wait"):
                worker.wait(future)
            with timer.phase("writeback"):
                self.write_back()

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


__all__ = ["WindowCloses"]
