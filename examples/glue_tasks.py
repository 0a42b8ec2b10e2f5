"""The GLUE tasks: their text columns, labels, validation split and metric.

Metrics are computed with scikit-learn and SciPy (the ``evaluate`` package would download its
metric scripts from the Hub). The figures and names match the transformers ``run_glue`` example:
``accuracy`` everywhere but STS-B, ``f1`` for MRPC and QQP, ``matthews_correlation`` for CoLA,
``pearson``/``spearmanr`` for STS-B (a regression: one output, float labels).

Example:
    >>> import numpy as np
    >>> GLUE_TASKS["mrpc"].text_columns
    ('sentence1', 'sentence2')
    >>> GLUE_TASKS["cola"].compute_metrics(np.array([[0.1, 0.9], [0.8, 0.2]]), np.array([1, 0]))
    {'matthews_correlation': 1.0, 'accuracy': 1.0}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task as the script needs it.

    Attributes:
        name: the GLUE config name (``datasets.load_dataset("nyu-mll/glue", name)``).
        text_columns: the one or two columns fed to the tokenizer (a sentence or a pair).
        label_names: class names in label-id order; empty for the STS-B regression.
        metrics: the metrics reported, the first one is the task's headline metric.
        validation_split: the split evaluated (MNLI has two; the matched one, as run_glue).
    """

    name: str
    text_columns: tuple[str, ...]
    label_names: tuple[str, ...]
    metrics: tuple[str, ...]
    validation_split: str = "validation"

    @property
    def is_regression(self) -> bool:
        return not self.label_names

    @property
    def num_labels(self) -> int:
        """Outputs of the classification head (1 for a regression)."""
        return len(self.label_names) or 1

    @property
    def main_metric(self) -> str:
        return self.metrics[0]

    @property
    def chance(self) -> float | None:
        """The headline metric of a uniform guess that ignores the input (None where it has no one value).

        Accuracy: one over the classes. Matthews and correlations: 0. F1 depends on the label balance.
        """
        if self.main_metric == "accuracy":
            return 1.0 / self.num_labels
        if self.main_metric in ("matthews_correlation", "pearson"):
            return 0.0
        return None

    def compute_metrics(self, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        """The task's metrics from logits (or regression outputs) and gold labels."""
        predictions = np.asarray(predictions)
        labels = np.asarray(labels)
        if self.is_regression:
            scores = predictions.reshape(-1).astype(np.float64)
            gold = labels.reshape(-1).astype(np.float64)
            return {
                "pearson": float(pearsonr(scores, gold)[0]),
                "spearmanr": float(spearmanr(scores, gold)[0]),
            }
        predicted = predictions.argmax(axis=-1)
        results: dict[str, float] = {}
        for metric in self.metrics:
            if metric == "accuracy":
                results[metric] = float(accuracy_score(labels, predicted))
            elif metric == "f1":
                results[metric] = float(f1_score(labels, predicted))
            elif metric == "matthews_correlation":
                results[metric] = float(matthews_corrcoef(labels, predicted))
            else:  # a table entry without an implementation is a programming error
                raise KeyError(metric)
        return results


_NLI = ("entailment", "not_entailment")

GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask("cola", ("sentence",), ("unacceptable", "acceptable"), ("matthews_correlation", "accuracy")),
        GlueTask("sst2", ("sentence",), ("negative", "positive"), ("accuracy",)),
        GlueTask("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent"), ("f1", "accuracy")),
        GlueTask("qqp", ("question1", "question2"), ("not_duplicate", "duplicate"), ("f1", "accuracy")),
        GlueTask("stsb", ("sentence1", "sentence2"), (), ("pearson", "spearmanr")),
        GlueTask(
            "mnli",
            ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
            ("accuracy",),
            validation_split="validation_matched",
        ),
        GlueTask("qnli", ("question", "sentence"), _NLI, ("accuracy",)),
        GlueTask("rte", ("sentence1", "sentence2"), _NLI, ("accuracy",)),
        GlueTask("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment"), ("accuracy",)),
    )
}
