"""``accumulate_on="auto"``: where a window's unselected gradient is summed, chosen once per run at the first step.

Device accumulation keeps an fp32 window sum per offloaded matrix on the device (4 B per offloaded element) and
sends it to the host once per window: the host then skips one full pass over the state per step (the add into its
accumulator) and gets the same bits (`host.accumulate_into` is the one rule for both). So "auto" takes the device
whenever the sums fit, and the host otherwise; it does not weigh the host's speed, since removing a host pass never
costs anything but the memory.

"Fit" is decided when the first step's gradients exist (forward and backward have run, so their peak is known):

* CUDA: what the next forward/backward leaves free = the driver's free memory + the caching allocator's reserve
  - the peak allocated so far (the next step needs that peak again); capped by `device_memory_budget_bytes` when
  it is set;
* a CPU device: `device_memory_budget_bytes` (None: nothing is known, so "host", today's behaviour and what tests
  and `hf-zenflow compare` rely on).

The sums fit when they, plus the optimizer state the first selection will put on the device (fp32 master and two
moments of the selected columns, and their gathered gradient: 16 B per selected element), stay under that figure
minus a margin of `MARGIN` of the device's memory (fragmentation, longer batches later). Several ranks agree: the
host if any rank says host. The choice is logged, reported by ``stats()["accumulate_on"]`` and kept in checkpoints.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from ..distributed.sharding import RankGroup, Share
    from ..settings.config import ZenFlowConfig
    from .split_matrix import SplitMatrix

logger = logging.getLogger("hf_zenflow")

#: Fraction of the device's memory (a CPU device: of the budget) that device accumulation must leave free.
MARGIN = 0.10

#: Device bytes per selected element the first selection adds: fp32 master, exp_avg, exp_avg_sq, gathered gradient.
SELECTED_BYTES = 16


def device_bytes_needed(splits: list[SplitMatrix], shares: dict[int, Share]) -> int:
    """fp32 window sums of this rank's share of every matrix in `splits`, plus the selected columns' state."""
    total = 0
    for split in splits:
        matrix = split.matrix(split.param)
        total += 4 * shares[id(split)].local(matrix).numel()
        total += SELECTED_BYTES * split.k * (matrix.numel() // max(1, split.columns))
    return total


def available_bytes(device: torch.device, budget: int | None) -> tuple[int | None, int | None]:
    """(bytes the device can give the optimizer beyond the next step's peak, the device's size for the margin);
    (None, None) when unknown (a CPU device without a budget)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        spare = free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device)
        spare = max(0, spare)
        return (spare if budget is None else min(spare, budget)), total
    if budget is None:
        return None, None
    return budget, budget


def decide(config: ZenFlowConfig, splits: list[SplitMatrix], shares: dict[int, Share], ranks: RankGroup) -> str:
    """The resolved accumulation for `config.accumulate_on` ("auto" decides; an explicit value stays), agreed by
    every rank of `ranks` (a collective when there are several: call it on every rank at the same step)."""
    if config.accumulate_on != "auto":
        return config.accumulate_on
    need = device_bytes_needed(splits, shares)
    device = splits[0].param.device if splits else torch.device("cpu")
    spare, size = available_bytes(device, config.device_memory_budget_bytes)
    fits = spare is not None and size is not None and need <= spare - MARGIN * size
    if ranks.ranks > 1:
        # one vote per rank for the host; any vote wins (the most conservative choice), the same on every rank
        votes = torch.tensor([0.0 if fits else 1.0], device=device)
        ranks.all_reduce_sum([votes], "accumulate_on agreement")
        fits = float(votes) == 0.0
    choice = "device" if fits else "host"
    if spare is None:
        why = "device memory unknown on a CPU device without device_memory_budget_bytes"
    else:
        why = (f"window sums and selected columns {need / 2**20:.1f} MiB vs {spare / 2**20:.1f} MiB spare on "
               f"{device.type} (margin {MARGIN:.0%} of {size / 2**20:.1f} MiB)")
    logger.info('hf_zenflow: accumulate_on="auto" chose "%s" (%s%s)', choice, why,
                f"; agreed over {ranks.ranks} ranks" if ranks.ranks > 1 else "")
    return choice


def resumed_choice(config: ZenFlowConfig, zenflow: dict) -> str | None:
    """The accumulation a resumed "auto" run keeps: the checkpoint's choice (or, from a checkpoint written before
    "auto" existed, its explicit setting); None while it had not decided yet, or when the setting is explicit."""
    if config.accumulate_on != "auto":
        return None
    saved = zenflow.get("accumulate_on") or (zenflow.get("config") or {}).get("accumulate_on")
    return saved if saved in ("host", "device") else None
