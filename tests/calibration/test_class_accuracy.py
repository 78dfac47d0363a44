"""lungcal.calibration.class_accuracy: per-class and per-group accuracy, against scikit-learn's recall."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import recall_score

from lungcal.calibration.class_accuracy import group_accuracy, per_class_accuracy
from lungcal.errors import DataError

GROUPS = {"many": (0, 1, 2), "medium": (3, 4, 5, 6), "few": (7, 8, 9)}


def fading_tail(seed: int = 0, n_per_class: int = 60):
    """Balanced labels; class c is predicted right with probability 0.9 - 0.08 c (a fading tail)."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(10), n_per_class)
    right = rng.random(len(y)) < 0.9 - 0.08 * y
    return np.where(right, y, (y + rng.integers(1, 10, len(y))) % 10), y


def test_per_class_accuracy_is_sklearn_recall():
    pred, y = fading_tail()
    np.testing.assert_allclose(per_class_accuracy(pred, y), recall_score(y, pred, average=None))
    acc = per_class_accuracy(pred[y != 4], y[y != 4], n_classes=11)
    assert acc.shape == (11,) and np.isnan(acc[[4, 10]]).all()  # no cases: undefined, not 0


def test_group_accuracy_is_the_mean_of_per_class_recall_with_a_ci():
    pred, y = fading_tail()
    out = group_accuracy(pred, y, GROUPS, n_bootstrap=400)
    recall = recall_score(y, pred, average=None)
    for name, classes in GROUPS.items():
        g = out[name]
        assert g["acc"] == pytest.approx(recall[list(classes)].mean())
        assert g["ci_low"] < g["acc"] < g["ci_high"]
    assert out["many"]["acc"] > out["medium"]["acc"] > out["few"]["acc"]
    assert out["few"]["ci_high"] < out["many"]["ci_low"]  # 0.82 vs 0.18 apart: far outside the noise
    assert group_accuracy(pred, y, GROUPS, n_bootstrap=400) == out  # seeded
    assert np.isnan(group_accuracy(pred, y, GROUPS, n_bootstrap=0)["few"]["ci_low"])


def test_the_vectorised_bootstrap_is_the_plain_loop():
    """Replicate by replicate, the chunked bincount equals sklearn's recall of the resampled cases."""
    pred, y = fading_tail(2, n_per_class=30)
    rng = np.random.default_rng(5)
    means = []
    for _ in range(200):
        i = rng.integers(0, len(y), len(y))
        means.append(recall_score(y[i], pred[i], labels=[7, 8, 9], average=None).mean())
    lo, hi = np.percentile(means, [2.5, 97.5])
    g = group_accuracy(pred, y, {"few": (7, 8, 9)}, n_bootstrap=200, seed=5)["few"]
    assert (g["ci_low"], g["ci_high"]) == pytest.approx((lo, hi))


def test_group_accuracy_refuses_a_class_without_test_cases():
    pred, y = fading_tail()
    keep = y != 8
    with pytest.raises(DataError, match=r"classes \[8\] have no test cases"):
        group_accuracy(pred[keep], y[keep], GROUPS, n_bootstrap=0)
    with pytest.raises(DataError, match="1-D and of one length"):
        per_class_accuracy(pred[:5], y)
