"""`ZenFlowState`: what the checkpoint code reads and writes of a `ZenFlowAdamW`. The optimizer passes itself to
`format.pack` and `restore.load`; its class sits above this package (`hf_zenflow.optimizer`) and is not imported
here, so the format depends on the engine's parts only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol


if TYPE_CHECKING:
    from ..engine.engine_state import EngineState
    from ..settings.config import ZenFlowConfig


class ZenFlowState(Protocol):
    """What the checkpoint code reads and writes of a `ZenFlowAdamW` (which passes itself): its param groups, its
    settings, how it runs its host work, and its state (`EngineState`: each parameter's split matrix or dense device
    state, the host side with the run's schedule, FSDP2's shards, the parameters' names, the run's counters). The
    optimizer class sits above this package and is not imported here."""

    param_groups: list[dict[str, Any]]
    config: ZenFlowConfig
    host_executor: str

    @property
    def engine_state(self) -> EngineState: ...


__all__ = ["ZenFlowState"]
