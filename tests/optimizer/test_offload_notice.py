"""A run that offloads nothing, or almost nothing, says so once at construction, with the reason and the setting
that changes it (the examples once logged selected fraction 1 and 0 bytes to host at every step without a word)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_zenflow import ZenFlowAdamW


def _build(*shapes: tuple[int, ...], caplog: pytest.LogCaptureFixture, **settings) -> str:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        ZenFlowAdamW(params, lr=1e-3, cpu_threads=1, **settings).close()
    return caplog.text


def test_small_matrices_are_named_with_the_setting_that_offloads_them(caplog):
    text = _build((64, 64), (32, 64), (64,), caplog=caplog)
    assert "offloads nothing" in text and "min_offload_numel=262144" in text
    assert "the largest has 4096" in text and "min_offload_numel=4096" in text


def test_topk_ratio_one_is_named(caplog):
    text = _build((1024, 512), caplog=caplog, topk_ratio=1.0)
    assert "offloads nothing" in text and "topk_ratio=1.0" in text


def test_almost_nothing_is_said_with_the_share(caplog):
    # one 512 x 512 matrix offloaded, twelve 500 x 500 ones (under 2**18 elements) kept on the device: 8 %
    text = _build((512, 512), *[(500, 500)] * 12, caplog=caplog)
    assert "offloads only 8.0 % of the trainable parameters" in text and "min_offload_numel" in text


def test_a_run_that_offloads_says_nothing(caplog):
    assert "offloads" not in _build((1024, 512), (512,), caplog=caplog)


def test_it_is_said_once_per_optimizer(caplog):
    assert _build((64, 64), caplog=caplog).count("offloads nothing") == 1
