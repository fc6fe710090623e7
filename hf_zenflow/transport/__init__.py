"""The link between the device and the host: what crosses it and how, one module per kind of device.

Owns the interface (`link.py`: `Transport`, `CopyEvents`, and `LinkedMatrix` / `HostEnd`, the few tensors of an
offloaded matrix the link moves), the copying kinds (`copying.py`: `CopyTransport`; `cuda.py`: `CudaTransport`
with its side streams and events), page-locked host memory (`pinned.py`) and the CPU as the device (`cpu_device/`:
the reference-and-swap transport and the C kernels in `cpu_device/csrc/`). `transport_for` picks the kind for a device;
`Transports` keeps one optimizer's, one per device type.

May import: `settings`, `hf_zenflow._base`. It knows tensors and buffers, not the engine's types: `SplitMatrix` and
`HostMatrix` satisfy `LinkedMatrix` and `HostEnd` without this package importing them.
"""

from collections.abc import Callable

import torch

from .copying import CopyTransport
from .cpu_device.transport import CpuDeviceTransport, CpuShardTransport
from .cuda import CudaStreams, CudaTransport
from .link import CopyEvents, HostEnd, LinkedMatrix, Transport
from .pinned import ARENA_ALIGN, PinnedArena


def transport_for(device: torch.device) -> Transport:
    """The transport for parameters on `device`."""
    if device.type == "cuda":
        return CudaTransport()
    if device.type == "cpu":
        return CpuDeviceTransport()
    return CopyTransport()


class Transports:
    """One optimizer's transports, one per device type, each made at its first use (`transport_for`); `on_new` is
    told of each new one."""

    def __init__(self, on_new: Callable[[Transport], None]) -> None:
        self._by_type: dict[str, Transport] = {}
        self._on_new = on_new

    def of(self, device: torch.device, fsdp_shard: bool = False) -> Transport:
        """The transport of parameters on `device`. `fsdp_shard`: the parameters are FSDP2 shards, views into
        FSDP2's flat sharded storage, from which it all-gathers the weights: on a CPU device the write-back must
        copy into them (`CpuShardTransport`; the storage swap would detach the view)."""
        kind = device.type
        if kind not in self._by_type:
            self._by_type[kind] = CpuShardTransport() if fsdp_shard and kind == "cpu" else transport_for(device)
            self._on_new(self._by_type[kind])
        return self._by_type[kind]

    def made(self, device: torch.device) -> Transport | None:
        """The transport of parameters on `device` if one was made (`of`), else None (none is made here)."""
        return self._by_type.get(device.type)

    def values(self) -> list[Transport]:
        return list(self._by_type.values())

    def __bool__(self) -> bool:
        return bool(self._by_type)

    def compute_waits_for(self, landed: CopyEvents) -> None:
        """Sync point (device streams only): each device's compute stream waits for the copies of `landed`."""
        for transport in self._by_type.values():
            transport.compute_waits_for(landed)

    def close(self) -> None:
        """Unlock every pinned block; the transports stay (a later step works on ordinary memory)."""
        for transport in self._by_type.values():
            transport.close()

    def forget(self) -> None:
        """Close them and drop them: the next use makes new ones."""
        self.close()
        self._by_type.clear()


__all__ = [
    "ARENA_ALIGN",
    "CopyTransport",
    "CpuDeviceTransport",
    "CpuShardTransport",
    "CudaStreams",
    "CudaTransport",
    "HostEnd",
    "CopyEvents",
    "LinkedMatrix",
    "PinnedArena",
    "Transport",
    "Transports",
    "transport_for",
]
