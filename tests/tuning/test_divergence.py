"""The divergence flag shared by the quality suite and `hf-zenflow tune`: above the start, above 1.5x the reference,
or not finite; a training-loss curve judged by its tail against its first step."""

from __future__ import annotations

import math

import pytest

from hf_zenflow.tuning.divergence import DIVERGED_RATIO, curve_diverged, diverged


@pytest.mark.parametrize("start, final, reference, expected", [
    (7.0, 3.4, 3.3, False),  # converged, a little above the reference
    (7.0, 13.1, 3.3, True),  # above its start: the un-normalised model under a x4 host step
    (7.0, 5.1, 3.3, True),  # below its start, but more than 1.5x the reference's
    (7.0, DIVERGED_RATIO * 3.3, 3.3, False),  # at the bound: not above it
    (7.0, math.nan, 3.3, True),
    (7.0, math.inf, None, True),
    (None, 5.0, None, False),  # nothing to compare with
    (7.0, 5.0, math.nan, False),  # a reference that did not finish says nothing
])
def test_the_flag(start, final, reference, expected):
    assert diverged(start, final, reference) is expected


def test_a_curve_is_judged_by_its_tail_against_its_first_step():
    assert not curve_diverged([7.0, 5.0, 4.0, 3.5, 3.4])
    assert curve_diverged([7.0, 5.0, 6.8, 7.5, 7.9])  # the last three average above the first
    assert not curve_diverged([7.0, 9.0, 6.0, 5.0, 4.0])  # a spike that recovered
    assert not curve_diverged([])
    assert curve_diverged([3.0, 3.0, 3.0, 3.0], reference=1.9)  # flat, but above 1.5x the reference
