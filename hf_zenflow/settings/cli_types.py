"""argparse types of the `hf-zenflow` numeric flags: a bad number is refused while the command line is parsed
(argparse prints the flag, the value and what is allowed, and exits with status 2), before any model is loaded or
any output folder is made."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _number(kind: type, low: float | None, high: float | None, low_open: bool, allowed: str
            ) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {allowed}")
        if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed is {allowed}")
        return value

    parse.__name__ = allowed  # (argparse names the type in some messages)
    return parse


positive_int = _number(int, 1, None, False, "an integer >= 1")
non_negative_int = _number(int, 0, None, False, "an integer >= 0")
positive_float = _number(float, 0.0, None, True, "a number > 0")
non_negative_float = _number(float, 0.0, None, False, "a number >= 0")
fraction = _number(float, 0.0, 1.0, False, "a number in [0, 1]")
#: compare's steps per turn (`hf_zenflow.compare.run_order.MIN_BLOCK_STEPS`: the drawn timeline window lies within
#: one turn)
block_steps = _number(int, 8, None, False, "an integer >= 8")


#: The suffixes of a parameter count ("7B", "350m", "1.5T"), any case.
PARAMETER_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parameter_count(text: str) -> float:
    """A number of parameters > 0: a number (7e9, 1.5e9) or one with a K, M, B or T suffix, any case (7B, 13b,
    350M)."""
    word = text.strip().lower()
    scale = PARAMETER_SUFFIXES.get(word[-1:], 1.0)
    number = word[:-1] if word[-1:] in PARAMETER_SUFFIXES else word
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed is a number of parameters > 0, e.g. 7e9, or "
                                         "one with a K, M, B or T suffix, e.g. 7B or 350M")
    return value


parameter_count.__name__ = "a number of parameters"


def memory_limit(text: str) -> int | str:
    """compare's device memory limit: "sync" (synchronous offload's), "free" (the device's free memory) or bytes,
    an integer >= 0."""
    word = text.strip().lower()
    return word if word in ("sync", "free") else _limit_int(text)


_limit_int = _number(int, 0, None, False, '"sync", "free" or an integer >= 0 (bytes)')


def interval(text: str) -> int | str:
    """An update/select interval: an integer >= 1 or "auto"."""
    return "auto" if text.strip().lower() == "auto" else _interval_int(text)


_interval_int = _number(int, 1, None, False, 'an integer >= 1 or "auto"')


__all__ = ["PARAMETER_SUFFIXES", "fraction", "interval", "memory_limit", "non_negative_float", "non_negative_int",
           "parameter_count", "positive_float", "positive_int"]
