"""The optimizers users construct: `ZenFlowAdamW` (`zenflow.py`, the orchestration of a step and the public API over
the engine's parts) and `SyncOffloadAdamW` (`sync_offload.py`, the synchronous CPU-offload baseline).

May import: `engine`, `checkpoint` (the format `state_dict()` / `load_state_dict()` write and read), `distributed`,
`transport`, `settings`, `hf_zenflow._base`. Nothing below imports this package: the checkpoint format receives the
optimizer object and does not import its class.
"""

from .sync_offload import SyncOffloadAdamW
from .zenflow import ZenFlowAdamW


__all__ = ["SyncOffloadAdamW", "ZenFlowAdamW"]
