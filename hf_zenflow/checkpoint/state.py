"""`ZenFlowState`: what the checkpoint code reads and writes of a `ZenFlowAdamW`. The optimizer passes itself to
`format.pack` and `restore.load`; its class sits above this package (`hf_zenflow.optimizer`) and is not imported
here, so the format depends on the engine's parts only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch


if TYPE_CHECKING:
    from ..distributed.fsdp import LocalShards
    from ..engine.device_state import DenseDeviceState
    from ..engine.schedule import WindowSchedule
    from ..engine.split_matrix import SplitMatrix
    from ..engine.telemetry import ZenFlowStats
    from ..engine.windows import HostWindows
    from ..settings.config import ZenFlowConfig


class ZenFlowState(Protocol):
    """What the checkpoint code reads and writes of a `ZenFlowAdamW` (which passes itself): its parts' state. The
    optimizer class sits above this package and is not imported here."""

    param_groups: list[dict[str, Any]]
    config: ZenFlowConfig
    host_executor: str
    _split: dict[torch.Tensor, SplitMatrix]
    _dense: dict[torch.Tensor, DenseDeviceState]
    _schedule: WindowSchedule | None
    _stats: ZenFlowStats
    _fsdp: LocalShards
    _param_names: dict[torch.Tensor, str]
    _clip_max_norm: float | None

    @property
    def host_windows(self) -> HostWindows: ...

    def _engine_params(self) -> list[torch.Tensor]: ...

    def _ensure_schedule(self) -> WindowSchedule: ...

    def _reset_state(self) -> None: ...

    def _mark_weights(self) -> None: ...

    def close(self) -> None: ...


__all__ = ["ZenFlowState"]
