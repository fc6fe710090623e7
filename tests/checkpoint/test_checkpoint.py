"""The checkpoint format (`hf_zenflow.checkpoint`): settings changed on resume take effect, checkpoints move between
ZenFlowAdamW and torch's AdamW exactly, damaged or foreign state is refused naming the tensor, other format versions
are refused."""

from __future__ import annotations

import copy
import logging
import zipfile
from pathlib import Path

import pytest
import torch

from hf_zenflow import CheckpointError, ZenFlowAdamW, to_torch_adamw
from hf_zenflow.checkpoint.format import FORMAT_VERSION, load_file
from hf_zenflow.checkpoint.seal import seal
from hf_zenflow.engine.split_matrix import SplitMatrix
from tests.conftest import (
    FP32_MOMENTS,
    batches,
    linear_schedule,
    make_model,
    max_rel_diff,
    param_groups,
    roundtrip,
    train,
    zenflow_adamw,
)


LR = 1e-2
TOTAL, SPLIT_AT = 14, 6
#: ZenFlow settings under which it is exactly AdamW (the split is invisible at U=1 without overlap; fp32 moments)
ADAMW_EXACT = dict(update_interval=1, overlap_step=False, select_strategy="step", select_interval=5,
                   min_offload_numel=0, **FP32_MOMENTS)


def adamw_reference(total: int = TOTAL) -> tuple[torch.nn.Module, list[float]]:
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    losses = train(model, opt, batches(total), linear_schedule(opt, total), clip=1.0)
    return model, losses


def run_until(opt_factory, steps: int, total: int = TOTAL):
    model = make_model()
    opt = opt_factory(model)
    sched = linear_schedule(opt, total)
    losses = train(model, opt, batches(total)[:steps], sched, clip=1.0)
    return model, opt, sched, losses


def resume(checkpoint: dict, opt_factory, total: int = TOTAL, split_at: int = SPLIT_AT):
    model = make_model(seed=123)
    model.load_state_dict(checkpoint["model"])
    opt = opt_factory(model)
    sched = linear_schedule(opt, total)
    opt.load_state_dict(checkpoint["opt"])
    sched.load_state_dict(checkpoint["sched"])
    losses = train(model, opt, batches(total)[split_at:], sched, clip=1.0)
    return model, opt, losses


def save(model, opt, sched) -> dict:
    return roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})


def zenflow(**settings):
    return lambda model: zenflow_adamw(param_groups(model), lr=LR, **{**ADAMW_EXACT, **settings})


def test_the_host_side_state_is_what_the_checkpoint_keeps_and_a_load_restores_it():
    """`HostWindows.state()` holds the plain values the checkpoint writes of the host side (a host result awaiting its
    write-back, the guard's norms, the seed, the accumulation), and a new optimizer's host side gives the same values
    back after `load_state_dict`."""
    settings = dict(update_interval=4, overlap_step=True, writeback_lag=2, high_lr_rule="off", accumulate_on="host")
    _, opt, _, _ = run_until(zenflow(**settings), steps=SPLIT_AT - 1)
    host = opt.host_windows.state()
    saved = roundtrip(opt.state_dict())
    opt.close()
    assert host["writeback_pending"] and host["unapplied_steps"] == [4]  # (the window closed at step 4 awaits lag 2)
    assert host["host_step_guard"]["recent_norms"], "the guard has seen norms"
    assert {key: saved["zenflow"][key] for key in host} == host
    fresh = zenflow(**settings)(make_model())
    before = fresh.host_windows.state()
    assert not before["writeback_pending"] and not before["host_step_guard"]["recent_norms"]
    fresh.load_state_dict(saved)
    assert fresh.host_windows.state() == host
    fresh.close()


def test_the_run_counters_are_what_the_checkpoint_keeps_and_a_load_restores_them():
    """`EngineState.state()` holds the run's counters the checkpoint writes (the steps skipped for non-finite
    gradients, the max_norm of the last `clip_grad_norm_`), and a new optimizer gives the same values back after
    `load_state_dict`."""
    settings = dict(free_gradients_in_backward="off")  # (the hook below spoils a gradient held after backward)
    model = make_model()
    opt = zenflow(**settings)(model)

    def spoil(step: int) -> None:
        if step == 2:
            next(model.parameters()).grad.fill_(float("nan"))

    train(model, opt, batches(5), clip=0.5, hook=spoil)
    counters = opt.engine_state.state()
    saved = roundtrip(opt.state_dict())
    opt.close()
    assert counters == {"skipped_steps": 1, "max_grad_norm": 0.5}
    assert {key: saved["zenflow"][key] for key in counters} == counters
    fresh = zenflow(**settings)(make_model())
    assert fresh.engine_state.state() == {"skipped_steps": 0, "max_grad_norm": None}
    fresh.load_state_dict(saved)
    assert fresh.engine_state.state() == counters
    fresh.close()


