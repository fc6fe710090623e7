"""``accumulate_on="auto"``: where a window's unselected gradient is summed, chosen once per run at the first step.

Device accumulation keeps an fp32 window sum per offloaded matrix on the device (4 B per offloaded element) and
sends it to the host once per window: the host then skips one full pass over the state per step (the add into its
accumulator) and gets the same bits (`host.accumulate_into` is the one rule for both). So "auto" takes the device
whenever the sums fit, and the host otherwise; it does not weigh the host's speed, since removing a host pass never
costs anything but the memory.

Between the two, ``"device_bf16"``: the same schedule with the sums kept in bf16 on the device (2 B per offloaded
element). Each step's add is computed in fp32 (the running sum widened, plus ``coef * grad``) and rounded to
nearest bf16, so the running sum keeps bf16's 8 significant bits (a relative error up to 2**-9 per add, which does
not average out over a window: the sum's error grows with the window's length, see `host.accumulate_into`); no
stochastic rounding. The bf16 sum crosses the link as it is (half the bytes of an fp32 sum) into a bf16 landing
buffer on the host, and the host worker widens it exactly into its fp32 accumulator, the AdamW's input. "auto"
picks it exactly when fp32 sums do not fit and bf16 sums do. Its quality against ``"device"`` (paired seeds):
BENCHMARKS.md "Quality: low-precision host state".

"Fit" is decided when the first step's gradients exist (forward and backward have run, so their peak is known):

* CUDA: what the next forward/backward leaves free = the driver's free memory + the caching allocator's reserve
  - the peak allocated so far (the next step needs that peak again); capped by `device_memory_budget_bytes` when
  it is set; for a model spread over several GPUs (``device_map``), on each GPU for the matrices it holds;
* a CPU device: `device_memory_budget_bytes` (None: nothing is known, so "host", today's behaviour and what tests
  and `hf-zenflow compare` rely on);
* either: `device_memory_limit_bytes`, the whole memory the step may hold, leaves the limit less the larger of the
  peak counted so far (`device_memory.py`: weights and gradients after the first backward) and what the step holds
  beside the sums (`device_budget.py`: weights, the whole-on-device parameters' state and gradients), and caps the
  rest.

When the gradients are freed in backward (`free_gradients_in_backward`, which needs host sums), device sums also
keep each offloaded matrix's gradient on the device until `step()` (its clip coefficient is known only then): those
bytes count against the device sums too.

The sums (fp32, or bf16 for "device_bf16") fit when they, plus the optimizer state the first selection will put
on the device (fp32 master and two moments of the selected columns, and their gathered gradient in the gradient's
dtype: 16 B per selected element of an fp32 model, 14 B of a bf16 one, `selected_bytes`), stay under that figure
minus a margin of `MARGIN` of the device's memory (fragmentation, longer batches later). Several ranks agree: the
most conservative choice of any rank (host over bf16 sums over fp32 sums). The choice is logged, reported by
``stats()["accumulate_on"]`` and kept in checkpoints.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..settings.config import DEVICE_SUM_DTYPES
from .device_state import gathered_dtype


if TYPE_CHECKING:
    from ..distributed.sharding import RankGroup, Share
    from ..settings.config import ZenFlowConfig
    from .split_matrix import SplitMatrix

logger = logging.getLogger("hf_zenflow")

#: Fraction of the device's memory (a CPU device: of the budget) that device accumulation must leave free.
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


def available_bytes(device: torch.device, budget: int | None, limit: int | None = None,
                    peak: int = 0) -> tuple[int | None, int | None]:
    """(bytes the device can give the optimizer beyond the next step's peak, the device's size for the margin);
    (None, None) when unknown (a CPU device without a budget or a limit). `limit`: the whole memory the step may
    hold (`device_memory_limit_bytes`), of which `peak` (the peak measured so far) is taken."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        measured = torch.cuda.max_memory_allocated(device)
        spare = max(0, free + torch.cuda.memory_reserved(device) - measured)
        if budget is not None:
            spare = min(spare, budget)
        if limit is not None:  # (`peak`: an estimate of the step's peak may exceed what the first backward reached)
            spare, total = min(spare, max(0, limit - max(measured, peak))), min(total, limit)
        return spare, total
    if limit is not None:
        spare = max(0, limit - peak)
        return (spare if budget is None else min(spare, budget)), limit
    if budget is None:
        return None, None
    return budget, budget


