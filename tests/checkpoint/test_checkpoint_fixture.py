"""A checkpoint written before the re-layout of the package loads and continues the run as it would have.

`tests/data/checkpoint_fixture.pt` holds a ZenFlowAdamW state taken mid-window by the package as it stood then
(`tests/data/make_checkpoint_fixture.py`), the next two batches, and the weights and losses those two steps gave.
Its settings name some that this version no longer has (`REMOVED_SETTINGS`, at their defaults there): as saved it
is refused naming them; without them it continues the run.
"""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import CheckpointError
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.settings.config import REMOVED_SETTINGS
from tests.conftest import FP32_MOMENTS, zenflow_adamw
from tests.data.make_checkpoint_fixture import FIXTURE, make_model, train_step


def test_checkpoint_from_before_the_relayout_continues_the_run() -> None:
    fixture = torch.load(FIXTURE, weights_only=False)
    model = make_model()
    model.load_state_dict(fixture["model"])
    # the run that wrote the fixture kept its host moments in fp32 (the default then, so not in its settings)
    opt = zenflow_adamw(model.parameters(), lr=fixture["lr"], **{**FP32_MOMENTS, **fixture["settings"]})
    saved = fixture["optimizer"]
    held = sorted(set(saved["zenflow"]["config"]) & set(REMOVED_SETTINGS))
    assert held
    with pytest.raises(CheckpointError, match=f"its settings? {', '.join(held)} no longer exists? in this version"):
        opt.load_state_dict(saved)
    for name in held:
        del saved["zenflow"]["config"][name]
    opt.load_state_dict(seal(saved))
    losses = [train_step(model, opt, batch) for batch in fixture["batches"]]
    opt.flush()
    opt.close()
    # Within a few units in the last place, not bit for bit: the fixture was written on another CPU, and the matrix
    # products of forward and backward (oneDNN / MKL pick their kernels by the CPU's vector width) round a gradient
    # element differently between AVX2 and AVX-512 machines. A state restored wrongly (moments, step count, the
    # window's position or its pending host result) moves the weights by the order of the learning rate, 1e-2 here.
    torch.testing.assert_close(losses, fixture["expected_losses"], rtol=1e-6, atol=0.0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, fixture["expected_model"][name], rtol=1e-6, atol=1e-7, msg=name)
    # the continued steps moved the weights far beyond that tolerance: the comparison above is not between two
    # copies of the saved state
    moved = max((fixture["model"][k] - v).abs().max().item() for k, v in fixture["expected_model"].items())
    assert moved > 1e-3
