"""The held-out metric of `hf-zenflow compare` / `tune`, computed with `evaluate`.

``--metric`` takes an `evaluate` metric name or a local metric script (a ``.py`` file or a folder holding
``<folder name>.py``). The names hf_zenflow ships as scripts (`SHIPPED`: accuracy, f1; package data in
``hf_zenflow/metrics/``) load from there, offline: ``evaluate.load("accuracy")`` by name would fetch the script from
the Hub. Any other name loads only when `evaluate` has it cached locally; otherwise `MetricUnavailableError` says so,
before any training starts.

Defaults: accuracy for sequence classification; perplexity (exp of the held-out mean token loss, no script) for a
causal LM. A causal LM given a classification metric (accuracy, f1) is scored on its next-token predictions.

In results, the metric's value is ``result[metric_key(name)]`` (``eval_<name>``, the Trainer's convention), and the
report compares it as a score (ZenFlow minus baseline; in points for a fraction such as accuracy) or, for a cost such
as perplexity, as a ratio (`is_cost`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


#: Metric names served by the scripts shipped in hf_zenflow/metrics/<name>/<name>.py (offline).
SHIPPED = ("accuracy", "f1")
PERPLEXITY = "perplexity"
#: Lower is better: compared as a ratio (ZenFlow ÷ baseline), like the loss.
COSTS = frozenset({PERPLEXITY})
#: Values in [0, 1]: differences are shown in points (x 100).
FRACTIONS = frozenset({"accuracy", "f1", "precision", "recall", "next-token accuracy"})
METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"


class MetricUnavailableError(ValueError):
    """A `--metric` that cannot be loaded offline; the message names it and what is available."""


def metric_key(name: str) -> str:
    """The result key of a metric's value: ``eval_<name>`` with non-alphanumerics as ``_`` (``eval_accuracy``)."""
    return "eval_" + re.sub(r"[^0-9a-zA-Z]+", "_", name).strip("_").lower()


def is_cost(name: str) -> bool:
    return name in COSTS


def is_fraction(name: str) -> bool:
    return name in FRACTIONS


@dataclass
class TaskMetric:
    """The metric one comparison reports: its name, where it came from, and how to compute it."""

    name: str
    source: str  # "shipped script <path>", a local script path, "evaluate cache", or "exp(held-out loss)"
    module: Any = None  # an evaluate.EvaluationModule; None for perplexity
    compute_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return metric_key(self.name)

    @property
    def needs_predictions(self) -> bool:
        return self.module is not None

    def compute(self, predictions: list[int], references: list[int], mean_loss: float) -> float:
        """The metric's value: perplexity from the mean loss, anything else through `evaluate`."""
        if self.module is None:
            return math.exp(mean_loss) if mean_loss < 700 else math.inf  # exp overflows a float beyond ~709
        out = self.module.compute(predictions=predictions, references=references, **self.compute_kwargs)
        return _pick(out, self.name)


def _pick(out: dict[str, Any], name: str) -> float:
    """The metric's number from `evaluate`'s result dict: the entry named like the metric, else the only number."""
    if name in out:
        return float(out[name])
    numbers = {k: v for k, v in out.items() if isinstance(v, (int, float))}
    if len(numbers) == 1:
        return float(next(iter(numbers.values())))
    raise MetricUnavailableError(f"metric {name!r} returned {sorted(out)}: a compare metric must return one number "
                                 f"(or an entry named {name!r}).")


def _script_path(spec: str) -> Path | None:
    """A local metric script: a .py file, or a folder holding <folder name>.py."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".py":
        return path
    if path.is_dir() and (path / f"{path.name}.py").is_file():
        return path
    return None


def resolve_metric(spec: str | None, task: str, num_labels: int | None = None) -> TaskMetric:
    """Load the metric for `task` ("sequence-classification" or "causal-lm"); `spec` None = the task's default.

    Raises `MetricUnavailableError` (one line) when the metric cannot be loaded without the network.
    """
    if spec is None:
        spec = PERPLEXITY if task == "causal-lm" else "accuracy"
    if spec == PERPLEXITY:
        if task != "causal-lm":
            raise MetricUnavailableError("--metric perplexity needs a causal-LM task: a classifier has no token loss "
                                         f"(shipped for classification: {', '.join(SHIPPED)}).")
        return TaskMetric(PERPLEXITY, "exp(held-out mean token loss)")
    import evaluate

    _quiet(evaluate)
    kwargs: dict[str, Any] = {}
    if spec in SHIPPED:
        path, source = METRICS_DIR / spec, f"shipped script hf_zenflow/metrics/{spec}/{spec}.py"
        if spec == "f1" and (num_labels or 2) > 2:
            kwargs["average"] = "macro"  # "binary" needs two classes
    elif (local := _script_path(spec)) is not None:
        path, source = local, str(local)
    else:
        # A name: only what evaluate has cached. evaluate would try the Hub first (it reads only its own
        # HF_EVALUATE_OFFLINE, not HF_HUB_OFFLINE): forced offline, it goes straight to its local cache.
        offline = evaluate.config.HF_EVALUATE_OFFLINE
        evaluate.config.HF_EVALUATE_OFFLINE = True
        try:
            module = evaluate.load(spec, keep_in_memory=True)
        except Exception as exc:  # evaluate raises FileNotFoundError, ConnectionError or its own errors here
            raise MetricUnavailableError(
                f"--metric {spec!r} is not cached locally and compare does not download ({type(exc).__name__}): "
                f"use one shipped with hf_zenflow ({', '.join(SHIPPED)}"
                f"{', perplexity' if task == 'causal-lm' else ''}) or a local evaluate metric script (a .py file or a "
                "folder holding <folder name>.py).") from exc
        finally:
            evaluate.config.HF_EVALUATE_OFFLINE = offline
        return TaskMetric(module.name, "evaluate cache", module)
    # keep_in_memory: the predictions stay in memory instead of an Arrow file under ~/.cache (one process, one compute)
    module = evaluate.load(str(path), keep_in_memory=True)
    name = spec if spec in SHIPPED else module.name
    return TaskMetric(name, source, module, kwargs)


def _quiet(evaluate: Any) -> None:
    """No progress bars or INFO lines from evaluate: compare draws its own bar."""
    evaluate.logging.set_verbosity_error()
    evaluate.logging.disable_progress_bar()
