"""Accuracy per class and per group of classes (e.g. many / medium / few shots), with bootstrap CIs.

Where a long-tailed model loses accuracy matters: in the head classes it trained on most, or in the
tail. The accuracy of class ``c`` is the share of its test cases predicted as ``c`` (its recall); a
group's accuracy is the mean of its classes' accuracies (MiSLAS's many / medium / few columns).
The CIs resample the test cases (all replicates at once, ``bincount`` over an offset index: no
Python loop over cases or replicates inside a chunk).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lungcal.errors import DataError

__all__ = ["per_class_accuracy", "group_accuracy"]

#: bootstrap replicates are built in chunks of at most this many (replicate, case) index pairs
_CHUNK_CELLS = 4_000_000


def _check(pred, labels) -> tuple[np.ndarray, np.ndarray]:
    pred, labels = np.asarray(pred), np.asarray(labels)
    if pred.ndim != 1 or pred.shape != labels.shape:
        raise DataError(f"predictions {pred.shape} and labels {labels.shape} must be 1-D and of one length",
                        field="labels", fix="pass the predicted and the true class index of each case")
    return pred.astype(np.int64), labels.astype(np.int64)


def _per_class(hit: np.ndarray, labels: np.ndarray, idx: np.ndarray, n_classes: int) -> np.ndarray:
    """``(B, C)`` per-class accuracy of the resamples ``idx`` ``(B, N)`` (nan where a class is absent)."""
    b = idx.shape[0]
    cls = labels[idx] + n_classes * np.arange(b)[:, None]  # a bin per (replicate, class)
    right = np.bincount(cls.ravel(), hit[idx].ravel(), b * n_classes).reshape(b, n_classes)
    seen = np.bincount(cls.ravel(), minlength=b * n_classes).reshape(b, n_classes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return right / seen


def per_class_accuracy(pred, labels, n_classes: int | None = None) -> np.ndarray:
    """``(C,)`` accuracy of each class: right predictions among its cases (nan for a class with none).

    Args:
        pred: ``(N,)`` predicted class indices.
        labels: ``(N,)`` true class indices.
        n_classes: C (default: the largest index in ``pred`` or ``labels``, plus 1).
    """
    pred, labels = _check(pred, labels)
    c = int(max(pred.max(initial=-1), labels.max(initial=-1)) + 1) if n_classes is None else int(n_classes)
    return _per_class((pred == labels).astype(np.float64), labels, np.arange(len(labels))[None], c)[0]


def group_accuracy(pred, labels, groups: Mapping[str, Sequence[int]], n_bootstrap: int = 1000, seed: int = 0,
                   alpha: float = 0.05) -> dict[str, dict[str, float]]:
    """Per group: the mean over its classes of the per-class accuracy, with a percentile-bootstrap CI.

    Args:
        pred: ``(N,)`` predicted class indices.
        labels: ``(N,)`` true class indices.
        groups: ``{name: class indices}``; every class named must have test cases.
        n_bootstrap: resamples of the N cases (0: no CI, ``ci_low``/``ci_high`` are nan).
        seed: the resamples' seed.
        alpha: the CI is the ``(alpha/2, 1 - alpha/2)`` percentile interval.

    Returns:
        ``{name: {"acc", "ci_low", "ci_high"}}`` (fractions). A replicate in which a class of the
        group drew no case is left out of that group's percentiles.
    """
    pred, labels = _check(pred, labels)
    named = sorted({int(c) for g in groups.values() for c in g})
    n_classes = int(max(labels.max(initial=-1), pred.max(initial=-1), max(named, default=-1)) + 1)
    missing = sorted(set(named) - set(np.unique(labels).tolist()))
    if missing:
        raise DataError(f"classes {missing} have no test cases, so their accuracy is undefined", field="labels",
                        fix="score a split that holds every class of the groups")
    hit = (pred == labels).astype(np.float64)
    n = len(labels)
    point = _per_class(hit, labels, np.arange(n)[None], n_classes)[0]
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_CELLS // max(n, 1))
    parts = [_per_class(hit, labels, rng.integers(0, n, (min(chunk, n_bootstrap - done), n)), n_classes)
             for done in range(0, int(n_bootstrap), chunk)]
    reps = np.concatenate(parts) if parts else np.empty((0, n_classes))
    out = {}
    for name, classes in groups.items():
        cls = [int(c) for c in classes]
        lo = hi = float("nan")
        means = reps[:, cls].mean(1)
        means = means[np.isfinite(means)]
        if means.size:
            lo, hi = (float(v) for v in np.percentile(means, [100 * alpha / 2, 100 * (1 - alpha / 2)]))
        out[name] = {"acc": float(point[cls].mean()), "ci_low": lo, "ci_high": hi}
    return out
