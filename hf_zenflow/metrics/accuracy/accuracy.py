"""Accuracy: the share of predictions equal to their reference, as an `evaluate` metric script.

Shipped with hf_zenflow so that `evaluate.load(<this folder>)` works offline: the Hub's ``accuracy`` is fetched over
the network on first use and needs scikit-learn; this one needs numpy only and computes the same value for
``predictions``/``references`` of class ids (sample weights as in the Hub's: a weighted mean).
"""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = "Accuracy = (number of predictions equal to their reference) / (number of predictions)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    sample_weight (list of float, optional): a weight per example (default: all 1).
Returns:
    accuracy (float): in [0, 1].
Example:
    >>> metric = evaluate.load("hf_zenflow/metrics/accuracy")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, sample_weight=None):
        hits = np.asarray(predictions) == np.asarray(references)
        weights = np.ones(len(hits)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        return {"accuracy": float((hits * weights).sum() / weights.sum())}
