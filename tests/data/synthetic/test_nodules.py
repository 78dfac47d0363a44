"""lungcal.data.synthetic.nodules: the feature model, its Bayes posterior and the Bayes AUC."""
from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score

from lungcal.data.synthetic import NODULE_MODEL, bayes_auc, bayes_posterior, likelihood_ratio, sample_nodule_features


def test_bayes_auc_in_target_band():
    auc = bayes_auc(n=60_000, prevalence=0.11, seed=1)
    assert 0.84 <= auc <= 0.91, auc
    # the AUC does not depend on the prevalence (the posterior is monotone in the likelihood ratio)
    assert abs(bayes_auc(n=60_000, prevalence=0.4, seed=1) - auc) < 0.01


def test_bayes_auc_matches_sklearn_on_the_same_simulation():
    # bayes_auc draws y, then the benign nodules, then the malignant ones; rebuild that here
    n, prev, seed = 20_000, 0.2, 7
    rng = np.random.default_rng(seed)
    y = rng.random(n) < prev
    nb = rng.poisson(NODULE_MODEL["lam"], n)
    ct_b, ct_m = np.repeat(np.arange(n), nb), np.flatnonzero(y)
    db, mb, ab = sample_nodule_features(rng, False, ct_b.size)
    dm, mm, am = sample_nodule_features(rng, True, ct_m.size)
    score = (np.bincount(ct_b, likelihood_ratio(db, mb, ab), minlength=n)
             + np.bincount(ct_m, likelihood_ratio(dm, mm, am), minlength=n))
    assert abs(bayes_auc(n=n, prevalence=prev, seed=seed) - roc_auc_score(y, score)) < 1e-12


def test_likelihood_ratio_has_unit_mean_under_the_benign_model():
    # E_benign[f_m / f_b] = integral of f_m = 1: checks both truncated densities and the category tables
    rng = np.random.default_rng(3)
    d, m, a = sample_nodule_features(rng, False, 400_000)
    assert abs(likelihood_ratio(d, m, a).mean() - 1) < 0.02


def test_bayes_posterior_is_calibrated():
    # simulate CTs from the generative model and check the posterior against the labels in bins
    rng = np.random.default_rng(0)
    prev, n = 0.3, 6000
    ps, ys = [], []
    for _ in range(n):
        y = rng.random() < prev
        d, m, a = sample_nodule_features(rng, False, rng.poisson(NODULE_MODEL["lam"]))
        if y:
            d2, m2, a2 = sample_nodule_features(rng, True, 1)
            d, m, a = np.r_[d, d2], np.r_[m, m2], np.r_[a, a2]
        ps.append(bayes_posterior(d, m, a, prev))
        ys.append(y)
    ps, ys = np.array(ps), np.array(ys)
    bins = np.digitize(ps, [0.2, 0.4, 0.6, 0.8])
    for b in range(5):
        sel = bins == b
        if sel.sum() > 200:
            assert abs(ps[sel].mean() - ys[sel].mean()) < 0.05


def test_bayes_posterior_without_nodules_is_zero():
    assert bayes_posterior([], [], [], 0.5) == 0.0


def test_benign_smaller_than_malignant():
    rng = np.random.default_rng(0)
    db, _, ab = sample_nodule_features(rng, False, 4000)
    dm, _, am = sample_nodule_features(rng, True, 4000)
    assert np.median(dm) > np.median(db) + 3
    assert (ab == 2).mean() > (am == 2).mean()  # calcified is a benign sign
    assert db.min() >= 4 and dm.max() <= 30