def test_a_split_matrix_state_loads_into_a_fresh_one_as_it_was():
    """`SplitMatrix.state()` holds the matrix as it is held (the selection, the device columns, the host state and the
    open window's sum), and a matrix made for the same settings gives the same values back after `load` of it."""
    settings = dict(update_interval=4, high_lr_rule="off", accumulate_on="host", topk_ratio=0.25)
    _, opt, _, _ = run_until(zenflow(**settings), steps=SPLIT_AT)
    opt.synchronize()
    splits = list(opt.engine_state.splits.items())
    assert any(s.device is not None and s.host is not None and s.host.accum_count for _, s in splits)
    for p, split in splits:
        held = split.state()
        fresh = SplitMatrix(p, held["k"], rows=split.rows)
        if "host_master" in held:
            opt.host_windows.attach_host([fresh])
        fresh.load(held)
        again = fresh.state()
        assert list(again) == list(held)
        for key, value in held.items():
            same = torch.equal(again[key], value) if isinstance(value, torch.Tensor) else again[key] == value
            assert same, key
    opt.close()


# ---------------------------------------------------------------------------------------------------------------------
# Settings changed on resume (issue 10.4)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("new_ratio", [0.5, 1.0, 0.0])
def test_a_new_topk_ratio_takes_effect_on_resume_exactly(new_ratio, caplog):
    """Regression (issue 10.4): the saved split was kept forever (selected_fraction 0.094 after resuming with 0.5)
    while `opt.config.topk_ratio` reported the new value. At U=1 the split is invisible, so the resumed run must still
    be AdamW: re-selecting with the new k loses no master value and no moment."""
    ref, ref_losses = adamw_reference()
    model, opt, sched, first = run_until(zenflow(topk_ratio=0.1), SPLIT_AT)
    checkpoint = save(model, opt, sched)
    opt.close()
    with caplog.at_level(logging.WARNING, logger="hf_zenflow.checkpoint"):
        model_b, opt_b, rest = resume(checkpoint, zenflow(topk_ratio=new_ratio))
    assert f"topk_ratio 0.1 -> {new_ratio!r}" in caplog.text
    stats = opt_b.stats()
    assert stats["selected_fraction"] == pytest.approx(new_ratio, abs=0.02)
    if new_ratio == 1.0:
        assert stats["host_state_bytes"] == 0  # every column on the device: the host keeps nothing
    assert first + rest == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model_b, ref) < 1e-5
    opt_b.close()


def test_a_new_update_interval_takes_effect_on_resume():
    model, opt, sched, _ = run_until(lambda m: zenflow_adamw(param_groups(m), lr=LR, topk_ratio=0.1, update_interval=4,
                                                             min_offload_numel=0, high_lr_rule="off"), SPLIT_AT)
    checkpoint = save(model, opt, sched)
    opt.close()
    _, opt_b, _ = resume(checkpoint, lambda m: zenflow_adamw(param_groups(m), lr=LR, topk_ratio=0.1, update_interval=2,
                                                             min_offload_numel=0, high_lr_rule="off"))
    assert opt_b.stats()["update_interval"] == 2
    opt_b.close()


@pytest.mark.parametrize("before, after", [(0, 10**9), (10**9, 0)])
def test_a_new_min_offload_numel_moves_matrices_between_paths_exactly(before, after):
    """Matrices move between the split and the dense path with their master values and moments."""
    ref, ref_losses = adamw_reference()
    model, opt, sched, first = run_until(zenflow(topk_ratio=0.1, min_offload_numel=before), SPLIT_AT)
    checkpoint = save(model, opt, sched)
    opt.close()
    model_b, opt_b, rest = resume(checkpoint, zenflow(topk_ratio=0.1, min_offload_numel=after))
    assert (len(opt_b.engine_state.splits) > 0) == (after == 0)
    assert first + rest == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model_b, ref) < 1e-5
    opt_b.close()


