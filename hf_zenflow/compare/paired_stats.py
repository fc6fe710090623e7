"""Paired differences: their mean and its t-based 95 % interval, without a scipy dependency (`hf-zenflow compare`'s
verdict gives its speed ratios an interval this way; the quality study and `examples/first_finetune.py` report
ZenFlow-minus-reference differences over seeds with it, through `hf_zenflow.tuning.paired_stats`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


#: Two-sided 95 % quantiles of Student's t by degrees of freedom (no scipy dependency).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """Two-sided 95 % Student-t quantile (the next tabulated df at or below `df`; 1.96 beyond 120)."""
    if df < 1:
        raise ValueError(f"t95: df={df} is invalid: allowed is an integer >= 1.")
    if df > 120:
        return 1.96
    return _T95[max(k for k in _T95 if k <= df)]


def paired_interval(diffs: Sequence[float]) -> tuple[float, float | None]:
    """Mean of paired differences and the half-width of its t-based 95 % interval (None with one value).

    Example:
        >>> m, h = paired_interval([1.0, 2.0, 3.0])
        >>> round(m, 3), round(h, 3)
        (2.0, 2.484)
    """
    values = [float(d) for d in diffs]
    if not values:
        raise ValueError("paired_interval needs at least one difference.")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
