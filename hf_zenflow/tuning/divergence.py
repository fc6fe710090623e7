"""The divergence flag of the quality suite and of `hf-zenflow tune`: a run diverged when its loss ends above where it
started, or more than `DIVERGED_RATIO` times the reference optimizer's (`adamw_torch`) on the same task.

Example:
    >>> diverged(start=3.0, final=2.0, reference=1.9)
    False
    >>> diverged(start=3.0, final=3.2, reference=1.9), diverged(start=6.0, final=5.1, reference=3.3)
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


#: A run whose held-out loss ends above this multiple of the reference's counts as diverged.
DIVERGED_RATIO = 1.5


def diverged(start: float | None, final: float, reference: float | None = None) -> bool:
    """Whether a run ending at loss `final` diverged: not finite, above its `start` (the loss before training, or
    the first step's), or above `DIVERGED_RATIO` x the `reference` run's final loss (None: not compared)."""
    if not math.isfinite(final):
        return True
    if start is not None and final > start:
        return True
    return reference is not None and math.isfinite(reference) and final > DIVERGED_RATIO * reference


def curve_diverged(losses: Sequence[float], reference: float | None = None, tail: int = 3) -> bool:
    """`diverged` for a training-loss curve: the mean of its last `tail` losses against its first loss (and the
    `reference` run's mean of the same tail)."""
    if not losses:
        return False
    tail_mean = sum(losses[-tail:]) / len(losses[-tail:])
    return diverged(float(losses[0]), tail_mean, reference)