def decide(config: ZenFlowConfig, splits: list[SplitMatrix], shares: dict[int, Share], ranks: RankGroup,
           peak: int = 0, frees_gradients: bool = False) -> str:
    """The resolved accumulation for `config.accumulate_on` ("auto" decides; an explicit value stays), agreed by
    every rank of `ranks` (a collective when there are several: call it on every rank at the same step). A model
    spread over several devices (``device_map``) gets device sums only when each device holds its own matrices'.
    `peak`: the device's peak so far (for `device_memory_limit_bytes`); `frees_gradients`: host sums free the
    offloaded matrices' gradients in backward (`free_gradients_in_backward`), which device sums keep on the device
    until `step()`: their bytes count against the device sums."""
    if config.accumulate_on != "auto":
        return config.accumulate_on
    by_device: dict[torch.device, list[SplitMatrix]] = {}
    for split in splits:
        by_device.setdefault(split.param.device, []).append(split)
    if not by_device:
        by_device[torch.device("cpu")] = []
    fits = [True, True]  # fp32 sums, bf16 sums: on every device
    whys = []
    for device, group in by_device.items():
        kept = sum(s.host_part(s.param).numel() * s.param.element_size() for s in group) if frees_gradients else 0
        needs = (device_bytes_needed(group, shares, 4) + kept, device_bytes_needed(group, shares, 2) + kept)
        spare, size = available_bytes(device, config.device_memory_budget_bytes, config.device_memory_limit_bytes,
                                      peak)
        fits = [f and spare is not None and size is not None and need <= spare - MARGIN * size
                for f, need in zip(fits, needs)]
        if spare is None:
            whys.append(f"device memory unknown on a {device.type} device without device_memory_budget_bytes")
        else:
            whys.append(f"window sums and selected columns {needs[0] / 2**20:.1f} MiB with fp32 sums, "
                        f"{needs[1] / 2**20:.1f} MiB with bf16 sums, vs {spare / 2**20:.1f} MiB spare on "
                        f"{device} (margin {MARGIN:.0%} of {size / 2**20:.1f} MiB)")
    if ranks.ranks > 1:
        # one vote per rank and option against it; any vote wins (the most conservative choice), the same on every
        # rank (fp32 sums fitting implies bf16 sums fit, so the two votes stay ordered)
        votes = torch.tensor([0.0 if f else 1.0 for f in fits], device=next(iter(by_device)))
        ranks.all_reduce_sum([votes], "accumulate_on agreement")
        fits = [float(v) == 0.0 for v in votes.tolist()]
    choice = "device" if fits[0] else "device_bf16" if fits[1] else "host"
    logger.info('hf_zenflow: accumulate_on="auto" chose "%s" (%s%s)', choice, "; ".join(whys),
                f"; agreed over {ranks.ranks} ranks" if ranks.ranks > 1 else "")
    return choice


def resumed_choice(config: ZenFlowConfig, zenflow: dict) -> str | None:
    """The accumulation a resumed "auto" run keeps: the checkpoint's choice (or, from a checkpoint written before
    "auto" existed, its explicit setting); None while it had not decided yet, or when the setting is explicit."""
    if config.accumulate_on != "auto":
        return None
    saved = zenflow.get("accumulate_on") or (zenflow.get("config") or {}).get("accumulate_on")
    return saved if saved in ("host", *DEVICE_SUM_DTYPES) else None
