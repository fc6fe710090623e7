"""The device work of a step, counted on the CPU double of an asynchronous device with CUDA's dispatch
(tests/doubles/launches.py, through scripts/count_device_calls.py), held to the bounds the script states:

- an ordinary step (no window closes, no re-selection, nothing written back) launches at most a few per offloaded
  matrix plus a fixed number (`count_device_calls.bounds`): the gradient norms, the widening and rounding of
  narrow gathers and the AdamW are batched;
- a re-selection reads the device from the host at most twice per matrix plus a fixed number;
- at Llama-7B's largest matrix (4096 x 11008, bf16), the column scores of a re-selection and the bf16 window sum's
  add (``accumulate_on="device_bf16"``) take a few pieces of work, not tens."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow.engine import host as host_module
from hf_zenflow.engine.selection import column_scores
from tests.conftest import load_script
from tests.doubles.launches import CUDA_LIKE, DeviceCalls


count_device_calls = load_script("count_device_calls")


@pytest.mark.parametrize(("free", "accumulate_on"), [("off", "host"), ("on", "host"), ("off", "device"),
                                                     ("off", "device_bf16")])
def test_an_ordinary_step_launches_a_bounded_few_per_matrix(free, accumulate_on):
    """The bounds of scripts/count_device_calls.py (`bounds`: per offloaded matrix and for the whole step); with
    device sums the add into the window sum (one launch, three for bf16 sums) replaces the copy to the host."""
    args = count_device_calls.parser().parse_args(
        ["--matrices", "12", "--width", "48", "--dtype", "bfloat16", "--steps", "11", "--free", free,
         "--accumulate-on", accumulate_on])
    result = count_device_calls.count(args)
    checked = count_device_calls.verdict(result)
    ordinary = [r["ops"] for r in result["rows"] if r["kind"] == "ordinary"][0]
    assert checked["ok"], (checked, ordinary)
    assert result["max_per_step"]["ordinary"]["host_reads"] == 1  # the step's one sync


def test_the_scores_of_a_7b_matrix_take_a_few_pieces():
    """4096 x 11008 bf16 (45 M elements): three pieces of at most 16 M elements, four launches each."""
    g = torch.randn(4096, 11008, dtype=torch.bfloat16)
    calls = DeviceCalls()
    with CUDA_LIKE(), calls.active():
        scores = column_scores(g, 1)
    assert calls.launches <= 3 * 4, calls.by_op
    torch.testing.assert_close(scores, g.float().square().sum(0), rtol=1e-5, atol=0)


def test_the_bf16_window_sum_of_a_7b_matrix_takes_a_few_pieces():
    """``accumulate_on="device_bf16"``: a 4096 x 11008 sum in three pieces (three launches each) and one scratch."""
    g = torch.randn(4096, 11008, dtype=torch.bfloat16)
    accum = torch.randn(4096, 11008).to(torch.bfloat16)
    expected = (accum.float() + g.float() * 0.5).to(torch.bfloat16)
    calls = DeviceCalls()
    with CUDA_LIKE(), calls.active():
        host_module.accumulate_into(accum, g, 0.5, first=False)
    assert calls.launches <= 3 * 3 and calls.allocations <= 1, (calls.by_op, calls.allocations)
    assert torch.equal(accum, expected)
