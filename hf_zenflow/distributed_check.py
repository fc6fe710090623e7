"""What ZenFlow does under more than one process today, said once per process at run time.

Under DDP (any initialised `torch.distributed` process group of more than one rank) `ZenFlowAdamW` runs and the
weights match one process trained on the global batch, but nothing is sharded: every rank keeps the full host copy
of the optimizer state (fp32 master, moments, window accumulator) and runs the full host AdamW. N ranks on one node
use N x the host memory and host work of one process. `warn_if_replicated` says so, once per process, where a ZenFlow
optimizer is built for training (`ZenFlowTrainer`, `ZenFlowPlugin`).

Example:
    >>> from hf_zenflow.distributed_check import warn_if_replicated
    >>> warn_if_replicated()  # no process group here: nothing to say
    False
"""

from __future__ import annotations

import warnings

import torch


class ReplicatedHostStateWarning(UserWarning):
    """Every rank keeps a full host copy of the ZenFlow optimizer state (filter this class to silence it)."""


_warned = False


def replica_count() -> int:
    """The world size of the initialised default process group, else 1."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def warn_if_replicated() -> bool:
    """Warn (`ReplicatedHostStateWarning`) the first time it is called under a process group of more than one rank.

    Returns True when it warned on this call. Cheap: call it wherever a ZenFlow optimizer starts training.
    """
    global _warned
    world_size = replica_count() if not _warned else 1
    if world_size <= 1:
        return False
    _warned = True
    warnings.warn(
        f"hf_zenflow under {world_size} processes (rank {torch.distributed.get_rank()}): the ZenFlow host state is "
        "not sharded across ranks. Each rank keeps a full host copy of the optimizer state and runs the full host "
        f"AdamW, so {world_size} ranks on one node use {world_size}x the host memory and host work of one process "
        "(under DDP the weights still match one process trained on the global batch). See README 'Limitations'.",
        ReplicatedHostStateWarning,
        stacklevel=2,
    )
    return True
