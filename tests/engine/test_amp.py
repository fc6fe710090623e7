"""fp16 training with `torch.amp.GradScaler`: `ZenFlowAdamW` clips, updates and accumulates the unscaled gradients,
and a step whose gradients overflowed changes nothing.

The reference is the same loop without a scaler. With a power-of-two scale the scaled gradients are the unscaled
ones times 2**k exactly (backward only multiplies them through), and so are their norms; multiplying by 2**-k
undoes it exactly. So the scaled run must give the same bits as the unscaled one, and these tests use torch.equal.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.transport import CopyTransport
from tests.conftest import DEVICE, batches, make_model, param_groups, zenflow_adamw


LR = 1e-2
SCALE = 4096.0  # a power of two: scaling and unscaling are exact
SETTINGS = dict(min_offload_numel=0, update_interval=3, writeback_lag=None, select_strategy="step",
                select_interval=5, full_warm_up_rounds=2)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x.to(DEVICE)).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1))


def _run(steps: int, clip: float | None, scaler_recipe: str | None, overflow_at: frozenset[int] = frozenset(),
         on_overflow=None, **settings):
    """Train `steps` batches. `scaler_recipe`: None (no scaler), "unscale" (scale, unscale_, clip, step, update:
    the Trainer's order) or "step" (scale, step, update: the scaler unscales inside `step`). `overflow_at`: batch
    indices whose scaled loss is made infinite (the scaler must skip them; the reference simply leaves them out).
    `on_overflow(opt, model, before)` is called after each overflowed step with the state before it."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, **{**SETTINGS, **settings})
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALE) if scaler_recipe else None
    norms: list[float] = []
    for i, (x, y) in enumerate(batches(steps)):
        loss = _loss(model, x, y)
        overflow = i in overflow_at
        if scaler is None:
            if overflow:
                continue
            loss.backward()
            if clip is not None:
                norms.append(opt.clip_grad_norm_(clip).item())
            opt.step()
        else:
            before = _snapshot(opt, model) if overflow else None
            scaled = scaler.scale(loss)
            (scaled * math.inf if overflow else scaled).backward()
            if scaler_recipe == "unscale":
                scaler.unscale_(opt)
            if clip is not None:
                norm = opt.clip_grad_norm_(clip).item()
                if not overflow:
                    norms.append(norm)
            scale_then = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if overflow:
                assert scaler.get_scale() == scale_then / 2  # the scaler saw the overflow and backs off
                if on_overflow is not None:
                    on_overflow(opt, model, before)
        opt.zero_grad()
    opt.flush()
    opt.close()
    return model, norms, opt


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: value.detach().clone() if isinstance(value, torch.Tensor) else value}


def _snapshot(opt: ZenFlowAdamW, model: torch.nn.Module) -> tuple[dict, list[torch.Tensor]]:
    return _flatten(opt.state_dict()), [p.detach().clone() for p in model.parameters()]


