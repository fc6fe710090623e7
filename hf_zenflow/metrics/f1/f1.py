"""F1 score (the harmonic mean of precision and recall) as an `evaluate` metric script.

Shipped with hf_zenflow so that `evaluate.load(<this folder>)` works offline (the Hub's ``f1`` is fetched over the
network and needs scikit-learn); numpy only. ``average`` as in scikit-learn: "binary" (the class `pos_label`),
"macro" (unweighted mean over the classes present), "micro" (global counts; equals accuracy for single-label data) or
"weighted" (mean weighted by each class's number of references). A class never predicted and never referenced is
absent; a precision or recall with a zero denominator counts as 0 (scikit-learn's ``zero_division=0``).
"""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = "F1 = 2 * precision * recall / (precision + recall)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    average (str): "binary" (default), "macro", "micro" or "weighted".
    pos_label (int): the positive class of average="binary" (default 1).
Returns:
    f1 (float): in [0, 1].
Example:
    >>> metric = evaluate.load("hf_zenflow/metrics/f1")
    >>> metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'f1': 0.6666666666666666}
"""

AVERAGES = ("binary", "macro", "micro", "weighted")


def _f1(tp: float, fp: float, fn: float) -> float:
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="binary", pos_label=1):
        if average not in AVERAGES:
            raise ValueError(f"average={average!r} is invalid: allowed are {AVERAGES}.")
        pred, ref = np.asarray(predictions), np.asarray(references)
        if average == "binary":
            return {"f1": _f1(float(((pred == pos_label) & (ref == pos_label)).sum()),
                              float(((pred == pos_label) & (ref != pos_label)).sum()),
                              float(((pred != pos_label) & (ref == pos_label)).sum()))}
        classes = np.union1d(pred, ref)
        counts = [(float(((pred == c) & (ref == c)).sum()), float(((pred == c) & (ref != c)).sum()),
                   float(((pred != c) & (ref == c)).sum())) for c in classes]
        if average == "micro":
            return {"f1": _f1(*(sum(col) for col in zip(*counts)))}
        scores = np.array([_f1(*c) for c in counts])
        if average == "macro":
            return {"f1": float(scores.mean())}
        support = np.array([float((ref == c).sum()) for c in classes])
        return {"f1": float((scores * support).sum() / support.sum()) if support.sum() else 0.0}
