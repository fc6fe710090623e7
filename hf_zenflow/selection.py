"""Which columns go to the device, when to re-select, and when an automatic window closes.

Column importance is the squared L2 norm of each input column of the gradient viewed as ``[out, in]``: the
gradient's energy is concentrated on a few input channels, and those channels are stable over many steps
(ZenFlow §2), so a selection made on one step's gradient is reused until the next re-selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


#: Elements per chunk when scoring columns: a slice of ~1M elements keeps the squared temporary cache-sized instead of
#: materialising a full-size fp32 copy of the gradient (a 4096 x 4096 matrix: 48 ms -> 8 ms with 256-row slices,
#: cpu-adam.md); counted in elements so that narrow matrices (a 30522 x 384 embedding: 9.4 -> 4.8 ms) get taller
#: slices rather than thousands of tiny ones.
SCORE_CHUNK_ELEMS = 1 << 20


def selection_axis(t: torch.Tensor) -> int | None:
    """Where a matrix's input columns lie in memory. 1: `t` is row-major, its ``[out, in]`` view's columns are
    strided. 0: `t` is a column-major 2-D matrix, stored as the contiguous ``[in, out]`` transpose (DeepSpeed
    ZenFlow's transposed layout, see `column_major_`), so an input column is a contiguous row. None: any other
    layout (such a tensor is updated densely on the device)."""
    if t.is_contiguous():
        return 1
    if t.ndim == 2 and t.t().is_contiguous():
        return 0
    return None


def storage_matrix(t: torch.Tensor, axis: int) -> torch.Tensor:
    """`t` as a contiguous matrix whose dimension `axis` indexes the input columns: the ``[out, in]`` view
    (axis 1) or the ``[in, out]`` transpose (axis 0). A view when `t` has the parameter's layout (autograd gives
    gradients the parameter's strides); a copy otherwise."""
    if axis == 1:
        return (t if t.is_contiguous() else t.contiguous()).view(t.shape[0], -1)
    m = t.t()
    return m if m.is_contiguous() else m.contiguous()


def num_selected(topk_ratio: float, columns: int) -> int:
    """k for a matrix with `columns` input columns: floor(ratio * columns), at least 1 when the ratio is positive."""
    if topk_ratio <= 0.0:
        return 0
    return min(columns, max(1, math.floor(topk_ratio * columns + 1e-9)))


def column_scores(matrix: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """Squared L2 norm of each input column (dimension `axis` of a `storage_matrix`), in fp32, in row chunks."""
    scores = torch.zeros(matrix.shape[axis], dtype=torch.float32, device=matrix.device)
    rows = max(1, SCORE_CHUNK_ELEMS // max(1, matrix.shape[1]))
    # one scratch buffer for the squares: a fresh allocation per chunk page-faults on every chunk (~4x slower here)
    scratch = torch.empty(min(rows, matrix.shape[0]) * matrix.shape[1], dtype=torch.float32, device=matrix.device)
    for start in range(0, matrix.shape[0], rows):
        chunk = matrix[start:start + rows]
        squares = scratch[: chunk.numel()].view(chunk.shape)
        if chunk.dtype == torch.float32:
            torch.mul(chunk, chunk, out=squares)
        else:
            squares.copy_(chunk).square_()
        if axis == 1:
            scores.add_(squares.sum(0))
        else:
            scores[start:start + rows] = squares.sum(1)
    return scores


def top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, sorted ascending (sorted indices keep gathers cache-friendly)."""
    if k >= scores.numel():
        return torch.arange(scores.numel(), device=scores.device)
    return torch.topk(scores, k, sorted=False).indices.sort().values


@dataclass
class ZenAutoStats:
    """Zen-auto bookkeeping for one matrix over the open window.

    The window may close once the unselected gradient mass accumulated since the last host update has caught up
    with the mean selected mass of one step, per column: ``sum_u noncrit_u / (in - k) >= mean_u crit_u / k``.
    DeepSpeed normalises "per 10% of columns" and re-applies that factor on every update, which compounds for
    ratios other than 0.1 (zenflow.md §3.7); per-column means are the same rule without that defect.
    """

    mean_critical: float = 0.0
    accumulated_noncritical: float = 0.0
    steps: int = 0

    def update(self, critical_sq: float, total_sq: float, k: int, columns: int) -> bool:
        self.steps += 1
        critical = critical_sq / k
        noncritical = max(total_sq - critical_sq, 0.0) / (columns - k)
        self.mean_critical += (critical - self.mean_critical) / self.steps
        self.accumulated_noncritical += noncritical
        return self.accumulated_noncritical >= self.mean_critical

    def reset(self) -> None:
        self.mean_critical, self.accumulated_noncritical, self.steps = 0.0, 0.0, 0

    def to_list(self) -> list[float]:
        return [self.mean_critical, self.accumulated_noncritical, float(self.steps)]

    @classmethod
    def from_list(cls, values: list[float]) -> ZenAutoStats:
        return cls(float(values[0]), float(values[1]), int(values[2]))


@dataclass
class WindowSchedule:
    """Step bookkeeping: warm-up, fixed or automatic windows, re-selection period.

    `steps` counts optimizer steps taken (skipped non-finite steps do not count). A step t (0-based) is a warm-up
    step when t < warm_up; the first selection happens at t == warm_up, and again every `select_period` steps.
    """

    warm_up: int
    update_interval: int | None  # None = automatic
    auto_ratio: float
    auto_max_interval: int
    select_period: int
    steps: int = 0
    window_steps: int = 0
    windows: int = 0
    reselections: int = 0
    last_interval: int = 0
    #: select at the next step whatever the period says (a resumed run whose `topk_ratio` changed)
    force_select: bool = False

    def in_warm_up(self) -> bool:
        return self.steps < self.warm_up

    def selection_due(self) -> bool:
        if self.steps < self.warm_up:
            return False
        return self.force_select or (self.steps - self.warm_up) % self.select_period == 0

    def window_closes(self, auto_votes: list[bool]) -> bool:
        """Called after the current step was added to the window (window_steps already counts it)."""
        if self.update_interval is not None:
            return self.window_steps >= self.update_interval
        if self.window_steps >= self.auto_max_interval:
            return True
        if not auto_votes:  # a selection step (no masses measured) or no offloaded matrix: wait for the bound
            return False
        # At least `auto_ratio` of the matrices (DeepSpeed floors this count, so 0.99 of 10 matrices means 9).
        needed = max(1, math.ceil(self.auto_ratio * len(auto_votes) - 1e-9))
        return sum(auto_votes) >= needed
