"""`device_memory_limit_bytes` holds the step's peak device memory (`engine/device_budget.py`): matrices under
`min_offload_numel` are split too, largest first, until the estimated peak fits; the choice is reproducible, logged
once, in `stats()` and restored on resume; a limit that cannot be met is said once."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_zenflow import CheckpointError, ZenFlowAdamW
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.engine import accumulation
from hf_zenflow.engine.device_budget import estimate_peak
from hf_zenflow.engine.planner import candidate_thresholds, choose_min_offload_numel
from hf_zenflow.settings.config import MIN_OFFLOAD_NUMEL
from tests.conftest import DEVICE, batches, plan_with_host_ram, roundtrip, zenflow_adamw, zenflow_config


VOCAB = 256
SETTINGS = dict(topk_ratio=0.1, update_interval=2, select_strategy="step", select_interval=3, high_lr_rule="off",
                free_gradients_in_backward="on")


class SmallMatrices(torch.nn.Module):
    """Every matrix far under the default `min_offload_numel`: 16384 elements (the embedding, three 128 x 128 layers,
    the head) and 8192 (two layers), as LoRA adapters or a small model's layers are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 64)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 128), *[torch.nn.Linear(128, 128) for _ in range(3)],
                                           torch.nn.Linear(128, 64)])
        self.head = torch.nn.Linear(64, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _model(dtype: torch.dtype = torch.float32) -> SmallMatrices:
    torch.manual_seed(0)
    return SmallMatrices().to(DEVICE, dtype)


def _groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def _optimizer(model: torch.nn.Module, **settings: object) -> ZenFlowAdamW:
    return zenflow_adamw(_groups(model), lr=1e-3, **{**SETTINGS, **settings})


def _train(model: torch.nn.Module, opt: ZenFlowAdamW, data: list) -> None:
    for x, y in data:
        logits = model(x.to(DEVICE))
        torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.to(DEVICE).view(-1)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _run(steps: int = 8, dtype: torch.dtype = torch.float32, **settings: object
         ) -> tuple[list[torch.Tensor], dict, ZenFlowAdamW]:
    model = _model(dtype)
    opt = _optimizer(model, **settings)
    _train(model, opt, batches(steps, vocab=VOCAB))
    stats = opt.stats()
    opt.close()
    return [p.detach().clone() for p in model.parameters()], stats, opt


def _weights_and_gradients(model: torch.nn.Module) -> int:
    """What synchronous offload holds at its peak: every weight and every gradient (fp32: 8 B per parameter)."""
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("threshold", [MIN_OFFLOAD_NUMEL, 16384, 8192, 0])
@pytest.mark.parametrize("free", ["on", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_bounds_what_the_meter_counts(threshold, free, dtype):
    """The estimate is an upper bound of the measured peak (`DeviceMemoryMeter`), and a close one: its parts are
    the meter's own (weights, state, gradients held, the one gradient in flight), bf16 weights' fp32 masters too."""
    model = _model(dtype)
    _, stats, opt = _run(dtype=dtype, min_offload_numel=threshold, free_gradients_in_backward=free,
                         accumulate_on="host")
    estimate = estimate_peak(_groups(model), opt.config, threshold, frees=free == "on").total
    assert stats["peak_device_bytes"] <= estimate <= 1.1 * stats["peak_device_bytes"]


def test_a_limit_at_sync_offloads_peak_holds_zenflow_to_it(caplog):
    """Limit = synchronous offload's peak (weights and gradients): every matrix is under `min_offload_numel`, so
    without the limit the run is AdamW on the device, 16 B per parameter, twice the limit; with it the largest
    matrices are split until the estimate fits, and the measured peak is within the limit. Said once."""
    limit = _weights_and_gradients(_model())
    _, free_stats, _ = _run(accumulate_on="host")
    assert free_stats["peak_device_bytes"] > limit and free_stats["min_offload_numel"] == MIN_OFFLOAD_NUMEL
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        _, stats, opt = _run(device_memory_limit_bytes=limit)
    assert stats["peak_device_bytes"] <= limit
    assert stats["min_offload_numel"] == 16384  # (the largest threshold that fits: the 8192-element layers stay whole)
    assert stats["accumulate_on"] == "host"  # ("auto": fp32 or bf16 device sums do not fit on top)
    assert sorted(p.numel() for p in opt.engine_state.dense if p.ndim >= 2) == [8192, 8192]
    said = [r.getMessage() for r in caplog.records if "device_memory_limit_bytes=" in r.getMessage()]
    assert len(said) == 1 and f"lowered from {MIN_OFFLOAD_NUMEL} to 16384" in said[0], said


def test_auto_window_sums_fit_under_the_limit_too(caplog, monkeypatch):
    """`accumulate_on="auto"` under a limit: device sums (fp32 or bf16) only where they fit beside what the step
    holds anyway (the whole matrices' state and gradients, counted from sizes, not the smaller peak of the first
    backward's first hooks): at every limit the measured peak is within it, and nothing is said to be over it. (The
    host's RAM is made short for every option, so that the device sums that fit the device are taken.)"""
    plan_with_host_ram(monkeypatch, 0)
    # (fp32 host sums of every column with a write-back buffer: the largest host state, so that the host's overflow
    # does not rank host sums first)
    fp32_sums = dict(host_sum_dtype="float32", host_sum_columns="all", host_writeback="buffer")
    chosen = set()
    with caplog.at_level(logging.WARNING, logger="hf_zenflow"):
        for limit in range(800_000, 1_900_001, 50_000):
            _, stats, _ = _run(steps=4, min_offload_numel=16384, device_memory_limit_bytes=limit, **fp32_sums)
            assert stats["peak_device_bytes"] <= limit, (limit, stats["accumulate_on"])
            chosen.add(stats["accumulate_on"])
    assert chosen == {"host", "device_bf16", "device"}
    assert not [r for r in caplog.records if "device_memory_limit_bytes" in r.getMessage()]


def test_a_cuda_limit_counts_the_estimated_peak_when_it_is_above_the_measured_one(monkeypatch):
    """On CUDA the spare memory under a limit is the limit less the larger of the measured and the estimated peak."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 36 * gib)
    cuda = torch.device("cuda", 0)
    assert accumulation.available_bytes(cuda, 40 * gib, 38 * gib) == (2 * gib, 40 * gib)
    assert accumulation.available_bytes(cuda, 40 * gib, 30 * gib) == (4 * gib, 40 * gib)


def test_the_choice_is_the_largest_threshold_that_fits():
    """Between the candidates' estimates: a limit just under one threshold's estimate takes the next one down; a
    limit at it keeps it."""
    model = _model()
    config = zenflow_config(**SETTINGS)
    groups = _groups(model)
    assert candidate_thresholds(groups, config) == [MIN_OFFLOAD_NUMEL, 16384, 8192]
    at_16384 = estimate_peak(groups, config, 16384, frees=True).total
    chosen = [choose_min_offload_numel(groups, zenflow_config(**SETTINGS, device_memory_limit_bytes=limit), True)
              for limit in (at_16384, at_16384 - 1)]
    assert [(c.min_offload_numel, c.fits) for c in chosen] == [(16384, True), (8192, True)]


def test_the_same_script_chooses_the_same_and_a_resumed_run_continues_exactly():
    """A rerun chooses the same threshold and ends with the same weights; a run saved at step 4 and resumed continues
    bit for bit, keeping the checkpoint's choice even where a fresh choice would differ (here the resumed optimizer
    keeps its gradients until the step, under which nothing fits: it would take another threshold)."""
    limit = _weights_and_gradients(_model())
    data = batches(8, vocab=VOCAB)
    whole, stats, _ = _run(device_memory_limit_bytes=limit)
    again, stats_again, _ = _run(device_memory_limit_bytes=limit)
    assert all(torch.equal(a, b) for a, b in zip(whole, again))
    assert stats["min_offload_numel"] == stats_again["min_offload_numel"] == 16384

    model = _model()
    opt = _optimizer(model, device_memory_limit_bytes=limit)
    _train(model, opt, data[:4])
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    opt.close()
    assert saved["opt"]["zenflow"]["limit_min_offload_numel"] == 16384
    fresh_choice = choose_min_offload_numel(_groups(model), zenflow_config(
        **{**SETTINGS, "free_gradients_in_backward": "off"}, device_memory_limit_bytes=limit), frees=False)
    assert fresh_choice.min_offload_numel != 16384

    for free in ("on", "off"):
        resumed = _model()
        resumed.load_state_dict(saved["model"])
        opt = _optimizer(resumed, device_memory_limit_bytes=limit, free_gradients_in_backward=free)
        opt.load_state_dict(roundtrip(saved["opt"]))  # (a copy each: the loaded tensors become the live state)
        _train(resumed, opt, data[4:])
        stats = opt.stats()
        opt.close()
        assert stats["min_offload_numel"] == 16384
        if free == "on":  # (the same settings: the uninterrupted run's weights, bit for bit)
            assert all(torch.equal(a, p) for a, p in zip(whole, resumed.parameters()))


def test_a_resume_without_the_limit_moves_the_matrices_back():
    """A new limit (here none) chooses afresh on resume: the matrices the limit split are whole again, and the
    run goes on."""
    limit = _weights_and_gradients(_model())
    model = _model()
    opt = _optimizer(model, device_memory_limit_bytes=limit)
    data = batches(6, vocab=VOCAB)
    _train(model, opt, data[:4])
    saved = roundtrip(opt.state_dict())
    opt.close()
    opt = _optimizer(model, accumulate_on="host")
    opt.load_state_dict(saved)
    assert not opt.engine_state.splits and opt.stats()["min_offload_numel"] == MIN_OFFLOAD_NUMEL
    _train(model, opt, data[4:])
    opt.close()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_limit_that_cannot_be_met_is_said_once(caplog):
    """A limit under the weights alone: the run takes the smallest peak possible and says so once, naming the limit
    and that peak, and trains on."""
    model = _model()
    limit = sum(p.numel() * p.element_size() for p in model.parameters())
    smallest = min(estimate_peak(_groups(model), zenflow_config(**SETTINGS), t, frees=True).total
                   for t in candidate_thresholds(_groups(model), zenflow_config(**SETTINGS)))
    with caplog.at_level(logging.INFO, logger="hf_zenflow"):
        weights, stats, _ = _run(device_memory_limit_bytes=limit)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "device_memory_limit_bytes" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"device_memory_limit_bytes={limit} cannot be met" in warned[0]
    assert f"smallest peak possible is an estimated {smallest} bytes" in warned[0]
    assert stats["peak_device_bytes"] <= smallest and stats["min_offload_numel"] == 8192
    assert all(torch.isfinite(w).all() for w in weights)


def test_without_a_limit_nothing_changes():
    """No limit: no choice is made or saved, the setting splits; a limit the setting already fits changes nothing
    either (the same weights, bit for bit)."""
    plain, stats, opt = _run(accumulate_on="host", min_offload_numel=16384)
    assert opt.engine_state.schedule.limit_min_offload_numel is None and stats["min_offload_numel"] == 16384
    assert sorted(p.numel() for p in opt.engine_state.dense if p.ndim >= 2) == [8192, 8192]
    roomy, roomy_stats, _ = _run(accumulate_on="host", min_offload_numel=16384, device_memory_limit_bytes=1 << 40)
    assert roomy_stats["min_offload_numel"] == 16384
    assert all(torch.equal(a, b) for a, b in zip(plain, roomy))


def _saved_state() -> dict:
    model = _model()
    opt = _optimizer(model, device_memory_limit_bytes=_weights_and_gradients(model))
    _train(model, opt, batches(2, vocab=VOCAB))
    saved = roundtrip(opt.state_dict())
    opt.close()
    return saved


@pytest.mark.parametrize("value", [-1, 1.5, "16384", True, MIN_OFFLOAD_NUMEL + 1])
def test_a_damaged_choice_is_refused(value):
    saved = _saved_state()
    saved["zenflow"]["limit_min_offload_numel"] = value
    seal(saved)  # (checksums that agree: the schema itself refuses it)
    model = _model()
    opt = _optimizer(model, device_memory_limit_bytes=_weights_and_gradients(model))
    with pytest.raises(CheckpointError, match=f"limit_min_offload_numel={value!r} is invalid, expected None"):
        opt.load_state_dict(saved)
    opt.close()


@pytest.mark.parametrize("value", [-1, 1.5, "1e9", True])
def test_an_invalid_limit_is_refused(value):
    with pytest.raises(ValueError, match=rf"device_memory_limit_bytes={value!r} is invalid: allowed is None or an"):
        zenflow_config(device_memory_limit_bytes=value)
