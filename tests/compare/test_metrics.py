"""The held-out metric of compare/tune through `evaluate`: the scripts shipped with hf_zenflow load offline and
compute what a hand-written reference computes; other names must be cached; local scripts load by path."""

from __future__ import annotations

import math
import random

import pytest

from hf_zenflow.compare.metrics import (
    MetricUnavailableError,
    is_cost,
    metric_key,
    resolve_metric,
)


def _f1_reference(pred: list[int], ref: list[int], label: int) -> float:
    tp = sum(p == label and r == label for p, r in zip(pred, ref))
    fp = sum(p == label and r != label for p, r in zip(pred, ref))
    fn = sum(p != label and r == label for p, r in zip(pred, ref))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def test_shipped_accuracy_and_f1_match_a_reference_offline() -> None:
    rng = random.Random(0)
    accuracy = resolve_metric("accuracy", "sequence-classification", 2)
    f1 = resolve_metric("f1", "sequence-classification", 2)
    f1_macro = resolve_metric("f1", "sequence-classification", 3)
    assert accuracy.source.startswith("shipped script") and accuracy.key == "eval_accuracy"
    assert f1_macro.compute_kwargs == {"average": "macro"}
    for _ in range(20):
        n = rng.randint(1, 40)
        ref, pred = [rng.randint(0, 1) for _ in range(n)], [rng.randint(0, 1) for _ in range(n)]
        assert accuracy.compute(pred, ref, 0.0) == pytest.approx(sum(p == r for p, r in zip(pred, ref)) / n)
        assert f1.compute(pred, ref, 0.0) == pytest.approx(_f1_reference(pred, ref, 1))
        ref3, pred3 = [rng.randint(0, 2) for _ in range(n)], [rng.randint(0, 2) for _ in range(n)]
        present = sorted(set(ref3) | set(pred3))
        macro = sum(_f1_reference(pred3, ref3, c) for c in present) / len(present)
        assert f1_macro.compute(pred3, ref3, 0.0) == pytest.approx(macro)


def test_causal_lm_defaults_to_perplexity_of_the_loss() -> None:
    metric = resolve_metric(None, "causal-lm")
    assert metric.name == "perplexity" and is_cost("perplexity") and not metric.needs_predictions
    assert metric.compute([], [], 2.0) == pytest.approx(math.exp(2.0))
    assert metric.key == "eval_perplexity"
    with pytest.raises(MetricUnavailableError, match="perplexity needs a causal-LM task"):
        resolve_metric("perplexity", "sequence-classification")


def test_a_name_not_cached_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # evaluate also looks for ./<name>/<name>.py
    with pytest.raises(MetricUnavailableError, match=r"--metric 'bleu_hf_zenflow_test' is not cached locally") as e:
        resolve_metric("bleu_hf_zenflow_test", "sequence-classification")
    assert "\n" not in str(e.value) and "accuracy, f1" in str(e.value)


def test_a_local_metric_script_loads_by_path(tmp_path) -> None:
    folder = tmp_path / "errors"
    folder.mkdir()
    (folder / "errors.py").write_text('''
import datasets
import evaluate


class Errors(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="wrong predictions", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("int64"),
                                                               "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        return {"errors": sum(p != r for p, r in zip(predictions, references))}
''')
    for spec in (str(folder), str(folder / "errors.py")):
        metric = resolve_metric(spec, "sequence-classification", 2)
        assert metric.name == "errors" and metric.key == "eval_errors" and metric.source == spec
        assert metric.compute([0, 1, 1, 0], [0, 0, 1, 1], 0.0) == 2


def test_metric_key_follows_the_trainer_convention() -> None:
    assert [metric_key(n) for n in ("accuracy", "next-token accuracy", "F1")] == [
        "eval_accuracy", "eval_next_token_accuracy", "eval_f1"]


def test_shipped_scripts_are_package_data() -> None:
    """A wheel must carry the metric scripts: pyproject's package-data globs cover every file of hf_zenflow/metrics."""
    import fnmatch
    from pathlib import Path

    import tomllib

    from hf_zenflow.compare.metrics import METRICS_DIR, SHIPPED

    root = METRICS_DIR.parent
    globs = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "hf_zenflow"]
    files = [p.relative_to(root).as_posix() for p in METRICS_DIR.rglob("*.py")]
    assert sorted(Path(f).parent.name for f in files) == sorted(SHIPPED)
    for f in files:
        assert any(fnmatch.fnmatch(f, g) for g in globs), f


def test_report_compares_a_cost_metric_as_a_ratio_and_a_score_as_a_difference() -> None:
    from hf_zenflow.compare import report

    def result(**metric: float) -> dict:
        return {"eval_loss": 2.0, "train_loss": 2.0, "step_ms": 100.0, "steps_per_s": 10.0, **metric}

    lm = {"adamw_torch": result(eval_perplexity=8.0), "zenflow": result(eval_perplexity=8.4)}
    rat = report.ratios(lm, "perplexity")["zenflow_vs_adamw_torch"]
    assert rat["eval_perplexity_ratio"] == pytest.approx(8.4 / 8.0) and "eval_perplexity_delta" not in rat
    row = next(line for line in report.comparison_table(lm, report.ratios(lm, "perplexity"), "perplexity", False,
                                                        headline=True).splitlines() if "held-out perplexity" in line)
    assert "8.4000" in row and "1.05×" in row

    scored = {"adamw_torch": result(eval_errors=5.0), "zenflow": result(eval_errors=7.0)}
    rat = report.ratios(scored, "errors")["zenflow_vs_adamw_torch"]
    assert rat == {**rat, "eval_errors_delta": 2.0} and "eval_errors_delta_points" not in rat
    table = report.comparison_table(scored, report.ratios(scored, "errors"), "errors", False, headline=True)
    assert "| +2 " in next(line for line in table.splitlines() if "held-out errors" in line)


def test_a_metric_name_never_reaches_for_the_hub(monkeypatch) -> None:
    """evaluate reads only HF_EVALUATE_OFFLINE (not HF_HUB_OFFLINE) and tries the Hub before its cache: the name is
    looked up with evaluate forced offline, and the user's setting is restored afterwards."""
    import evaluate
    import evaluate.loading

    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", False)  # as when the variable is not set
    hub_attempts: list[bool] = []
    original = evaluate.loading.HubEvaluationModuleFactory.get_module

    def watched(self):
        hub_attempts.append(evaluate.config.HF_EVALUATE_OFFLINE)
        return original(self)

    monkeypatch.setattr(evaluate.loading.HubEvaluationModuleFactory, "get_module", watched)
    with pytest.raises(MetricUnavailableError, match="not cached locally"):
        resolve_metric("bleu_hf_zenflow_test", "sequence-classification")
    assert hub_attempts and all(hub_attempts)  # every Hub lookup saw offline mode: it raised before any request
    assert evaluate.config.HF_EVALUATE_OFFLINE is False
