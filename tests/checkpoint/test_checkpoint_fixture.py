"""A checkpoint written before the re-layout of the package (issue 25) loads and continues the run as it would have.

`tests/data/checkpoint_fixture.pt` holds a ZenFlowAdamW state taken mid-window by the package as it stood then
(`tests/data/make_checkpoint_fixture.py`), the next two batches, and the weights and losses those two steps gave.
"""

from __future__ import annotations

import torch

from hf_zenflow import ZenFlowAdamW
from tests.conftest import FP32_MOMENTS
from tests.data.make_checkpoint_fixture import FIXTURE, make_model, train_step


def test_checkpoint_from_before_the_relayout_continues_the_run() -> None:
    fixture = torch.load(FIXTURE, weights_only=False)
    model = make_model()
    model.load_state_dict(fixture["model"])
    # the run that wrote the fixture kept its host moments in fp32 (the default then, so not in its settings)
    opt = ZenFlowAdamW(model.parameters(), lr=fixture["lr"], **{**FP32_MOMENTS, **fixture["settings"]})
    opt.load_state_dict(fixture["optimizer"])
    losses = [train_step(model, opt, batch) for batch in fixture["batches"]]
    opt.flush()
    opt.close()
    assert losses == fixture["expected_losses"]
    for name, value in model.state_dict().items():
        # exact, like the losses: the same arithmetic in the same order as the run that wrote the fixture
        assert torch.equal(value, fixture["expected_model"][name]), name
    # the continued steps moved the weights: the comparison above is not between two copies of the saved state
    assert any(not torch.equal(fixture["model"][k], v) for k, v in fixture["expected_model"].items())
