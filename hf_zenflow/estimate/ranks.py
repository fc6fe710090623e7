"""How N data-parallel ranks on one node split the offloaded work: each rank's share of the host work, host memory and
link bytes, the node's host cores and memory bandwidth divided among the ranks, and the all-gather of the updated
rows at each write-back under DDP. Used by the bound model (`hardware.schedule_model`) and the emulator
(`emulator_schedules.run_estimate`), so both take the same N the same way.

The plan being modelled:

* **DDP** (``parallel="ddp"``): every rank holds the whole averaged gradient on its GPU. Each rank owns 1/N of the rows
  of every offloaded matrix: it copies only those rows' gradient over its own link, keeps host state for them only
  and runs the host AdamW on them only; at each write-back it uploads its rows and the ranks all-gather the updated
  rows so every GPU holds the whole weight. The selected-column device update, the gradient-norm read and plain
  AdamW on the device stay replicated (share 1).
* **FSDP2** (``parallel="fsdp2"``): each rank owns its shard of every matrix (rows, all input columns). Gradients,
  host work, device-side optimizer work and write-back are all 1/N; each rank writes back its own rows, so no weight
  collective is needed.

What one rank gets, on one node of N GPUs:

* host work and host memory: 1/N of the offloaded parameters (`host_share`);
* host cores and host memory bandwidth: 1/N of the node's (`core_share`). A host step is 1/N of the work on 1/N of the
  resources, so per rank it takes as long as the whole step on the whole node: the split removes the N-fold host work
  and memory of every rank doing it all (today's DDP), but does not make the host side faster than one process;
* link: each GPU has its own x16 host link, carrying 1/N of the offloaded gradient and write-back (`link_share`);
* all-gather (DDP, N > 1): a ring all-gather of the offloaded bf16 weights sends and receives (N-1)/N of their bytes
  per GPU, at the interconnect's per-GPU, per-direction bandwidth (the "bus bandwidth" nccl-tests reports). It runs
  at the write-back, on the device timeline.

Not modelled: several nodes (the profile is one node; N ranks share its host), the training thread's own core per
rank, the data-parallel gradient all-reduce and FSDP's own weight collectives (present without offload too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


#: The data-parallel engines the split is modelled for.
PARALLEL_MODES = ("ddp", "fsdp2")


def check_ranks(value: Any, name: str = "ranks") -> int:
    """`value` if it is an int >= 1, else a ValueError naming `name`, the value and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: allowed is an integer >= 1 (data-parallel ranks, one GPU "
                         "each, on one node).")
    return value


def check_parallel(value: Any, name: str = "parallel") -> str:
    if value not in PARALLEL_MODES:
        raise ValueError(f"{name}={value!r} is invalid: allowed are {', '.join(PARALLEL_MODES)}.")
    return value


@dataclass(frozen=True)
class RankSplit:
    """N data-parallel ranks on one node and how they divide the offloaded work (see the module docstring).

    Example:
        >>> s = RankSplit(ranks=4)
        >>> s.host_share, s.device_share, s.allgather_ms(8e9, interconnect_gbps=100.0)
        (0.25, 1.0, 60.0)
    """

    ranks: int = 1
    parallel: str = "ddp"

    def __post_init__(self) -> None:
        check_ranks(self.ranks, "ranks")
        check_parallel(self.parallel, "parallel")

    @property
    def host_share(self) -> float:
        """Fraction of the offloaded parameters a rank owns: its host work, host memory and link bytes."""
        return 1.0 / self.ranks

    @property
    def core_share(self) -> float:
        """Fraction of the node's host cores and host memory bandwidth a rank gets."""
        return 1.0 / self.ranks

    @property
    def link_share(self) -> float:
        """Fraction of the offloaded gradient and write-back bytes that cross one GPU's link."""
        return self.host_share

    @property
    def device_share(self) -> float:
        """Fraction of the device-side optimizer work a GPU does: DDP replicates it, FSDP2 shards it."""
        return 1.0 if self.parallel == "ddp" else 1.0 / self.ranks

    def host_ms(self, whole_node_ms: float) -> float:
        """A rank's host time for its share, given the time of the whole offloaded part on the whole node (host work
        linear in the parameters and in the cores or memory bandwidth it runs on)."""
        return whole_node_ms * self.host_share / self.core_share

    def cores_per_rank(self, host_cores: float) -> float:
        return host_cores * self.core_share

    def allgather_ms(self, offloaded_bytes: float, interconnect_gbps: float) -> float:
        """One write-back's all-gather of the updated rows (DDP; 0 for FSDP2 or one rank), ms."""
        if self.parallel != "ddp" or self.ranks == 1:
            return 0.0
        return (self.ranks - 1) / self.ranks * offloaded_bytes / (interconnect_gbps * 1e9) * 1e3

    def describe(self) -> str:
        """One sentence on what each rank owns under this engine."""
        n = self.ranks
        if self.parallel == "ddp":
            return (f"{n} DDP ranks: each owns 1/{n} of the rows of every offloaded matrix (host state, host AdamW, "
                    "link bytes), all-gathers the updated rows at each write-back, and repeats the device-side "
                    "update")
        return (f"{n} FSDP2 ranks: each owns its 1/{n} shard (host state, host AdamW, link bytes and the device-side "
                "update); each writes back its own rows, no weight collective")


__all__ = ["PARALLEL_MODES", "RankSplit", "check_parallel", "check_ranks"]
