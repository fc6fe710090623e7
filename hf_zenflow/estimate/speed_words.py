"""A step time against another in words that say the direction: "4.28x faster", "2.54x slower", "same speed", and
"baseline" for the schedule compared with itself (never "1.00x faster"). `hf-zenflow estimate`'s tables and sentences
and `hf-zenflow compare`'s verdict say it this way.

Example:
    >>> versus(1696.1, 7262.2)
    '4.28x faster'
    >>> versus(1696.1, 666.9)
    '2.54x slower'
    >>> versus(7262.2, 7262.2, baseline=True)
    'baseline'
    >>> than(4040.0, 7262.2, "synchronous offload")
    '1.80x faster than synchronous offload'
"""

from __future__ import annotations


def versus(time: float, baseline_time: float, baseline: bool = False) -> str:
    """`time` (a step's, any unit) against `baseline_time` (the same unit): the ratio of the longer to the shorter
    with its direction, rounded to two decimals; "same speed" when that rounds to 1.00; "baseline" when `baseline`
    (the row is the one compared with)."""
    if baseline:
        return "baseline"
    if time <= 0 or baseline_time <= 0:
        return "-"
    ratio = time / baseline_time
    if round(ratio, 2) == 1.0 and round(1 / ratio, 2) == 1.0:
        return "same speed"
    return f"{ratio:.2f}x slower" if ratio > 1 else f"{1 / ratio:.2f}x faster"


def than(time: float, baseline_time: float, name: str) -> str:
    """`versus` in a sentence: "1.80x faster than `name`", "1.10x slower than `name`" or "as fast as `name`"."""
    words = versus(time, baseline_time)
    return f"as fast as {name}" if words == "same speed" else f"{words} than {name}"


__all__ = ["than", "versus"]