def test_a_warm_up_that_cannot_take_effect_is_refused():
    model, opt, sched, _ = run_until(zenflow(topk_ratio=0.1), SPLIT_AT)
    checkpoint = save(model, opt, sched)
    opt.close()
    with pytest.raises(CheckpointError, match="full_warm_up_rounds=10"):
        resume(checkpoint, zenflow(topk_ratio=0.1, full_warm_up_rounds=10))


# ---------------------------------------------------------------------------------------------------------------------
# torch.optim.AdamW <-> ZenFlowAdamW (issue 10.5)
# ---------------------------------------------------------------------------------------------------------------------
def test_torch_adamw_checkpoint_continues_in_zenflow_exactly():
    """Regression (issue 10.5): an AdamW checkpoint loaded into ZenFlowAdamW silently dropped the moments and
    restarted the step count."""
    ref, ref_losses = adamw_reference()
    model, opt, sched, first = run_until(lambda m: torch.optim.AdamW(param_groups(m), lr=LR), SPLIT_AT)
    checkpoint = save(model, opt, sched)
    model_b, opt_b, rest = resume(checkpoint, zenflow(topk_ratio=0.1))
    assert opt_b.stats()["selected_fraction"] == pytest.approx(0.1, abs=0.02)
    assert first + rest == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model_b, ref) < 1e-5
    opt_b.close()


@pytest.mark.parametrize("settings", [dict(topk_ratio=0.1), dict(topk_ratio=0.0), dict(topk_ratio=1.0)])
def test_zenflow_checkpoint_continues_in_torch_adamw_exactly(settings):
    ref, ref_losses = adamw_reference()
    model, opt, sched, first = run_until(zenflow(**settings), SPLIT_AT)
    checkpoint = save(model, opt, sched)
    opt.close()
    model_b = make_model(seed=123)
    model_b.load_state_dict(checkpoint["model"])
    groups = param_groups(model_b)
    # (the fp32 weights saved with the model hold the masters the optimizer state leaves to them)
    adamw_state, masters = to_torch_adamw(checkpoint["opt"], weights=[p for g in groups for p in g["params"]])
    with torch.no_grad():  # the state is indexed in param-group order
        for i, p in enumerate(p for g in groups for p in g["params"]):
            if i in masters:
                p.copy_(masters[i])
    opt_b = torch.optim.AdamW(groups, lr=LR)
    sched_b = linear_schedule(opt_b, TOTAL)
    opt_b.load_state_dict(roundtrip(adamw_state))
    sched_b.load_state_dict(checkpoint["sched"])
    rest = train(model_b, opt_b, batches(TOTAL)[SPLIT_AT:], sched_b, clip=1.0)
    assert first + rest == pytest.approx(ref_losses, rel=1e-5)
    assert max_rel_diff(model_b, ref) < 1e-5


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_conversion_applies_what_zenflow_had_pending_like_flush(accumulate_on):
    """Overlapped, mid-window: the converted masters are what `flush()` would put into the weights."""
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=0,
                        accumulate_on=accumulate_on)
    train(model, opt, batches(10), clip=1.0)  # a write-back pending and two steps in the open window
    state = roundtrip(opt.state_dict())
    _, masters = to_torch_adamw(state, weights=[p.detach().clone() for g in opt.param_groups for p in g["params"]])
    opt.flush()
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        expected = opt.master_weight(p)
        # (`master_weight` is a host tensor; on CUDA the weights are not)
        torch.testing.assert_close(masters.get(i, p.detach()).cpu(), expected, rtol=0, atol=1e-7)
    opt.close()


def test_adamw_with_amsgrad_is_refused_with_the_reason():
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, amsgrad=True)
    train(model, opt, batches(2))
    with pytest.raises(CheckpointError, match="amsgrad"):
        zenflow_adamw(param_groups(model), lr=LR).load_state_dict(opt.state_dict())


# ---------------------------------------------------------------------------------------------------------------------
# Damaged state (issue 10.6)
# ---------------------------------------------------------------------------------------------------------------------
def _saved_state(tmp_path: Path) -> tuple[Path, ZenFlowAdamW]:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=0)
    train(model, opt, batches(6))
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    opt.close()
    return path, zenflow_adamw(param_groups(make_model()), lr=LR, topk_ratio=0.1, update_interval=4,
                               min_offload_numel=0)


