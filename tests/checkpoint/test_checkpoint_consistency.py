"""Well-sealed but inconsistent states are refused: the loader checks the invariants between fields (the open
window's sum vs its steps, step counts vs each other), not only each field's range and the checksums; and a
`torch.optim.AdamW` state with a negative second moment is refused like ZenFlow's own."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hf_zenflow import CheckpointError, ZenFlowAdamW
from hf_zenflow.checkpoint.seal import seal
from tests.conftest import batches, make_model, param_groups, roundtrip, train


SETTINGS = dict(topk_ratio=0.25, update_interval=4, min_offload_numel=0)


def _trained(steps: int, seed: int = 0) -> ZenFlowAdamW:
    model = make_model(seed)
    opt = ZenFlowAdamW(param_groups(model), lr=1e-3, **SETTINGS)
    train(model, opt, batches(steps, seed=seed + 1))
    return opt


@pytest.fixture(scope="module")
def saved() -> dict[str, Any]:
    """Saved two steps into a window: device columns, host state and an open window sum."""
    opt = _trained(6)
    state = roundtrip(opt.state_dict())
    opt.close()
    entry = _split(state)
    assert state["zenflow"]["window_steps"] == entry["accum_count"] == 2 and entry["accum"] is not None
    return state


def _split(state: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in state["state"].values() if e["kind"] == "split" and "device_index" in e
                and "host_master" in e)


def _refused(state: dict[str, Any], match: str) -> None:
    target = _trained(3, seed=5)
    before = roundtrip(target.state_dict())
    with pytest.raises(CheckpointError, match=match):
        target.load_state_dict(state)
    after = target.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(after["state"][0].values(), before["state"][0].values())
               if isinstance(a, torch.Tensor))
    target.close()


def _edited(saved: dict[str, Any], edit) -> dict[str, Any]:
    state = copy.deepcopy(saved)
    edit(state)
    seal(state)  # the checksums recomputed: only the invariants can tell
    return state


def test_the_saved_state_loads(saved):
    opt = _trained(3, seed=5)
    opt.load_state_dict(copy.deepcopy(saved))
    opt.close()


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: _split(s).update(accum_count=_split(s)["accum_count"] + 1), r"accum_count=3 .*window_steps=2"),
    (lambda s: s["zenflow"].update(window_steps=0), r"accum_count=2 .*window_steps=0"),
    (lambda s: _split(s).update(host_step=torch.tensor(1e9)), r"host_step=1e\+09 is not a step count"),
    (lambda s: _split(s).update(host_step=_split(s)["device_step"] + s["zenflow"]["windows"] + 1),
     r"host_step=.* exceeds device_step"),
    (lambda s: _split(s).update(device_step=torch.tensor(2.5)), r"device_step=2.5 is not a step count"),
    (lambda s: s["zenflow"].update(windows=s["zenflow"]["steps"] + 1), r"windows=.* is invalid"),
], ids=["accum_count+1", "window_steps=0 with a sum", "host_step=1e9", "host_step ahead", "device_step=2.5",
        "windows>steps"])
def test_a_sealed_but_inconsistent_state_is_refused(saved, edit, match):
    """Repro: in-range fields edited and the checksums recomputed (``accum_count+1``, ``host_step=1e9``,
    ``window_steps=0`` while a window sum exists) loaded without a word, and the run continued on a state no run
    can reach."""
    _refused(_edited(saved, edit), match)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: s["zenflow"].update(steps=2**30), r"steps=1073741824 is invalid, expected an integer >= 0 and <= "
                                                 r"16777216"),
    (lambda s: s["zenflow"].update(skipped_steps=2**30), r"skipped_steps=1073741824 is invalid"),
    (lambda s: s["zenflow"].update(writeback_lag=99), r"writeback_lag=99 is invalid, expected None or an integer "
                                                      r"from 1 to update_interval \(4\)"),
    (lambda s: s["zenflow"].update(high_lr_window=99), r"high_lr_window=99 is invalid, expected None or an integer "
                                                       r"from 1 to update_interval \(4\)"),
    (lambda s: s["zenflow"].update(writeback_lag=True), r"writeback_lag=True is invalid"),
    (lambda s: s["zenflow"].update(accumulate_on="auto"), r"accumulate_on='auto' is invalid"),
    (lambda s: s["zenflow"].update(max_grad_norm=float("nan")), r"max_grad_norm=nan is invalid"),
], ids=["steps=2**30", "skipped_steps=2**30", "writeback_lag=99", "high_lr_window=99", "writeback_lag=True",
        "accumulate_on=auto", "max_grad_norm=nan"])
def test_a_resealed_field_outside_the_ranges_of_the_settings_is_refused(saved, match, edit):
    """Regression: re-sealed block fields outside the documented ranges loaded: a step count of 2**30 (the
    per-parameter counts are fp32, which stop counting at 2**24), `writeback_lag=99` under `update_interval=4`
    (ZenFlowConfig allows 1 to update_interval)."""
    _refused(_edited(saved, edit), match)


def test_a_stripped_state_claiming_format_1_is_refused(saved):
    """Repro: the checksums stripped and ``format_version=1`` set: it loaded, with only a warning that format 1's
    fields are checked by range. Formats 1 and 2 are refused outright (this hf_zenflow reads formats 3, 4)."""
    state = copy.deepcopy(saved)
    state["zenflow"]["format_version"] = 1
    del state["zenflow"]["checksum"]
    for entry in state["state"].values():
        entry.pop("checksums")
    _refused(state, "format_version=1; this hf_zenflow reads formats 3, 4")
    for entry in state["state"].values():
        entry.pop("shape")
    del state["zenflow"]["format_version"]
    _refused(state, "format_version=None; this hf_zenflow reads formats 3, 4")


def test_a_torch_adamw_state_with_a_negative_second_moment_is_refused():
    """Repro: a `torch.optim.AdamW` state dict with a negative ``exp_avg_sq`` was accepted by the AdamW-to-ZenFlow
    path, and the weights were NaN after one step (ZenFlow's own format refuses it)."""
    model = make_model()
    adamw = torch.optim.AdamW(param_groups(model), lr=1e-3)
    train(model, adamw, batches(2))
    state = roundtrip(adamw.state_dict())
    state["state"][0]["exp_avg_sq"][0, 0] = -1.0
    opt = ZenFlowAdamW(param_groups(model), lr=1e-3, **SETTINGS)
    with pytest.raises(CheckpointError, match="exp_avg_sq of parameter 0 holds negative values"):
        opt.load_state_dict(state)
    opt.close()
