"""The link between the device and the host: what crosses it and how, one module per kind of device.

Owns the interface (`link.py`: `Transport`, `Landed`, and `LinkedMatrix` / `HostEnd`, the few tensors of an
offloaded matrix the link moves), the copying kinds (`copying.py`: `CopyTransport`; `cuda.py`: `CudaTransport`
with its side streams and events), page-locked host memory (`pinned.py`) and the CPU as the device (`cpu_device/`:
the reference-and-swap transport and the C kernels in `cpu_device/csrc/`). `transport_for` picks the kind for a device.

May import: `settings`, `hf_zenflow._base`. It knows tensors and buffers, not the engine's types: `SplitMatrix` and
`HostMatrix` satisfy `LinkedMatrix` and `HostEnd` without this package importing them.
"""

import torch

from .copying import CopyTransport
from .cpu_device.transport import CpuDeviceTransport, CpuShardTransport
from .cuda import CudaStreams, CudaTransport
from .link import HostEnd, Landed, LinkedMatrix, Transport
from .pinned import ARENA_ALIGN, PinnedArena


def transport_for(device: torch.device) -> Transport:
    """The transport for parameters on `device`."""
    if device.type == "cuda":
        return CudaTransport()
    if device.type == "cpu":
        return CpuDeviceTransport()
    return CopyTransport()


__all__ = [
    "ARENA_ALIGN",
    "CopyTransport",
    "CpuDeviceTransport",
    "CpuShardTransport",
    "CudaStreams",
    "CudaTransport",
    "HostEnd",
    "Landed",
    "LinkedMatrix",
    "PinnedArena",
    "Transport",
    "transport_for",
]
