"""`CpuDeviceTransport`: the device is the CPU, so nothing is copied where a reference will do (the worker reads the
gradient tensors themselves, a window's device-side sum becomes the host accumulator by a buffer swap, the write-back
gives the weight the buffer the worker filled as its storage): the `Transport` base behaviour, named."""

from __future__ import annotations

import torch

from ..copying import CopyTransport
from ..link import CopyEvents, HostEnd, LinkedMatrix, Transport


class CpuDeviceTransport(Transport):
    """The device is the CPU: references and buffer swaps instead of copies (see the module docstring)."""


class CpuShardTransport(CopyTransport):
    """FSDP2 shards on a CPU device. The write-back copies into the shard, a view of FSDP2's flat sharded storage
    from which it all-gathers the weights (a storage swap would detach the view): `CopyTransport`'s. The gradients
    are read where they are, as on any CPU device: FSDP2 gives each step's reduce-scatter a new output, of which the
    gradient shard is a view, and the optimizer drops the parameter's reference at the hand-off, so nothing
    overwrites it while the worker reads it. No staging slots, then: a rank holds half of one process's host state
    on 2 ranks instead of 0.70x (two gradient copies per element)."""

    stages_gradients = False

    def hand_off(self, work: list[tuple[LinkedMatrix, torch.Tensor]], slot: int
                 ) -> tuple[list[tuple[HostEnd, torch.Tensor]], CopyEvents]:
        return Transport.hand_off(self, work, slot)
