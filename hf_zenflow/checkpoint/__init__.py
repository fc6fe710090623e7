"""The checkpoint format of `ZenFlowAdamW` and what moves checkpoints around.

Owns the format (`format.py`: versions, migration of older ones, what `state_dict()` writes, the file checks),
loading with every field checked before anything is written (`restore.py`, over `validate.py` and the checksums of
`seal.py`), conversions (`convert.py`: settings changed on resume, to and from `torch.optim.AdamW`) and re-sharding
rank states for another world size (`reshard.py`). `state.py` names what it reads of the optimizer.

May import: `engine`, `distributed`, `transport`, `settings`, `hf_zenflow._base`. Not `hf_zenflow.optimizer`: the
optimizer calls this package with itself (`ZenFlowState`), so a checkpoint can be read, converted and re-sharded
without the optimizer class. The old module path ``hf_zenflow.checkpoint`` keeps its names here.
"""

from .format import (
    FORMAT_VERSION,
    CheckpointError,
    SavedProgress,
    check_file,
    load_file,
    migrate,
    pack,
    saved_progress,
)
from .restore import load, unpack, validate
from .state import ZenFlowState


__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "SavedProgress",
    "ZenFlowState",
    "check_file",
    "load",
    "load_file",
    "migrate",
    "pack",
    "saved_progress",
    "unpack",
    "validate",
]
