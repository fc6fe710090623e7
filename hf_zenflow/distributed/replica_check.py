"""What ZenFlow does under more than one process, said once per process at run time.

Under DDP (an initialised `torch.distributed` process group of N > 1 ranks) `ZenFlowAdamW` splits the host work
across the ranks by default (`sharding.py`): each rank keeps host state for 1/N of every offloaded matrix and runs
the host AdamW on it. `note_host_split` says so once per process, when the host worker starts. An optimizer given a
process group of one rank (``process_group=`` a group holding only this rank) keeps the full host state in every
process: N ranks on one node then use N x the host memory and host work of one process, and it warns
(`ReplicatedHostStateWarning`).

Example:
    >>> from hf_zenflow.distributed.replica_check import warn_if_replicated
    >>> warn_if_replicated()  # no process group here: nothing to say
    False
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch


logger = logging.getLogger(__name__)


class ReplicatedHostStateWarning(UserWarning):
    """Every rank keeps a full host copy of the ZenFlow optimizer state (filter this class to silence it)."""


_warned = False


def replica_count() -> int:
    """The world size of the initialised default process group, else 1."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def note_host_split(sharing: int, process_group: Any = None) -> bool:
    """Say once per process how the host work is shared under several processes: split across `sharing` ranks
    (a log line), or, with more than one process but a group of one rank, replicated in every process (a
    `ReplicatedHostStateWarning`). Returns True when it said something on this call."""
    global _warned
    world_size = replica_count() if not _warned else 1
    if world_size <= 1:
        return False
    _warned = True
    rank = torch.distributed.get_rank()
    if sharing > 1:
        logger.info("hf_zenflow under %d processes (rank %d): the host optimizer state and the host AdamW are split "
                    "across %d ranks; each holds 1/%d of every offloaded matrix.", world_size, rank, sharing, sharing)
        return True
    warnings.warn(
        f"hf_zenflow under {world_size} processes (rank {rank}) with a process group of one rank: the ZenFlow host "
        "state is not split across ranks. Each rank keeps a full host copy of the optimizer state and runs the full "
        f"host AdamW, so {world_size} ranks on one node use {world_size}x the host memory and host work of one "
        "process. Leave process_group unset to split it across the data-parallel ranks (docs/limitations.md).",
        ReplicatedHostStateWarning,
        stacklevel=2,
    )
    return True


def warn_if_replicated() -> bool:
    """Kept for the HF glue, which calls it where it builds an optimizer over the default process group: that
    optimizer splits the host state across the group's ranks, so there is nothing to warn about any more (the
    optimizer itself says how the work is shared, `note_host_split`). Always False."""
    return False
