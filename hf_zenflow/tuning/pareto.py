"""Choosing among tuning trials: the Pareto front of (quality loss, speed-up) points and the recommended point on it.

Example:
    >>> from hf_zenflow.tuning.pareto import pareto_front
    >>> pareto_front([(0.0, 1.0), (1.0, 3.0), (2.0, 2.0), (0.5, 1.0)])
    [0, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices (ascending) of the points no other point dominates, for (quality loss: lower is better, speed-up:
    higher is better). A point with a NaN coordinate is never on the front. Equal points are all kept."""
    front = []
    for i, (qi, si) in enumerate(points):
        if math.isnan(qi) or math.isnan(si):
            continue
        dominated = any(
            (qj <= qi and sj >= si) and (qj < qi or sj > si)
            for j, (qj, sj) in enumerate(points) if j != i and not (math.isnan(qj) or math.isnan(sj))
        )
        if not dominated:
            front.append(i)
    return front


def recommend(points: Sequence[tuple[float, float]], max_quality_loss: float,
              min_speedup: float = 1.0) -> tuple[int | None, bool]:
    """(index, within tolerance): the fastest point of the Pareto front whose quality loss is at most
    `max_quality_loss`; when none is, the front's point with the least quality loss and False. Points slower than
    `min_speedup` (1.0: synchronous offload's speed) are passed over while a faster front point exists.

    Example:
        >>> recommend([(0.2, 1.5), (0.8, 3.0), (3.0, 4.0)], max_quality_loss=1.0)
        (1, True)
    """
    front = pareto_front(points)
    if not front:
        return None, False
    useful = [i for i in front if points[i][1] >= min_speedup] or front
    within = [i for i in useful if points[i][0] <= max_quality_loss]
    if within:
        return max(within, key=lambda i: points[i][1]), True
    return min(useful, key=lambda i: points[i][0]), False
