"""A run that offloads nothing, or almost nothing, says so once with the reason and the setting that changes it."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import batches, make_model, param_groups, train, zenflow_adamw


def _said(caplog, **settings) -> list[str]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), **{"lr": 1e-3, **settings})
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        train(model, opt, batches(5))
    opt.close()
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and (
        "ZenFlowAdamW offloads" in r.getMessage() or 'high_lr_rule="auto" shortened' in r.getMessage())]


def test_matrices_under_min_offload_numel_are_named_with_the_setting(caplog):
    """Repro: the README's examples logged selected_fraction 1 and bytes_to_host 0 at every step (their matrices
    are under the default `min_offload_numel`) while their comments promised a 10 % device share and host windows,
    and nothing said why. Now one warning names the cause and the value that offloads them."""
    said = _said(caplog)
    assert len(said) == 1, said
    assert "offloads nothing" in said[0]
    assert "3 trainable matrices have fewer elements than min_offload_numel=262144" in said[0]
    assert "min_offload_numel=3200 or lower offloads them" in said[0]  # the largest: `up`, 80 x 40


def test_topk_ratio_one_is_named(caplog):
    said = _said(caplog, min_offload_numel=0, topk_ratio=1.0)
    assert len(said) == 1 and "offloads nothing" in said[0] and "topk_ratio=1 keeps every column" in said[0], said


def test_almost_nothing_is_said_with_its_share(caplog):
    """topk_ratio=0.99 leaves about 1 % of the matrices' columns on the host."""
    said = _said(caplog, min_offload_numel=0, topk_ratio=0.99)
    assert len(said) == 1 and "offloads almost nothing" in said[0], said


def test_windows_shortened_to_one_step_by_the_high_lr_rule_are_said(caplog):
    said = _said(caplog, min_offload_numel=0, lr=1e-2, update_interval=4)
    assert len(said) == 1 and 'high_lr_rule="auto" shortened the host windows from update_interval=4 to 1' in said[0]
    assert 'host_step="zenflow" keeps the configured windows' in said[0]


@pytest.mark.parametrize("settings", [dict(min_offload_numel=0), dict(min_offload_numel=0, lr=1e-2,
                                                                      high_lr_rule="off")])
def test_a_run_that_offloads_says_nothing(caplog, settings):
    assert _said(caplog, **settings) == []
