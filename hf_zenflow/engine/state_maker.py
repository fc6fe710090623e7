"""What makes a `ZenFlowAdamW`'s state where the optimizer cannot: the run's schedule (`StateMaker.ensure_schedule`,
with the `min_offload_numel` a device memory limit chooses) and, with ``free_gradients_in_backward``, the first step's
state of a matrix in its backward hook (`StateMaker.in_backward`, which `BackwardHandOff.grad_ready` calls), so that
its gradient can leave the device like every later one.

The optimizer owns one `StateMaker` over its host side, its dense state and its FSDP2 shards, and keeps its param
groups current (`group_of`); the backward hooks reach the maker through the host side, never the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .params import create_state, is_split, new_schedule
from .planner import LimitChoice, choose_min_offload_numel


if TYPE_CHECKING:
    from ..distributed.fsdp import LocalShards
    from .device_state import DenseDeviceState
    from .schedule import WindowSchedule
    from .split_matrix import SplitMatrix
    from .windows import HostWindows


__all__ = ["StateMaker"]


class StateMaker:
    """Makes the run's schedule (kept by `host`: `HostWindows.schedule`) and the first step's state in its backward
    hooks; `dense` and `fsdp` are the optimizer's own (live) dense state and FSDP2 shards."""

    def __init__(self, host: HostWindows, dense: dict[torch.Tensor, DenseDeviceState], fsdp: LocalShards) -> None:
        self.host, self.dense, self.fsdp = host, dense, fsdp
        #: each parameter's param group (kept current by the optimizer: groups added, FSDP2's parameters swapped in)
        self.group_of: dict[torch.Tensor, dict[str, Any]] = {p: g for g in host.groups for p in g["params"]}
        #: the parameters whose first step's state was made in their backward hooks (cleared by the step that uses it)
        self.made_in_backward: list[torch.Tensor] = []
        self._limit_cache: tuple[tuple, LimitChoice] | None = None  # (`limit_choice`)

    def ensure_schedule(self) -> WindowSchedule:
        """The run's schedule, made at its first use."""
        host = self.host
        if host.schedule is None:
            schedule = new_schedule(host.config, host.groups, host.steps_per_epoch)
            if host.config.device_memory_limit_bytes is not None:
                schedule.limit_min_offload_numel = self.limit_choice().min_offload_numel
            host.schedule = schedule
        return host.schedule

    def limit_choice(self) -> LimitChoice:
        """`device_memory_limit_bytes`'s choice of the run's `min_offload_numel` (`engine/device_budget.py`): from
        the parameters' sizes and the settings, and whether the coming step frees its gradients in backward."""
        host = self.host
        key = (host.config, len(host.groups), host.backward.free_kind is not None, host.accumulate_on)
        if self._limit_cache is None or self._limit_cache[0] != key:  # (the first backward's hooks ask alike)
            self._limit_cache = (key, choose_min_offload_numel(host.groups, host.config, key[2], key[3],
                                                               host.copies_lag()))
        return self._limit_cache[1]

    def offload_threshold(self) -> int:
        """The run's `min_offload_numel` (a device memory limit's choice, else the setting), before the schedule
        exists too."""
        host = self.host
        if host.schedule is not None:
            return host.schedule.offload_threshold(host.config)
        if host.config.device_memory_limit_bytes is None:
            return host.config.min_offload_numel
        return self.limit_choice().min_offload_numel

    @torch.no_grad()
    def in_backward(self, p: torch.Tensor) -> SplitMatrix | None:
        """The first step's backward hook of `p`: its state now (a split matrix with host state only; the rest
        waits for `step()`), so that its gradient can leave the device like every later one."""
        host = self.host
        group = self.group_of.get(p)
        if group is None or self.fsdp.active or not is_split(p, group, host.config,
                                                              min_numel=self.offload_threshold()):
            return None
        schedule = self.ensure_schedule()
        if not self.made_in_backward:  # ("auto" decides over, and the link buffers are reserved for, all of them)
            host.prepare_first_state([(group, q) for group in host.groups for q in group["params"]
                                      if q.requires_grad], schedule)
        create_state([(group, p)], host.splits, self.dense, host.config, schedule, host.attach_host)
        self.made_in_backward.append(p)
        return host.splits.get(p)
