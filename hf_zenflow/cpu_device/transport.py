"""`CpuDeviceTransport`: the device is the CPU, so nothing is copied where a reference will do (the worker reads the
gradient tensors themselves, a window's device-side sum becomes the host accumulator by a buffer swap, the write-back
gives the weight the buffer the worker filled as its storage): the `Transport` base behaviour, named."""

from __future__ import annotations

from ..transport import Transport


class CpuDeviceTransport(Transport):
    """The device is the CPU: references and buffer swaps instead of copies (see the module docstring)."""