def _overwrite_inside_largest_tensor(path: Path, nbytes: int = 64) -> None:
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    header = info.header_offset
    start = header + 30 + int.from_bytes(raw[header + 26:header + 28], "little") + int.from_bytes(
        raw[header + 28:header + 30], "little")
    middle = start + info.file_size // 2
    raw[middle:middle + nbytes] = bytes((37 * i + 11) % 256 for i in range(nbytes))
    path.write_bytes(bytes(raw))


def test_bytes_overwritten_in_the_file_are_refused_naming_the_tensor(tmp_path):
    """Regression (issue 10.6): 64 overwritten bytes loaded silently (torch does not check its zip CRCs) and the
    weights went non-finite after the resume."""
    path, fresh = _saved_state(tmp_path)
    _overwrite_inside_largest_tensor(path)
    state = torch.load(path, weights_only=True)
    with pytest.raises(CheckpointError, match=r"parameter \d+ of shape .*: host_\w+ .*(checksum|non-finite)"):
        fresh.load_state_dict(state)
    assert not fresh.engine_state.splits and not fresh.engine_state.dense  # nothing was changed


@pytest.mark.parametrize("damage, message", [
    (lambda e: e["host_exp_avg_sq"].view(-1).__setitem__(3, float("nan")), "host_exp_avg_sq holds 1 non-finite"),
    (lambda e: e["host_exp_avg_sq"].view(-1).__setitem__(3, -1.0), "host_exp_avg_sq holds negative"),
    (lambda e: e.__setitem__("host_master", e["host_master"][:-1]), "host_master has"),
    (lambda e: e.__setitem__("device_index", e["device_index"].flip(0)), "device_index is not a sorted set"),
])
def test_inconsistent_values_are_refused_naming_the_tensor(damage, message):
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, topk_ratio=0.1, update_interval=4, min_offload_numel=0)
    train(model, opt, batches(6))
    state = copy.deepcopy(roundtrip(opt.state_dict()))
    opt.close()
    entry = next(e for e in state["state"].values() if e["kind"] == "split")
    damage(entry)
    seal(state)  # checksums that agree: the values themselves must be checked, not only the checksums
    with pytest.raises(CheckpointError, match=message):
        zenflow_adamw(param_groups(make_model()), lr=LR, min_offload_numel=0).load_state_dict(state)


def _two_steps_state() -> dict:
    model = make_model()
    opt = zenflow_adamw(param_groups(model), lr=LR, min_offload_numel=0)
    train(model, opt, batches(2))
    state = roundtrip(opt.state_dict())
    opt.close()
    return state


def test_state_of_another_model_is_refused():
    state = _two_steps_state()
    other = torch.nn.Sequential(torch.nn.Embedding(24, 40), torch.nn.Linear(40, 80), torch.nn.LayerNorm(80),
                                torch.nn.Linear(80, 30, bias=False))
    with pytest.raises(CheckpointError, match="saved for a parameter of shape"):
        zenflow_adamw(param_groups(other), lr=LR).load_state_dict(state)


def test_an_empty_or_truncated_file_names_the_file(tmp_path):
    empty = tmp_path / "optimizer.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: the optimizer checkpoint is empty"):
        load_file(empty)
    path, _ = _saved_state(tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: the optimizer checkpoint .* is not a complete"):
        load_file(path)


# ---------------------------------------------------------------------------------------------------------------------
# Format versions
# ---------------------------------------------------------------------------------------------------------------------
def test_a_format_1_or_2_checkpoint_is_refused_in_one_line():
    """Formats 1 (no ``format_version``) and 2 were written before the first release: refused, not migrated."""
    for version in (None, 1, 2):
        state = _two_steps_state()
        if version is None:
            del state["zenflow"]["format_version"]
        else:
            state["zenflow"]["format_version"] = version
        opt = zenflow_adamw(param_groups(make_model()), lr=LR)
        with pytest.raises(CheckpointError, match=rf"format_version={version}; this hf_zenflow reads formats 3, 4") \
                as caught:
            opt.load_state_dict(state)
        assert "\n" not in str(caught.value)
        opt.close()


def test_a_newer_format_is_refused_with_a_message():
    state = _two_steps_state()
    state["zenflow"]["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(CheckpointError, match=rf"format_version={FORMAT_VERSION + 1}; this hf_zenflow reads format"):
        zenflow_adamw(param_groups(make_model()), lr=LR).load_state_dict(state)
