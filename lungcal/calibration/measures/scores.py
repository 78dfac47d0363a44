"""Scores of each case summed over cases: Brier score, NLL, accuracy, and the AUC by rank statistics."""
from __future__ import annotations

import numpy as np
from scipy.stats import rankdata

from lungcal.calibration.measures.inputs import _as_probs_labels, _top_label

__all__ = ["brier_score", "nll", "accuracy", "auroc"]


def _brier_per_sample(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    p64 = p.astype(np.float64)
    if p.shape[1] == 2:
        return (p64[:, 1] - (y == 1)) ** 2
    onehot = np.zeros_like(p64)
    onehot[np.arange(p.shape[0]), y] = 1.0
    return ((p64 - onehot) ** 2).sum(1)


def brier_score(probs, labels) -> float:
    """Brier score, as in scikit-learn's ``brier_score_loss``.

    Binary tasks (``(N,)`` or ``(N, 2)`` input): ``mean((p1 - y)^2)``, in [0, 1].
    Multi-class: ``mean(sum_k (p_k - 1[y=k])^2)``, in [0, 2] (the original Brier 1950 score).
    """
    p, y = _as_probs_labels(probs, labels)
    return float(_brier_per_sample(p, y).mean())


_NLL_EPS = 1e-12


def _nll_per_sample(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    py = np.take_along_axis(p, y[:, None], axis=1)[:, 0].astype(np.float64)
    return -np.log(np.clip(py, _NLL_EPS, 1.0))


def nll(probs, labels) -> float:
    """Mean negative log-likelihood ``-mean(log p_y)`` (natural log; p_y clipped at 1e-12)."""
    p, y = _as_probs_labels(probs, labels)
    return float(_nll_per_sample(p, y).mean())


def accuracy(probs, labels) -> float:
    """Fraction of samples whose argmax class equals the label."""
    p, y = _as_probs_labels(probs, labels)
    return float((_top_label(p)[1] == y).mean())


def _auc_from_scores(score: np.ndarray, pos: np.ndarray) -> float:
    """Mann-Whitney AUC with average ranks for ties; nan when one class is absent."""
    n1 = int(pos.sum())
    n0 = pos.shape[0] - n1
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = rankdata(score, method="average")
    return float((r[pos].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def auroc(probs, labels) -> float:
    """Area under the ROC curve via rank statistics (ties count one half).

    Binary tasks (``(N,)`` or ``(N, 2)``): AUC of p(y=1). Multi-class: macro average of the
    one-vs-rest AUCs of p_k (as scikit-learn's ``multi_class="ovr", average="macro"``).
    Returns nan when AUC is undefined (a binary label set with one class); classes absent from
    ``labels`` are left out of the macro average.
    """
    p, y = _as_probs_labels(probs, labels)
    if p.shape[1] == 2:
        return _auc_from_scores(p[:, 1], y == 1)
    vals = np.array([_auc_from_scores(p[:, k], y == k) for k in range(p.shape[1])])
    return float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")
