"""`EngineState`: the state a `ZenFlowAdamW` keeps besides its param groups and settings, in one place: each
parameter's state (its split matrix or its dense device state), the host side with the run's schedule, FSDP2's local
shards, the parameters' names, and the run's counters a checkpoint keeps (skipped steps, the last clip threshold).

The optimizer owns one and orchestrates the step over its parts; the checkpoint code (`hf_zenflow.checkpoint`) saves
and restores the optimizer through it (`ZenFlowAdamW.engine_state`), reading each part through its own `state()` and
`load()` (`HostWindows`, `WindowSchedule`, `SplitMatrix`) and this object's for the run's counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch


if TYPE_CHECKING:
    from ..distributed.fsdp import LocalShards
    from .device_state import DenseDeviceState
    from .schedule import WindowSchedule
    from .split_matrix import SplitMatrix
    from .state_maker import StateMaker
    from .telemetry import ZenFlowStats
    from .weight_marks import WeightMarks
    from .windows import HostWindows


__all__ = ["EngineState"]


class EngineState:
    """A `ZenFlowAdamW`'s state (see the module docstring). Every part is the optimizer's own live object, shared
    by reference: `splits` (the split matrices, the dict `host.splits` holds too) and `dense` (the parameters
    updated wholly on the device), keyed by the engine's parameters (FSDP2: the local shards, `fsdp.local`);
    `host`, the host side, which keeps the run's schedule; `fsdp`; `stats`, whose ``skipped_steps`` a checkpoint
    keeps; `names`, each parameter's name where known (keyed by the parameter the caller holds: `fsdp.owner`)."""

    def __init__(self, splits: dict[torch.Tensor, SplitMatrix], dense: dict[torch.Tensor, DenseDeviceState],
                 host: HostWindows, fsdp: LocalShards, stats: ZenFlowStats, names: dict[torch.Tensor, str],
                 maker: StateMaker, weights: WeightMarks) -> None:
        self.splits, self.dense, self.host, self.fsdp, self.stats, self.names = splits, dense, host, fsdp, stats, names
        self._maker, self._weights = maker, weights
        #: the max_norm of the last `clip_grad_norm_` (None: never called; inf: measured only)
        self.clip_max_norm: float | None = None

    @property
    def schedule(self) -> WindowSchedule | None:
        """The run's schedule (None before the first step or a load), kept by the host side
        (`HostWindows.schedule`)."""
        return self.host.schedule

    def ensure_schedule(self) -> WindowSchedule:
        """The run's schedule, made at its first use (`StateMaker.ensure_schedule`)."""
        return self._maker.ensure_schedule()

    def params(self) -> list[torch.Tensor]:
        """Every parameter in param-group order as the state is keyed (FSDP2: its local shard, once the optimizer
        has found the shards)."""
        return [self.fsdp.local(p) for g in self.host.groups for p in g["params"]]

    def name_of(self, p: torch.Tensor) -> str | None:
        """The name of the engine's parameter `p` (FSDP2: of the parameter whose shard it is), None when unknown."""
        return self.names.get(self.fsdp.owner(p))

    def reset(self) -> None:
        """Forget every parameter's state, the windows in flight and the schedule (the state is being replaced;
        the host worker is idle)."""
        self.splits.clear()
        self.dense.clear()
        self.host.reset()
        self.host.schedule = None

    def mark_weights(self) -> None:
        """Note the weights as the optimizer leaves them, so that a later change from outside is noticed
        (`WeightMarks`)."""
        self._weights.mark(self.splits, self.dense)

    def state(self) -> dict[str, Any]:
        """The run's counters a checkpoint keeps, as plain values under the keys of its ``zenflow`` block: the steps
        skipped for non-finite gradients and the max_norm of the last `clip_grad_norm_`."""
        return {"skipped_steps": self.stats.skipped_steps, "max_grad_norm": self.clip_max_norm}

    def load(self, state: dict[str, Any]) -> None:
        """Restore what `state()` gave, from a checked checkpoint block (one without ``max_grad_norm`` leaves
        None: not recorded). The clip threshold holds until the next `clip_grad_norm_`."""
        self.stats.skipped_steps = int(state["skipped_steps"])
        self.clip_max_norm = state.get("max_grad_norm")
