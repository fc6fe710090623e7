"""`scripts/cuda_checks.py`: its device-independent checks run here on the CPU and pass, so that a check that
could never pass on a GPU (or one that passes whatever the optimizer does) is found before a GPU runs it."""

from __future__ import annotations

import json

import pytest
import torch

from hf_zenflow.transport import CopyTransport
from tests.conftest import load_script


cuda_checks = load_script("cuda_checks")


@pytest.mark.parametrize("transport", ["reference", "copying"])
def test_device_independent_checks_pass_on_the_cpu(transport, tmp_path, monkeypatch):
    """Every device-independent check, through the script's `main` on the CPU. "copying": the gradients cross to
    the host through copies started in backward (as on CUDA), which ``unscale_`` must invalidate."""
    if transport == "copying":
        monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    assert cuda_checks.main(["--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cuda_checks.json").read_text())
    for name in cuda_checks.DEVICE_INDEPENDENT:
        assert results[name]["ok"] is True, results[name]
    fp16 = results["fp16_grad_scaler"]
    for accumulate_on in cuda_checks.ACCUMULATIONS:
        part = fp16[f"accumulate_on={accumulate_on}"]
        assert part["recipes_weight_max_abs_diff"] == 0.0
        for overflow in part["overflow_step"].values():
            # the skipped step moves its counter and that counter's checksum, and nothing else
            assert sorted(overflow["state_entries_changed"]) == sorted(cuda_checks.SKIP_COUNTERS)
    assert not set(cuda_checks.CUDA_ONLY) & results.keys()  # (skipped on the CPU)


def test_a_scaler_integration_that_misses_unscale_fails_the_check(monkeypatch):
    """The optimizer not told of ``unscale_`` (its hooks' norms and early copies kept as read on the scaled
    gradients): the check fails."""
    monkeypatch.setattr("hf_zenflow.transport.transport_for", lambda device: CopyTransport())
    monkeypatch.setattr("hf_zenflow.optimizer.zenflow.ZenFlowAdamW._grads_unscaled", lambda self, inv_scale: None)
    result = cuda_checks.fp16_grad_scaler(torch.device("cpu"), steps=6)
    assert result["ok"] is False
    part = result["accumulate_on=host"]
    assert part["clip_norm_max_rel_diff_from_torch"] > 1.0  # the scale (4096) left in the norm
    assert part["recipes_weight_max_abs_diff"] > 0.0  # the scaled early copies accumulated on the host


def test_a_check_of_the_whole_state_would_fail_on_a_correct_skipped_step():
    """`_changed` reports the skipped-step counter: a check comparing the whole state (without allowing for it)
    would fail on every healthy device."""
    before = {"/zenflow/skipped_steps": 0, "/w": torch.ones(2), "/n": float("nan")}
    after = {"/zenflow/skipped_steps": 1, "/w": torch.ones(2), "/n": float("nan")}
    assert cuda_checks._changed(before, after) == ["/zenflow/skipped_steps"]


def test_the_nccl_pair_is_passed_refused_or_failed_by_the_ranks_answers():
    verdict = cuda_checks.nccl_verdict
    assert verdict([(0, "ok", 3.0), (1, "ok", 3.0)]) == {"ok": True, "ran": True, "all_reduce": [3.0, 3.0]}
    assert verdict([(0, "ok", 3.0), (1, "ok", 2.0)])["ok"] is False
    refused = verdict([(0, "error", "DistBackendError: ... Last error:\nDuplicate GPU detected : rank 0 and rank 1 "
                                    "both on CUDA device 1a000"), (1, "error", "DistBackendError: ...")])
    assert refused["ok"] is True and refused["ran"] is False and "does not allow" in refused["why"]
    assert verdict([(0, "ok", 3.0)])["ok"] is False  # a rank that never answered (a hang, a crash)
    assert verdict([(0, "error", "RuntimeError: out of memory"), (1, "ok", 3.0)])["ok"] is False


def test_the_race_check_fails_when_the_worker_reads_copies_before_they_land(monkeypatch):
    """The worker no longer waits for the copies it reads: over the asynchronous double they land late (NaN until
    then), and the check sees it (a differing run, or the double's own report of the race)."""
    monkeypatch.setattr("hf_zenflow.transport.link.CopyEvents.wait", lambda self: None)
    try:
        result = cuda_checks.races(torch.device("cpu"), steps=4)
    except AssertionError:  # (the double's report: `CopyRaceError`)
        return
    assert result["ok"] is False
