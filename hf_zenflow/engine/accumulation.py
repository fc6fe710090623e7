"""Where a window's unselected gradient is summed, and what the device holds for it: the byte counts and the device
room the planner weighs ``accumulate_on="auto"`` with (the choice itself: `planner.plan_accumulation`), the
choice a resumed run keeps (`resumed_choice`), and the device sums' adds and their trip to the host at the window's
close (`add_to_device_sums`, `ship_device_sums`).

``"host"``: every step the whole gradient of each offloaded matrix goes to the host and the worker adds it into its
accumulator. ``"device"``: an fp32 window sum per offloaded matrix stays on the device (4 B per offloaded element)
and crosses the link once per window: the host skips one pass over the state per step (the add into its
accumulator) and gets the same bits (`host.accumulate_into` is the one rule for both). ``"device_bf16"``: the same
with the sums kept in bf16 on the device (2 B per offloaded element). Each step's add is computed in fp32 (the
running sum widened, plus ``coef * grad``) and rounded to nearest bf16, so the running sum keeps bf16's 8
significant bits (a relative error up to 2**-9 per add, which does not average out over a window: the sum's error
grows with the window's length, see `host.accumulate_into`); no stochastic rounding. The bf16 sum crosses the link as
it is (half the bytes of an fp32 sum) into the host's bf16 accumulator, which the window's AdamW pass widens exactly
as it reads it. Its quality against ``"device"`` (paired seeds): BENCHMARKS.md
"Quality: low-precision host state".

The device room (`available_bytes`) is read when the first step's gradients exist (forward and backward have run,
so their peak is known):

* CUDA: what the next forward/backward leaves free = the driver's free memory + the caching allocator's reserve
  - the peak allocated so far (the next step needs that peak again); for a model spread over several GPUs
  (``device_map``), on each GPU for the matrices it holds;
* a CPU device: nothing is known without a limit, so nothing that needs device room fits;
* either: `device_memory_limit_bytes`, the whole memory the step may hold, leaves the limit less the larger of the
  peak counted so far (`device_memory.py`: weights and gradients after the first backward) and what the step holds
  beside the sums (`device_budget.py`: weights, the whole-on-device parameters' state and gradients); on CUDA the
  smaller of that and the measured room.

Device sums need the sums and the optimizer state the first selection will put on the device (fp32 master and two
moments of the selected columns, and their gathered gradient in the gradient's dtype: 16 B per selected element of an
fp32 model, 14 B of a bf16 one, `selected_bytes`: `device_bytes_needed`), within that room less a margin of `MARGIN`
of the device's memory (fragmentation, longer batches later); when the gradients are freed in backward
(`free_gradients_in_backward`, which needs host sums), device sums also keep each offloaded matrix's gradient on the
device until `step()` (its clip coefficient is known only then).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..settings.config import DEVICE_SUM_DTYPES
from ..transport.link import CopyEvents, Transport
from .device_state import gathered_dtype
from .host import accumulate_into


if TYPE_CHECKING:
    from ..distributed.sharding import Share
    from ..settings.config import ZenFlowConfig
    from .split_matrix import SplitMatrix
    from .telemetry import ZenFlowStats

#: Fraction of the device's memory (under a limit: of the limit) that device accumulation must leave free, and of the
#: host RAM the host state must leave free (`planner.host_room`).
MARGIN = 0.10

#: Device bytes per selected element the first selection adds besides the gathered gradient: fp32 master, exp_avg,
#: exp_avg_sq.
SELECTED_STATE_BYTES = 12
#: Device bytes per selected element with an fp32 gathered gradient (an fp32 model); `selected_bytes` for any dtype.
SELECTED_BYTES = SELECTED_STATE_BYTES + 4


def selected_bytes(grad_dtype: torch.dtype) -> int:
    """Device bytes per selected element of a matrix whose gradients are `grad_dtype`: the fp32 state and the
    gathered gradient (bf16 and fp16 gathered as they are, `device_state.gathered_dtype`).

    Example:
        >>> selected_bytes(torch.float32), selected_bytes(torch.bfloat16)
        (16, 14)
    """
    return SELECTED_STATE_BYTES + gathered_dtype(grad_dtype).itemsize


def device_bytes_needed(splits: list[SplitMatrix], shares: dict[int, Share], sum_bytes: int = 4) -> int:
    """Window sums (`sum_bytes` per element: 4 fp32, 2 bf16) of this rank's share of every matrix in `splits`, plus
    the selected columns' state."""
    total = 0
    for split in splits:
        matrix = split.matrix(split.param)
        total += sum_bytes * shares[id(split)].local(matrix).numel()
        total += selected_bytes(split.grad_dtype) * split.k * (matrix.numel() // max(1, split.columns))
    return total


def available_bytes(device: torch.device, limit: int | None, peak: int = 0) -> tuple[int | None, int | None]:
    """(bytes the device can give the optimizer beyond the next step's peak, the device's size for the margin);
    (None, None) when unknown (a CPU device without a limit). `limit`: the whole memory the step may hold
    (`device_memory_limit_bytes`), of which `peak` (the step's estimated peak beside the window sums) is taken.

    Example:
        >>> available_bytes(torch.device("cpu"), 10 << 20, peak=4 << 20), available_bytes(torch.device("cpu"), None)
        ((6291456, 10485760), (None, None))
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        measured = torch.cuda.max_memory_allocated(device)
        spare = max(0, free + torch.cuda.memory_reserved(device) - measured)
        if limit is not None:  # (`peak`: an estimate of the step's peak may exceed what the first backward reached)
            spare, total = min(spare, max(0, limit - max(measured, peak))), min(total, limit)
        return spare, total
    if limit is None:
        return None, None
    return max(0, limit - peak), limit


def resumed_choice(config: ZenFlowConfig, zenflow: dict) -> str | None:
    """The accumulation a resumed "auto" run keeps: the checkpoint's choice (or its explicit rule); None while it
    had not decided yet, or when the rule is explicit."""
    if config.rules.accumulate_on != "auto":
        return None
    saved = zenflow.get("accumulate_on") or ((zenflow.get("config") or {}).get("rules") or {}).get("accumulate_on")
    return saved if saved in ("host", *DEVICE_SUM_DTYPES) else None


def add_to_device_sums(work: list[tuple[SplitMatrix, torch.Tensor]], coef: float | None,
                       transport_of: Callable[[SplitMatrix], Transport]) -> None:
    """``accumulate_on="device"`` / ``"device_bf16"``: add this step's gradients into the device-side window sums,
    fp32 / bf16 (the caller's stream, like the rest of the device update); nothing crosses the link until the window
    closes."""
    for split, g in work:
        if split.window_count == 0:
            transport_of(split).before_window_add(split)  # (CUDA: the last window's copy has read it)
        accumulate_into(split.window_sum, split.host_part(g), coef, first=split.window_count == 0)
        split.window_count += 1


def ship_device_sums(splits: list[SplitMatrix],
                     by_transport: Callable[[list[SplitMatrix]], list[tuple[Transport, list[SplitMatrix]]]],
                     stats: ZenFlowStats) -> CopyEvents:
    """``accumulate_on="device"`` / ``"device_bf16"``: move each closed window's device sum to the host, once per
    window; returns what the host step must wait for. The caller has made sure no host step still reads the
    accumulators."""
    shipped = [s for s in splits if s.window_sum is not None and s.window_count]
    landed = CopyEvents()
    # the sum crosses the link in its own dtype: fp32, or bf16 with "device_bf16" (half the bytes); what the host
    # accumulator keeps of it (`HostMatrix.keeps_unselected_sums`: its columns not on the device)
    stats.bytes_to_host += sum(s.host.accum.nbytes for s in shipped)
    for transport, group in by_transport(shipped):
        landed.events += transport.ship_window_sums(group).events
    for split in shipped:
        split.host.accum_count, split.window_count = split.window_count, 0
    return landed
