"""Label-shift-aware shift tests on model outputs (lungcal.calibration.shift).

Oracles: scipy's two-sample KS (statistic, exact p-value) and binomial test; simulated scores whose
class-conditional laws are known, so that a pure prevalence change and a change of p(score | y) are
known by construction.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from lungcal.calibration import shift as shift_module
from lungcal.calibration.shift import (
    EFFECT_AUC,
    EmbeddingRange,
    bbse_prevalence,
    call_rate_test,
    domain_effect,
    ks_permutation_test,
    ks_statistic,
    label_shift_test,
    matched_reference,
    merge_pvalues,
    minimum_detectable_auc,
    mmd_permutation_test,
    prevalence_interval,
    range_test,
    reduce_features,
)
from lungcal.errors import DataError


def _scores(rng, n, prevalence, shift=0.0, scale=1.0):
    """Model scores: N(+1, 1) for cancers, N(-1, 1) for the others (AUC about 0.92); ``shift``/``scale``
    change p(score | y) as a scanner change would."""
    y = (rng.random(n) < prevalence).astype(int)
    return np.where(y == 1, 1.0, -1.0) * scale + shift + rng.normal(size=n), y


def test_ks_statistic_is_scipys_with_and_without_ties():
    rng = np.random.default_rng(0)
    for x, y in [(rng.normal(size=40), rng.normal(0.3, 1, size=55)),
                 (rng.integers(0, 5, 30).astype(float), rng.integers(0, 6, 41).astype(float))]:
        assert ks_statistic(x, y) == pytest.approx(stats.ks_2samp(x, y).statistic, abs=1e-12)
    batch_x, batch_y = rng.normal(size=(3, 20)), rng.normal(size=(3, 25))
    expect = [stats.ks_2samp(a, b).statistic for a, b in zip(batch_x, batch_y)]
    assert np.allclose(ks_statistic(batch_x, batch_y), expect)


def test_the_permutation_p_value_agrees_with_the_exact_ks_p_value():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=25), rng.normal(0.5, 1, size=30)
    exact = stats.ks_2samp(x, y, method="exact").pvalue
    res = ks_permutation_test(x, y, n_resamples=9999, seed=0)
    assert res.pvalue == pytest.approx(exact, abs=0.02)
    assert res.n_source == 25 and res.n_target == 30


def test_bbse_recovers_the_target_prevalence_and_its_interval_covers_it():
    rng = np.random.default_rng(2)
    s, y = _scores(rng, 4000, 0.4)
    for q in (0.05, 0.11, 0.4, 0.7):
        t, _ = _scores(rng, 4000, q)
        assert bbse_prevalence(s, y, t) == pytest.approx(q, abs=0.03)
    t, _ = _scores(rng, 300, 0.11)
    lo, hi = prevalence_interval(s[:400], y[:400], t, n_bootstrap=300)
    assert lo < 0.11 < hi and hi - lo < 0.2
    chance = rng.normal(size=400)  # a model that does not rank: nothing to estimate
    assert np.isnan(bbse_prevalence(chance, (chance > 10).astype(int) | (np.arange(400) % 2), chance,
                                    threshold=100.0))


def test_the_call_rate_test_is_exact_with_both_samples_error_and_is_the_move_of_the_bbse_estimate():
    rng = np.random.default_rng(11)
    # under no change, a fresh source each time: Fisher at the pooled median rejects at most alpha (conservative)
    rejected = []
    for _ in range(2000):
        s, _ = _scores(rng, 300, 0.3)
        t, _ = _scores(rng, 50, 0.3)
        rejected.append(call_rate_test(s, t).pvalue < 0.05)
    assert np.mean(rejected) <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 2000)
    # its statistic is the move of the call fraction, and BBSE's estimate moves by it over tpr - fpr
    s, y = _scores(rng, 400, 0.3)
    t, _ = _scores(rng, 200, 0.5)
    res = call_rate_test(s, t)
    cut = float(np.median(np.concatenate([s, t])))
    tpr, fpr = (s[y == 1] > cut).mean(), (s[y == 0] > cut).mean()
    assert res.statistic == pytest.approx((t > cut).mean() - (s > cut).mean())
    assert bbse_prevalence(s, y, t, threshold=cut) - y.mean() == pytest.approx(res.statistic / (tpr - fpr))
    assert res.pvalue < 0.05 and res.n_source == 400 and res.n_target == 200
    with pytest.raises(DataError):
        call_rate_test([], t)


def test_the_matched_reference_has_the_target_class_ratio_and_is_as_large_as_it_can_be():
    rng = np.random.default_rng(3)
    y = np.array([1] * 80 + [0] * 120)
    idx = matched_reference(y, 0.11, rng)
    assert len(set(idx)) == idx.size
    assert y[idx].mean() == pytest.approx(0.11, abs=0.01)
    assert (y[idx] == 0).sum() == 120  # the scarce class limits it: every non-cancer is used
    idx = matched_reference(y, 0.9, rng)
    assert (y[idx] == 1).sum() == 80 and y[idx].mean() == pytest.approx(0.9, abs=0.01)


def test_a_pure_prevalence_change_is_not_flagged_on_the_scores():
    """Source: 200 validation cases at prevalence 0.4; site: 150 cases at 0.11. The un-weighted test sees the
    prevalence change; the label-shift-aware test keeps its level."""
    rng = np.random.default_rng(4)
    n_sim, alpha = 60, 0.05
    plain, aware = [], []
    for i in range(n_sim):
        s, y = _scores(rng, 200, 0.4)
        t, _ = _scores(rng, 150, 0.11)
        plain.append(ks_permutation_test(s, t, n_resamples=300, seed=i).pvalue)
        aware.append(label_shift_test(s, y, t, n_subsamples=5, n_resamples=300, seed=i).pvalue)
    assert np.mean(np.asarray(plain) < alpha) > 0.8  # something changed ...
    assert np.mean(np.asarray(aware) < alpha) <= alpha + 0.05  # ... but only the prevalence


def _embeddings(rng, n, prevalence, noise=1.0, dims=16):
    """Bag embeddings: the class on the first axis; a noisier scanner widens every axis."""
    y = (rng.random(n) < prevalence).astype(int)
    f = rng.normal(size=(n, dims)) * noise
    f[:, 0] += np.where(y == 1, 1.0, -1.0)
    return f, f[:, 0] + 0.1 * f[:, 1], y


def test_on_embeddings_a_prevalence_change_keeps_the_level_and_a_noisier_scanner_is_found():
    rng = np.random.default_rng(5)
    n_sim, alpha = 20, 0.05
    same, prev, noisy = [], [], []
    for i in range(n_sim):
        fs, ss, ys = _embeddings(rng, 200, 0.4)
        for out, (q, noise) in ((same, (0.4, 1.0)), (prev, (0.11, 1.0)), (noisy, (0.11, 1.3))):
            ft, st, _ = _embeddings(rng, 150, q, noise)
            a, b = reduce_features(fs, ft)
            out.append(label_shift_test(ss, ys, st, source_features=a, target_features=b, n_subsamples=2,
                                        n_resamples=200, seed=i).pvalue)
    assert np.mean(np.asarray(same) < alpha) <= alpha + 0.05
    assert np.mean(np.asarray(prev) < alpha) <= alpha + 0.05
    assert np.mean(np.asarray(noisy) < alpha) > 0.8


def test_the_mmd_permutation_test_is_uniform_under_the_null_and_finds_a_mean_shift():
    rng = np.random.default_rng(6)
    null = [mmd_permutation_test(rng.normal(size=(40, 3)), rng.normal(size=(50, 3)), n_resamples=200,
                                 seed=i).pvalue for i in range(40)]
    assert 0.3 < np.mean(null) < 0.7 and np.mean(np.asarray(null) < 0.05) <= 0.12
    moved = mmd_permutation_test(rng.normal(size=(40, 3)), rng.normal(0.8, 1, size=(50, 3)), n_resamples=500)
    assert moved.pvalue < 0.01 and moved.n_source == 40 and moved.n_target == 50


def test_merging_is_twice_the_median_capped_at_one():
    assert merge_pvalues([0.01, 0.02, 0.5]) == pytest.approx(0.04)
    assert merge_pvalues([0.6, 0.9]) == 1.0


def test_range_test_counts_outside_values_and_is_scipys_binomial_test():
    values = np.array([1.0, 2.0, 3.0, 10.0, np.nan, -5.0])
    outside, n, p = range_test(values, 0.5, 4.0)
    assert (outside, n) == (2, 5)
    assert p == pytest.approx(stats.binomtest(2, 5, 0.02, alternative="greater").pvalue)
    assert range_test([np.nan], 0, 1) == (0, 0, 1.0)


def test_a_source_without_both_labels_is_a_data_error():
    with pytest.raises(DataError):
        bbse_prevalence([0.1, 0.2], [1, 1], [0.3])
    with pytest.raises(DataError):
        ks_permutation_test([0.1], [0.2, 0.3])


def test_the_embedding_range_flags_about_1_minus_its_quantile_of_new_cases_and_most_shifted_ones():
    rng = np.random.default_rng(7)
    ref = rng.normal(size=(200, 24))
    er = EmbeddingRange(ref, quantile=0.99)
    assert er.outside(rng.normal(size=(4000, 24))).mean() <= 0.03  # held-out calibration, not in-sample
    assert er.outside(rng.normal(size=(500, 24)) * 2.0).mean() > 0.5
    assert er.distance(ref[:3]).shape == (3,)


def test_the_domain_effect_is_small_on_a_same_scanner_site_large_on_a_shifted_one_and_ignores_prevalence():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(300, 16))
    same = domain_effect(ref, rng.normal(size=(80, 16)))
    assert same.ci[0] <= 0.5 <= same.ci[1] and not same.large
    shifted = domain_effect(ref, rng.normal(size=(80, 16)) + np.r_[1.2, np.zeros(15)])
    assert shifted.ci[0] > 0.5 and shifted.large and shifted.auc >= EFFECT_AUC
    # the smallest AUC these n could show, by hand (one-sided 5 %, power 0.8, Hanley-McNeil SE at 0.5)
    se = np.sqrt((80 + 300 + 1) / (12 * 80 * 300))
    assert same.mde == pytest.approx(0.5 + (1.6448536 + 0.8416212) * se, rel=1e-6)
    assert minimum_detectable_auc(1000, 1000) < same.mde  # more CTs, smaller differences visible
    # a change of prevalence alone: the classes sit apart in the embedding; the site has three times the cancers
    y = (rng.random(600) < 0.2).astype(int)
    ref_mix = rng.normal(size=(600, 8)) + 2.0 * y[:, None] * np.r_[1.0, np.zeros(7)]
    y_site = (rng.random(200) < 0.6).astype(int)
    site = rng.normal(size=(200, 8)) + 2.0 * y_site[:, None] * np.r_[1.0, np.zeros(7)]
    plain = domain_effect(ref_mix, site)
    w = np.where(y == 1, 0.6 / y.mean(), 0.4 / (1 - y.mean()))
    weighted = domain_effect(ref_mix, site, source_weights=w)
    assert plain.large and weighted.ci[0] <= 0.5 + 0.05 and weighted.auc < plain.auc - 0.1


def test_the_mmd_statistic_is_the_three_block_means():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(23, 4))
    kernel = np.exp(-((x[:, None] - x[None]) ** 2).sum(-1) / 4)
    order = np.stack([rng.permutation(23) for _ in range(5)])
    nx = 9
    for o in (order, order[0]):
        a, b = o[..., :nx], o[..., nx:]
        want = (kernel[a[..., :, None], a[..., None, :]].mean(axis=(-2, -1))
                + kernel[b[..., :, None], b[..., None, :]].mean(axis=(-2, -1))
                - 2 * kernel[a[..., :, None], b[..., None, :]].mean(axis=(-2, -1)))
        np.testing.assert_allclose(shift_module._mmd2(kernel, nx, o), want, rtol=1e-12, atol=1e-14)
