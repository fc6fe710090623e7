"""The selected columns' gradient gathered on the device in the gradient's own dtype (bf16, fp16) and widened to fp32
only where it is read (`device_state.gathered_dtype`): the same bits as gathering it in fp32, 2 B less per selected
element.

The reference is the same run with every gradient gathered in fp32, as the engine did before it kept the narrow
dtype (``device_state.NARROW_GRAD_DTYPES`` emptied): the device update, the clip coefficient and a GradScaler's
``1 / scale``, Zen-auto's masses, re-selections, micro-batches, gradients freed in backward (the first step's state
made in the hooks) and a resume all see the widened gradient, so weights, optimizer state, losses and Zen-auto's
masses must be equal bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine import device_state, gradients
from hf_zenflow.engine.accumulation import selected_bytes
from tests.conftest import DEVICE, batches, make_model, param_groups, roundtrip, zenflow_adamw


SETTINGS = dict(topk_ratio=0.25, update_interval="auto", select_strategy="step", select_interval=5,
                min_offload_numel=0, accumulate_on="host", high_lr_rule="off")


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}[{i}]").items()}
    return {prefix: value.detach().clone() if isinstance(value, torch.Tensor) else value}


def _run(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, steps: int = 14, micro_batches: int = 1,
         clip: float | None = 0.5, scaler: bool = False, resume_at: int | None = None, **settings) -> dict:
    """Train a `dtype` model; what it ends with: weights, optimizer state, losses, every step's Zen-auto masses, the
    gather buffers' dtypes and the device state's bytes. `resume_at`: the optimizer is saved after that step and a
    new one continues from the saved state."""
    masses: list[list[tuple[float, float]]] = []
    sync = gradients.StepReads.sync

    def recording_sync(self, *args, **kwargs):
        synced = sync(self, *args, **kwargs)
        masses.append(synced.masses)
        return synced

    with monkeypatch.context() as patch:
        patch.setattr(gradients.StepReads, "sync", recording_sync)
        out = _train(dtype, steps, micro_batches, clip, scaler, resume_at, settings)
    return {**out, "masses": masses}


def _train(dtype: torch.dtype, steps: int, micro_batches: int, clip: float | None, scaler: bool,
           resume_at: int | None, settings: dict) -> dict:
    model = make_model(dtype=dtype)

    def optimizer() -> ZenFlowAdamW:
        return zenflow_adamw(param_groups(model), lr=1e-2, **{**SETTINGS, **settings})

    opt = optimizer()
    grad_scaler = torch.amp.GradScaler(DEVICE.type, init_scale=4096.0) if scaler else None
    data = batches(steps * micro_batches)
    losses = []
    for i in range(steps):
        for x, y in data[i * micro_batches:(i + 1) * micro_batches]:
            logits = model(x.to(DEVICE)).float()
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.to(DEVICE).view(-1))
            (loss if grad_scaler is None else grad_scaler.scale(loss)).backward()
            losses.append(loss.item())
        if clip is not None:
            opt.clip_grad_norm_(clip)
        if grad_scaler is None:
            opt.step()
        else:
            grad_scaler.step(opt)  # (the optimizer unscales inside its step: fp16 gradients cannot be unscale_d)
            grad_scaler.update()
        opt.zero_grad()
        if i == resume_at:
            saved = roundtrip(opt.state_dict())
            opt.close()
            opt = optimizer()
            opt.load_state_dict(saved)
    opt.flush()
    out = {
        "weights": [p.detach().clone() for p in model.parameters()],
        "state": _flatten(opt.state_dict()),
        "losses": losses,
        "buffers": {s.device.grad.dtype for s in opt.engine_state.splits.values() if s.device is not None},
        "selected": sum(s.device.grad.numel() for s in opt.engine_state.splits.values() if s.device is not None),
        "device_state_bytes": opt.stats()["device_state_bytes"],
        "windows": opt.stats()["windows"],
    }
    opt.close()
    return out


def _assert_same_run(ours: dict, reference: dict) -> None:
    assert ours["losses"] == reference["losses"]
    assert ours["masses"] == reference["masses"]
    for p, q in zip(ours["weights"], reference["weights"]):
        assert torch.equal(p, q), f"max difference {(p.float() - q.float()).abs().max().item():.3g}"
    assert ours["state"].keys() == reference["state"].keys()
    for key, value in ours["state"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, reference["state"][key]), key
        else:
            assert value == reference["state"][key] or key.endswith("checksum"), key


def _both(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, **kwargs) -> tuple[dict, dict]:
    ours = _run(dtype, monkeypatch, **kwargs)
    with monkeypatch.context() as fp32_gathers:
        fp32_gathers.setattr(device_state, "NARROW_GRAD_DTYPES", ())
        reference = _run(dtype, monkeypatch, **kwargs)
    return ours, reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("case", "kwargs"), [
    ("clipped", {}),
    ("micro-batches, freed in backward", dict(micro_batches=3, free_gradients_in_backward="on")),
    ("freed in backward, unclipped, U=3", dict(free_gradients_in_backward="on", clip=None, update_interval=3)),
    ("resumed", dict(resume_at=6)),
])
def test_narrow_gather_gives_the_bits_of_an_fp32_gather(dtype, case, kwargs, monkeypatch):
    ours, reference = _both(dtype, monkeypatch, **kwargs)
    _assert_same_run(ours, reference)
    assert ours["buffers"] == {dtype} and reference["buffers"] == {torch.float32}
    assert 1 < ours["windows"] < 14  # (windows of several steps closed)
    if kwargs.get("update_interval", SETTINGS["update_interval"]) == "auto":
        assert any(m for m in ours["masses"])  # (Zen-auto weighed the selected columns' masses)
    # the device keeps 2 B less per selected element: the gathered gradient in the model's dtype
    assert reference["device_state_bytes"] - ours["device_state_bytes"] == 2 * ours["selected"] > 0
    assert selected_bytes(dtype) == selected_bytes(torch.float32) - 2


def test_fp16_with_a_grad_scaler_gives_the_bits_of_an_fp32_gather(monkeypatch):
    """fp16 gradients under a GradScaler stay scaled in the gather buffer; the ``1 / scale`` the step folds into
    the clip coefficient is applied to the widened copy, as it was to an fp32 gather."""
    ours, reference = _both(torch.float16, monkeypatch, scaler=True)
    _assert_same_run(ours, reference)
    assert ours["buffers"] == {torch.float16}


def test_fp32_gradients_are_gathered_in_fp32(monkeypatch):
    run = _run(torch.float32, monkeypatch, steps=3, update_interval=3)
    assert run["buffers"] == {torch.float32}
    assert selected_bytes(torch.float32) == 16
