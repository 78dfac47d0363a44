"""Tests of lungcal.calibration.selective: risk-coverage, AURC, metrics at a coverage, MI."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import confusion_matrix

from lungcal.calibration import (
    aurc,
    metrics_at_coverage,
    mutual_information,
    predictive_entropy,
    risk_coverage,
    selective_report,
)
from lungcal.errors import ConfigError, DataError


def _binary(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    p1 = np.clip(0.5 + (y - 0.5) * rng.uniform(-0.4, 1.0, n), 0.0, 1.0)  # informative, with errors
    return p1, y


def _multiclass(n: int, c: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, c)) * 2
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    y = np.array([rng.choice(c, p=row) for row in p])
    return p, y


def _direct_aurc(conf: np.ndarray, err: np.ndarray) -> float:
    """Oracle: sort by confidence (descending, no ties), risk_k = errors in the top k / k, mean over k."""
    order = sorted(range(len(conf)), key=lambda i: -conf[i])
    risks, wrong = [], 0
    for k, i in enumerate(order, start=1):
        wrong += err[i]
        risks.append(wrong / k)
    return sum(risks) / len(risks)


def test_aurc_equals_direct_loop_multiclass():
    p, y = _multiclass(500)
    conf = p.max(1)
    assert len(np.unique(conf)) == len(conf)
    err = (p.argmax(1) != y).astype(int)
    assert aurc(p, y) == pytest.approx(_direct_aurc(conf, err), abs=1e-12)
    rc = risk_coverage(p, y)
    assert np.allclose(rc["coverage"], np.arange(1, 501) / 500)
    assert np.all(np.diff(rc["thresholds"]) <= 0)  # most certain first
    assert rc["risk"][-1] == pytest.approx(err.mean())


def test_aurc_binary_vector_and_matrix_agree_and_torch_input():
    p1, y = _binary(400)
    p2 = np.stack([1 - p1, p1], 1)
    a = aurc(p1, y)
    assert aurc(p2, y) == pytest.approx(a, abs=1e-12)
    assert aurc(torch.tensor(p2), torch.tensor(y)) == pytest.approx(a, abs=1e-12)
    # binary entropy is a monotone function of the confidence: same ranking, same AURC
    assert aurc(p1, y, score="entropy") == pytest.approx(a, abs=1e-12)


def test_oracle_score_gives_minimal_aurc_and_random_gives_error_rate():
    p, y = _multiclass(4000, seed=1)
    err = (p.argmax(1) != y)
    n, n_ok = len(y), int((~err).sum())
    # confidence = correctness: all correct cases (tied at 1) before all errors (tied at 0)
    # same predictions, confidence 1 for the correct cases and ~0.5 for the errors
    q = np.zeros_like(p)
    q[np.arange(n), p.argmax(1)] = np.where(err, 0.5, 1.0)
    second = (p.argmax(1) + 1) % p.shape[1]
    q[np.arange(n), second] += np.where(err, 0.5 - 1e-9, 0.0)
    q[np.arange(n), p.argmax(1)] += np.where(err, 1e-9, 0.0)
    assert np.array_equal(q.argmax(1), p.argmax(1))
    minimal = sum((k - n_ok) / k for k in range(n_ok + 1, n + 1)) / n
    assert aurc(q, y) == pytest.approx(minimal, abs=1e-9)
    # any other ranking of the same predictions is no better; a random one scores ~ the error rate
    rng = np.random.default_rng(0)
    for _ in range(5):
        conf = rng.uniform(0.5, 1.0, n)
        r = np.zeros_like(p)
        r[np.arange(n), p.argmax(1)] = conf
        r[np.arange(n), second] = 1 - conf - 1e-12
        assert np.array_equal(r.argmax(1), p.argmax(1))
        a = aurc(r, y)
        assert a >= minimal
        assert a == pytest.approx(err.mean(), abs=0.03)
    assert aurc(p, y) < err.mean()  # the model's own confidence is informative here


def test_ties_are_averaged_and_order_free():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 200)
    p1 = np.round(rng.uniform(0, 1, 200), 1)  # many ties
    rc = risk_coverage(p1, y)
    perm = rng.permutation(200)
    rc2 = risk_coverage(p1[perm], y[perm])
    assert np.allclose(rc["risk"], rc2["risk"], atol=1e-12)
    # a constant score: every coverage has the overall error rate
    const = np.full(200, 0.7)
    err = ((const > 0.5).astype(int) != y).mean()
    assert np.allclose(risk_coverage(const, y)["risk"], err)
    assert aurc(const, y) == pytest.approx(err)


def test_metrics_at_full_coverage_equal_plain_metrics():
    p1, y = _binary(600, seed=2)
    for thr in (0.5, 0.3):
        m = metrics_at_coverage(p1, y, 1.0, threshold=thr)
        pred = (p1 > thr).astype(int)
        tn, fp, fn, tp = confusion_matrix(y, pred, labels=[0, 1]).ravel()
        assert m["n_kept"] == 600 and m["n_referred"] == 0 and m["coverage"] == 1.0
        assert m["acc"] == pytest.approx((tp + tn) / 600)
        assert m["sensitivity"] == pytest.approx(tp / (tp + fn))
        assert m["specificity"] == pytest.approx(tn / (tn + fp))
        assert math.isnan(m["referred_cancer_share"])


def test_coverage_90_keeps_the_most_certain_round_share():
    p1, y = _binary(333, seed=4)
    m = metrics_at_coverage(p1, y, 0.9)
    k = round(0.9 * 333)
    assert m["n_kept"] == k and m["n_referred"] == 333 - k
    conf = np.maximum(p1, 1 - p1)
    kept = np.argsort(-conf, kind="stable")[:k]
    referred = np.setdiff1d(np.arange(333), kept)
    pred = (p1 > 0.5).astype(int)
    tn, fp, fn, tp = confusion_matrix(y[kept], pred[kept], labels=[0, 1]).ravel()
    assert m["sensitivity"] == pytest.approx(tp / (tp + fn))
    assert m["specificity"] == pytest.approx(tn / (tn + fp))
    assert m["acc"] == pytest.approx((tp + tn) / k)
    assert m["referred_cancer_share"] == pytest.approx(y[referred].mean())
    assert conf[kept].min() >= conf[referred].max()


def test_multiclass_metrics_at_coverage_has_acc_only():
    p, y = _multiclass(300)
    m = metrics_at_coverage(p, y, 0.5)
    kept = np.argsort(-p.max(1), kind="stable")[:150]
    assert m["acc"] == pytest.approx((p[kept].argmax(1) == y[kept]).mean())
    assert "sensitivity" not in m


def test_mutual_information_zero_when_members_agree():
    p, y = _multiclass(50)
    agree = np.stack([p, p, p])
    assert np.allclose(mutual_information(agree), 0.0, atol=1e-12)
    rng = np.random.default_rng(5)
    other = rng.dirichlet(np.ones(5), size=50)
    disagree = np.stack([p, other])
    mi = mutual_information(disagree)
    assert np.all(mi >= 0) and mi.max() > 0.01
    # MI <= entropy of the mean (it is the entropy minus the mean member entropy)
    assert np.all(mi <= predictive_entropy(disagree.mean(0)) + 1e-12)
    # ranking by MI with agreeing members: all tied -> overall error rate at every coverage
    err = (p.argmax(1) != y).mean()
    assert aurc(p, y, score="mi", member_probs=agree) == pytest.approx(err, abs=1e-9)
    assert np.isfinite(aurc(p, y, score="mi", member_probs=disagree))


def test_entropy_matches_direct_formula():
    p, _ = _multiclass(20)
    assert np.allclose(predictive_entropy(p), [-(r * np.log(r)).sum() for r in p])
    assert predictive_entropy(np.array([0.0, 1.0])).tolist() == [0.0, 0.0]


def test_selective_report_keys():
    p1, y = _binary(200)
    r = selective_report(p1, y)
    assert set(r) == {"aurc", "acc_cov90", "n_referred_cov90", "sensitivity", "specificity", "sensitivity_cov90",
                      "specificity_cov90", "referred_cancer_share_cov90"}
    assert r["n_referred_cov90"] == 20
    p, y = _multiclass(100)
    assert set(selective_report(p, y)) == {"aurc", "acc_cov90", "n_referred_cov90"}


@pytest.mark.parametrize("coverage", [0.0, -0.1, 1.01, float("nan"), True, "0.9"])
def test_bad_coverage_raises(coverage):
    p1, y = _binary(20)
    with pytest.raises(ConfigError, match="coverage"):
        metrics_at_coverage(p1, y, coverage)


def test_bad_score_and_missing_members_raise():
    p1, y = _binary(20)
    with pytest.raises(ConfigError, match="unknown score"):
        aurc(p1, y, score="margin")
    with pytest.raises(ConfigError, match="member_probs"):
        risk_coverage(p1, y, score="mi")
    with pytest.raises(DataError, match="member_probs"):
        aurc(p1, y, score="mi", member_probs=np.zeros((3, 19, 2)))
    with pytest.raises(ConfigError, match="threshold"):
        metrics_at_coverage(p1, y, 0.9, threshold=1.5)
