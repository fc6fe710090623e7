"""An optimizer whose host worker failed: a host job may have updated part of the host state, so after the worker is
stopped (`HostWindows.stop_worker` keeps its failure) the optimizer takes no more steps until a checkpoint replaces
its state (`refuse_after_failure`, `drop_failed_worker`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .worker import HostWorkerError, wait_for_closed_workers


if TYPE_CHECKING:
    from .windows import HostWindows


def refuse_after_failure(host: HostWindows) -> None:
    """Raise `HostWorkerError` saying that the optimizer was closed after a failure, and how to go on."""
    failure = host.keeper.failure
    if failure is not None:
        raise HostWorkerError(
            f"ZenFlowAdamW was closed after a host worker failure ({failure}): its host state may be partly updated, "
            "so it takes no more steps. Load a checkpoint into it (load_state_dict, or the Trainer's "
            "resume_from_checkpoint) or build a new optimizer."
        ) from failure.__cause__


def drop_failed_worker(host: HostWindows) -> bool:
    """Before a new state is loaded: stop a failed worker without waiting on its failure (its state is being
    replaced). Whether there was a failure (the caller clears `host.keeper.failure` once the load succeeded)."""
    worker = host.worker
    if host.keeper.failure is None and (worker is None or not worker.failed):
        return False
    host.stop_worker()
    wait_for_closed_workers()
    return True