def _assert_unchanged(opt: ZenFlowAdamW, model: torch.nn.Module, before: tuple[dict, list[torch.Tensor]]) -> None:
    state, weights = _snapshot(opt, model)
    assert state.keys() == before[0].keys()
    if "/zenflow/skipped_steps" in state:  # the one number that must change: a count of the skipped steps
        assert state.pop("/zenflow/skipped_steps") == before[0]["/zenflow/skipped_steps"] + 1
        # ... and so must its seal (checkpoint format 3 checksums every field): the one other entry that changes
        state.pop("/zenflow/checksum/zenflow.skipped_steps", None)
    for key, value in state.items():
        old = before[0][key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, old), key
        else:
            assert value == old or (value != value and old != old), key  # (NaN == NaN for this purpose)
    for p, q in zip(weights, before[1]):
        assert torch.equal(p, q)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max difference {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("copying", [False, True])
@pytest.mark.parametrize("overlap_step", [True, False])
@pytest.mark.parametrize("topk_ratio", [0.1, 1.0])
def test_unscale_then_clip_equals_the_loop_without_scaler(overlap_step, topk_ratio, copying, monkeypatch):
    """The Trainer's order: scaler.unscale_(opt), opt.clip_grad_norm_, scaler.step(opt). Before the fix the
    hooks' norms (taken on the scaled gradients; unscale_ does not bump their version) made the clip norm ~4096x
    too large. `copying`: a transport that copies gradients to the host, as on CUDA, so the hooks start each copy
    in backward, before unscale_: the host must not accumulate those scaled copies."""
    if copying:
        monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    ref, ref_norms, _ = _run(12, 1.0, None, overlap_step=overlap_step, topk_ratio=topk_ratio)
    model, norms, _ = _run(12, 1.0, "unscale", overlap_step=overlap_step, topk_ratio=topk_ratio)
    assert norms == pytest.approx(ref_norms, rel=1e-4)
    assert norms == ref_norms  # exact: the scale is a power of two
    _assert_same_weights(model, ref)


@pytest.mark.parametrize("update_interval", [3, "auto"])
def test_step_without_unscale_equals_the_loop_without_scaler(update_interval):
    """scaler.step(opt) alone: the optimizer receives the scale and unscales inside its step (Zen-auto's masses
    too: "auto" decides on them)."""
    ref, _, _ = _run(12, None, None, update_interval=update_interval)
    model, _, _ = _run(12, None, "step", update_interval=update_interval)
    _assert_same_weights(model, ref)


@pytest.mark.parametrize("recipe", ["unscale", "step"])
@pytest.mark.parametrize("overlap_step", [True, False])
@pytest.mark.parametrize("topk_ratio", [0.1, 1.0])
def test_overflow_step_changes_nothing_and_training_continues_exactly(recipe, overlap_step, topk_ratio):
    """Overflows injected (with a fixed window) in the first step (no state yet), a warm-up step, a re-selection,
    a window-closing step and mid-window: each leaves the optimizer's whole state and the weights bit-identical, and
    the run equals one that never saw those batches."""
    overflow_at = frozenset({0, 2, 4, 7, 12})
    checked: list[int] = []

    def on_overflow(opt, model, before):
        _assert_unchanged(opt, model, before)
        checked.append(1)

    # "step" without unscale_ does not clip (clipping scaled gradients is the caller's error, as with torch's
    # optimizers); it runs Zen-auto instead, whose statistics an overflow must not touch either
    settings = dict(overlap_step=overlap_step, topk_ratio=topk_ratio)
    clip = 1.0 if recipe == "unscale" else None
    if recipe == "step":
        settings["update_interval"] = "auto"
    ref, ref_norms, _ = _run(16, clip, None, overflow_at=overflow_at, **settings)
    model, norms, _ = _run(16, clip, recipe, overflow_at=overflow_at, on_overflow=on_overflow, **settings)
    assert len(checked) == len(overflow_at)
    assert norms == ref_norms
    _assert_same_weights(model, ref)


def test_clip_measures_unscaled_gradients_after_unscale():
    """The norm `clip_grad_norm_` returns after `scaler.unscale_` is torch's norm of the unscaled gradients, with the
    gradients kept in ``p.grad`` and freed in backward (those stay on the host: torch's norm is taken of the kept
    run's)."""
    measured = {}
    for free in ("off", "on"):
        model = make_model()
        opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS, free_gradients_in_backward=free)
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALE)
        x, y = batches(1)[0]
        scaler.scale(_loss(model, x, y)).backward()
        scaler.unscale_(opt)
        if free == "off":
            expected = torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]])
        measured[free] = opt.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.close()
    assert torch.equal(measured["off"], expected) and torch.equal(measured["on"], expected)


@pytest.mark.parametrize("recipe", ["unscale", "step"])
def test_window_sums_on_the_device_under_a_scaler(recipe):
    """``accumulate_on="device"``: the window sums on the device take the same 1 / scale, and an overflow adds
    nothing to them."""
    clip = 1.0 if recipe == "unscale" else None
    overflow_at = frozenset({0, 4, 7})
    checked: list[int] = []

    def on_overflow(opt, model, before):
        _assert_unchanged(opt, model, before)
        checked.append(1)

    ref, ref_norms, _ = _run(12, clip, None, overflow_at=overflow_at, accumulate_on="device")
    model, norms, _ = _run(12, clip, recipe, overflow_at=overflow_at, on_overflow=on_overflow, accumulate_on="device")
    assert len(checked) == len(overflow_at)
    assert norms == ref_norms
    _assert_same_weights(model, ref)


def test_unscale_does_not_copy_the_gradients_to_the_host_twice(monkeypatch):
    """The Trainer's order on a transport that copies (as on CUDA): the copies the hooks start in backward are kept
    after unscale_ (the host adds them times 1 / scale) instead of being made again, so as many bytes cross the link
    as without a scaler, and the weights are the same bits."""
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    # (kept gradients: freed in the first step, before the scaler is known, they would come back and be copied
    # again once)
    ref, _, ref_opt = _run(8, 1.0, None, topk_ratio=0.1, free_gradients_in_backward="off")
    model, _, opt = _run(8, 1.0, "unscale", topk_ratio=0.1, free_gradients_in_backward="off")
    assert opt.stats()["total_bytes_to_host"] == ref_opt.stats()["total_bytes_to_host"]
    _assert_same_weights(model, ref)
