"""Host memory a schedule needs, from its settings alone, before any host state exists: what `HostMatrix.create`
allocates per offloaded element (`host_bytes_per_element`; a transport's pinned rings, which do not grow with the
model, are its `Transport.fixed_host_bytes`). The planner weighs schedules by it (`planner.py`) and `hf-zenflow
estimate` counts its host memory with it, so both follow the host state as it is built.

Example:
    >>> import torch
    >>> from hf_zenflow.engine.host import HostLayout
    >>> from hf_zenflow.transport import CudaTransport
    >>> gpu = CudaTransport()  # (made, never used: no GPU needed)
    >>> layout = HostLayout(moments=torch.bfloat16)
    >>> host_bytes_per_element(layout, "host", torch.bfloat16, torch.bfloat16, gpu)  # 4 + 4 + 4 + 2 + 2 x 2
    18.0
"""

from __future__ import annotations

import torch

from ..settings.config import sums_on_device
from ..transport import Transport
from .host import GRAD_SLOTS, HostLayout, HostMatrix
from .step_model import FP32_BYTES, MOMENT_BYTES


#: Elements of the matrix `host_bytes_per_element` asks `HostMatrix.writeback_bytes` about.
_ELEMENTS = 1 << 20
_MOMENT_SETTING = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}


def host_bytes_per_element(layout: HostLayout, accumulate_on: str, weight_dtype: torch.dtype,
                           grad_dtype: torch.dtype, transport: Transport, ranks: int = 1,
                           device_share: float = 0.0, slots: int = GRAD_SLOTS) -> float:
    """Host bytes per offloaded element of a matrix whose weights are `weight_dtype` and whose gradients cross the
    link in `grad_dtype`, with its host state stored as `layout` says (where it applies over `transport` with the host
    state shared by `ranks` ranks: `HostLayout.on_link`) and its window summed as `accumulate_on` says ("host",
    "device" or "device_bf16"): the fp32 master, the two moments, the window sum (summed on the host with
    ``host_sum_columns="unselected"``, only the `1 - device_share` of the columns not on the device; summed on the
    device, the accumulator it lands in, in its dtype), the gradient landing buffers of `slots` hand-off slots
    (`host.grad_slots`) where the transport stages gradients, and the write-back buffer
    (`HostMatrix.writeback_bytes`)."""
    layout = layout.applied(transport, ranks)
    moments = 2 * MOMENT_BYTES[_MOMENT_SETTING[layout.moments]]
    kept = 1.0 - device_share if HostMatrix.keeps_unselected_sums(layout, accumulate_on, weight_dtype,
                                                                   transport) else 1.0
    if sums_on_device(accumulate_on):
        # (the accumulator a device sum lands in)
        host_sum = (2.0 if accumulate_on == "device_bf16" else 4.0) * kept
        landing = 0.0
    else:
        host_sum = layout.sums.itemsize * kept
        landing = slots * grad_dtype.itemsize if transport.stages_gradients else 0.0
    matrix = torch.empty((1, _ELEMENTS), dtype=weight_dtype, device="meta")
    writeback = HostMatrix.writeback_bytes(matrix, accumulate_on, transport, layout) / _ELEMENTS
    return FP32_BYTES + moments + host_sum + landing + writeback


__all__ = ["host_bytes_per_element"]
