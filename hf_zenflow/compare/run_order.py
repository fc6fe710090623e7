"""In which order `hf-zenflow compare` runs its three fine-tunes: one after the other, or taking turns.

A shared machine drifts: on the project's quiet 2-core machine one optimizer's whole-run step time moved 12 % between
two identical invocations (BENCHMARKS.md "Side by side"), more than the differences `compare` exists to show. Runs
that follow one another each meet a different stretch of that drift; runs that take turns in short blocks of steps
meet the same one.
So by default, on a CPU device, the runs are **interleaved**: all of them are built first (each its own model copy,
optimizer, scheduler and random stream), then each advances one block of steps in turn, the order rotating every
round so that no run always follows the same one (`turns`). Each run's clock counts only its own blocks.

What interleaving must not change is what each run computes: each carries its own random stream across the others'
turns (dropout masks are the same as in a sequential run), and a run hands over only once its host worker is idle
(`TrainingRun.advance`), so that no host work of one run overlaps another run's turn. That wait is charged to the
run that hands over; a block ends two steps into a window (after the previous window's write-back at the default
lag), where an overlapped host step has usually finished. Interleaved and sequential runs give bit-identical
weights (`tests/compare/test_run_order.py`).

Sequential order remains for what does not fit three times at once, and it is the default on CUDA, where the GPU's
step time does not drift like a shared CPU's and each run's peak device memory is only separable when it runs alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    import torch


RUN_ORDERS = ("auto", "interleaved", "sequential")
#: Steps per turn when the window length does not set it (update_interval="auto"), and the fewest allowed: the drawn
#: timeline window (`compare.timeline.TIMELINE_STEPS` = 6 steps after the 2 untimed ones) lies within one turn.
DEFAULT_BLOCK_STEPS = MIN_BLOCK_STEPS = 8
#: The bytes per parameter one run holds on the device (weights, gradients, AdamW's two moments) plus a margin for
#: activations and ZenFlow's extra buffers: interleaving is chosen only when every run's copy fits at once.
RUN_BYTES_PER_PARAM = 24


def resolve_block_steps(block_steps: int | None, update_interval: int | str) -> int:
    """Steps per turn: `block_steps` as given, else two windows (so that every turn holds whole windows and ends at
    the same point of one), else `DEFAULT_BLOCK_STEPS`.

    Example:
        >>> resolve_block_steps(None, 4), resolve_block_steps(None, "auto"), resolve_block_steps(12, 4)
        (8, 8, 12)
    """
    if block_steps is not None:
        return block_steps
    if isinstance(update_interval, int) and not isinstance(update_interval, bool):
        return max(DEFAULT_BLOCK_STEPS, 2 * update_interval)
    return DEFAULT_BLOCK_STEPS


def turns(steps: int, block_steps: int, first: int, names: Sequence[str]) -> Iterator[tuple[str, int]]:
    """The interleaved schedule: (run name, steps to advance) in the order the runs take them. The first turn of
    each run is its `first` untimed steps (state allocation, first selection: `training_run.TIMING_SKIP`), then
    blocks of `block_steps`; round r starts with run r mod len(names), so that no run always follows the same one.

    Example:
        >>> list(turns(12, 4, 2, ["a", "b"]))
        [('a', 2), ('b', 2), ('b', 4), ('a', 4), ('a', 4), ('b', 4), ('b', 2), ('a', 2)]
    """
    bounds = [0, *range(min(first, steps), steps, block_steps), steps] if first > 0 else [
        *range(0, steps, block_steps), steps]
    blocks = [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    for round_index, (lo, hi) in enumerate(blocks):
        shift = round_index % len(names)
        for name in [*names[shift:], *names[:shift]]:
            yield name, hi - lo


def resolve_run_order(run_order: str, device: torch.device, num_parameters: int, runs: int) -> tuple[str, str]:
    """"interleaved" or "sequential", and why. "auto": interleaved on a CPU device when every run's copy of the model
    with its AdamW state (`RUN_BYTES_PER_PARAM`) fits in half the memory available now; sequential on CUDA (see the
    module docstring) and where the copies would not fit."""
    if run_order not in RUN_ORDERS:
        raise ValueError(f"--run-order {run_order!r} is invalid: allowed are {', '.join(RUN_ORDERS)}.")
    if run_order != "auto":
        return run_order, "as asked (--run-order)"
    if runs < 2:
        return "sequential", "one run"
    if device.type != "cpu":
        return "sequential", f"auto on {device.type}: each run alone on the device (its own peak memory)"
    import psutil

    need, available = runs * RUN_BYTES_PER_PARAM * num_parameters, psutil.virtual_memory().available
    if need > available // 2:
        return "sequential", (f"auto: {runs} copies need ~{need / 2**30:.1f} GiB, more than half of the "
                              f"{available / 2**30:.1f} GiB available")
    return "interleaved", "auto on a CPU device: the runs take turns, so machine drift meets them alike"
