"""The missed-cancer guarantee of a decision threshold: Learn-then-Test on the exact binomial tail of the integer
count of misses, and conformal risk control.

Oracles: a population whose cancers' probabilities follow a known law, so the true missed-cancer rate of any
threshold is its CDF (the LTT guarantee must hold in at least 1 - delta of the calibration draws, the CRC one
on average over them); scipy's binomial distribution; MAPIE's ``BinaryClassificationController`` where its
floating-point count of misses is exact (a power-of-two count of cancers).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from mapie.risk_control import BinaryClassificationController
from scipy import stats

from lungcal.calibration.guarantee import (
    CRC,
    MissedCancerGuarantee,
    cancers_needed,
    cancers_needed_table,
    ltt_pvalues,
    missed_cancer_threshold,
    misses_allowed,
)
from lungcal.errors import ConfigError, DataError

HOSPITAL = Path(__file__).resolve().parents[2] / "docs" / "hospital.md"

CANCER, OTHER = stats.beta(5, 2), stats.beta(2, 5)


def _draw(rng, n, prevalence=0.3):
    y = (rng.random(n) < prevalence).astype(int)
    return np.where(y == 1, CANCER.rvs(n, random_state=rng), OTHER.rvs(n, random_state=rng)), y


@pytest.mark.parametrize(("alpha", "delta"), [(0.1, 0.1), (0.05, 0.2)])
def test_the_guarantee_holds_in_at_least_1_minus_delta_of_200_calibration_draws(alpha, delta):
    rng = np.random.default_rng(7)
    true_rates, test_rates = [], []
    for _ in range(200):
        p, y = _draw(rng, 400)
        g = missed_cancer_threshold(p, y, alpha=alpha, delta=delta)
        true_rates.append(CANCER.cdf(g.threshold))  # the population's missed-cancer rate at this threshold
        pt, yt = _draw(rng, 2000)
        test_rates.append(float((pt[yt == 1] < g.threshold).mean()))
    held = np.mean(np.asarray(true_rates) <= alpha)
    assert held >= 1 - delta, held
    assert np.mean(np.asarray(test_rates) <= alpha) >= 1 - delta - 0.05  # a finite test split adds its own noise
    assert np.median(true_rates) < alpha  # not vacuous: the thresholds are near the oracle's, below it
    assert np.median(true_rates) > alpha / 4


def test_the_threshold_is_one_of_the_candidates_and_its_split_numbers_are_reported():
    p, y = _draw(np.random.default_rng(1), 300)
    g = missed_cancer_threshold(p, y, alpha=0.1, delta=0.1)
    assert g.threshold == 0 or g.threshold in set(p[y == 1])
    called = p >= g.threshold
    assert g.positive_rate == pytest.approx(called.mean()) and g.sensitivity == pytest.approx(called[y == 1].mean())
    assert g.n == 300 and g.n_cancers == int(y.sum())
    assert "at most 10% of cancers fall below it, with probability at least 90%" in g.statement()
    assert np.array_equal(g.decide(p), called) and g.as_dict()["statement"] == g.statement()
    # a stricter guarantee calls more CTs positive
    assert missed_cancer_threshold(p, y, alpha=0.05, delta=0.1).threshold <= g.threshold


def test_too_few_cancers_is_refused_naming_the_number_needed():
    assert cancers_needed(0.1, 0.1) == 22 and 0.9 ** 22 <= 0.1 < 0.9 ** 21
    p, y = _draw(np.random.default_rng(2), 100, prevalence=0.4)
    y[np.flatnonzero(y == 1)[21:]] = 0  # 21 cancers: one too few
    with pytest.raises(ConfigError, match="has 21 cancers.*needs at least 22") as info:
        missed_cancer_threshold(p, y, alpha=0.1, delta=0.1)
    assert info.value.field == "alpha"
    y[np.flatnonzero(y == 0)[:1]] = 1
    assert missed_cancer_threshold(p, y, alpha=0.1, delta=0.1).threshold >= 0


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(ConfigError, match="alpha must be in"):
        missed_cancer_threshold([0.5], [1], alpha=1.5)
    with pytest.raises(DataError, match="2 probabilities but 3 labels"):
        missed_cancer_threshold([0.5, 0.2], [1, 0, 1])
    with pytest.raises(DataError, match="lie in"):
        missed_cancer_threshold([1.5] * 30, [1] * 30)


def _cancers_and_others(rng, n_cancers, n_others=60):
    """``n_cancers`` cancers with distinct probabilities U(0.2, 1) (sorted), ``n_others`` others U(0, 0.6)."""
    c = np.sort(rng.uniform(0.2, 1.0, n_cancers))
    return np.r_[c, rng.uniform(0.0, 0.6, n_others)], np.r_[np.ones(n_cancers, int), np.zeros(n_others, int)], c


def test_forty_cancers_at_alpha_delta_point_one_certify_a_threshold_that_misses_exactly_one():
    p, y, c = _cancers_and_others(np.random.default_rng(40), 40)
    g = missed_cancer_threshold(p, y, alpha=0.1, delta=0.1)
    # P(Bin(40, 0.1) <= 1) = 0.0805 <= 0.1 < P(Bin(40, 0.1) <= 2): one miss is certified, two are not
    assert stats.binom.cdf(1, 40, 0.1) <= 0.1 < stats.binom.cdf(2, 40, 0.1)
    assert g.misses_allowed == 1 and g.fit_misses == 1
    assert g.threshold == c[1] and int((c < g.threshold).sum()) == 1  # the second-lowest cancer: one below it
    assert g.sensitivity == pytest.approx(39 / 40)
    # the p-values are scipy's binomial CDF at the integer counts
    assert ltt_pvalues(np.array([0, 1, 2]), 40, 0.1) == pytest.approx(stats.binom.cdf([0, 1, 2], 40, 0.1))
    with pytest.raises(TypeError, match="integer counts"):
        ltt_pvalues(np.array([1 - 39 / 40]) * 40, 40, 0.1)  # a float count (1.0000000000000009) is refused


def test_the_published_counts_of_cancers_needed_per_missed_cancer():
    assert [cancers_needed(0.1, 0.1, k) for k in range(4)] == [22, 38, 52, 65]
    for alpha in (0.01, 0.05, 0.1, 0.2):
        for delta in (0.05, 0.1, 0.2):
            for k in range(4):  # the smallest n whose binomial tail at k is at most delta (scipy, brute force)
                n = cancers_needed(alpha, delta, k)
                assert stats.binom.cdf(k, n, alpha) <= delta < stats.binom.cdf(k, n - 1, alpha)
                assert misses_allowed(n, alpha, delta) >= k > misses_allowed(n - 1, alpha, delta)
    assert misses_allowed(21, 0.1, 0.1) == -1 and misses_allowed(22, 0.1, 0.1) == 0
    # conformal risk control: (k + 1) / (n + 1) <= alpha
    assert [cancers_needed(0.1, misses=k, guarantee=CRC) for k in range(4)] == [9, 19, 29, 39]
    for alpha in (0.05, 0.1, 0.29):  # 0.29 * 100 is 28.999999999999996 in floats: the count is still 99
        for k in range(4):
            n = cancers_needed(alpha, misses=k, guarantee=CRC)
            assert n == int(np.ceil(round((k + 1) / alpha - 1, 9)))
            assert misses_allowed(n, alpha, guarantee=CRC) >= k > misses_allowed(n - 1, alpha, guarantee=CRC)


def _published_tables(text):
    return ["\n".join(m) for m in re.findall(r"((?:^\|.*\|\n)+)", text, flags=re.M) for m in [m.strip().splitlines()]]


def test_docs_hospital_publishes_the_tables_the_function_generates():
    tables = _published_tables(HOSPITAL.read_text())
    assert cancers_needed_table() in tables  # lungcal cancers-needed
    assert cancers_needed_table((0.01, 0.02, 0.2), (0.95, 0.9, 0.8), max_misses=0, crc=False) in tables
    assert "| 0.1 | `ltt`, `--confidence 0.9` | 22 | 38 | 52 | 65 |" in cancers_needed_table()


@pytest.mark.parametrize("n_cancers", [32, 64, 128])
@pytest.mark.parametrize(("alpha", "delta"), [(0.1, 0.1), (0.05, 0.2), (0.2, 0.05)])
def test_mapie_is_the_oracle_where_its_float_count_of_misses_is_exact(n_cancers, alpha, delta):
    """A power-of-two count of cancers: ``1 - (n - k) / n`` and ``n`` times it are exact in floats, so MAPIE's
    ``ceil(n * risk)`` is the integer count and its Learn-then-Test must give our threshold and p-values."""
    p, y, c = _cancers_and_others(np.random.default_rng(n_cancers), n_cancers, 2 * n_cancers)
    if misses_allowed(n_cancers, alpha, delta) < 0:
        pytest.skip("too few cancers for any threshold at these levels")
    g = missed_cancer_threshold(p, y, alpha=alpha, delta=delta)
    grid = np.unique(np.concatenate([[0.0], c]))
    ctl = BinaryClassificationController(
        predict_function=lambda q: np.column_stack([1.0 - np.asarray(q), np.asarray(q)]), risk="recall",
        target_level=1.0 - alpha, confidence_level=1.0 - delta, best_predict_param_choice="predicted_positive_fraction",
        list_predict_params=grid, fwer_method="fixed_sequence")
    ctl.calibrate(p, y)
    assert ctl.best_predict_param == g.threshold
    misses = np.searchsorted(c, grid, side="left")
    np.testing.assert_allclose(np.asarray(ctl.p_values).ravel(), ltt_pvalues(misses, n_cancers, alpha), rtol=1e-12)


def _order_statistic_draws(guarantee, n_cancers, alpha, delta, draws, seed):
    """True missed-cancer rates of the thresholds chosen on ``draws`` calibration splits of a population whose
    cancers score U(0, 1) (so a threshold's true rate is the threshold itself) and others U(0, 0.5)."""
    rng = np.random.default_rng(seed)
    y = np.r_[np.ones(n_cancers, int), np.zeros(30, int)]
    rates = np.empty(draws)
    for i in range(draws):
        p = np.r_[rng.random(n_cancers), rng.uniform(0, 0.5, 30)]
        rates[i] = missed_cancer_threshold(p, y, alpha=alpha, delta=delta, guarantee=guarantee).threshold
    return rates


def test_ltt_guarantee_over_draws_is_the_binomial_tail_not_a_conservative_bound():
    """40 cancers, alpha = delta = 0.1: the threshold is the second-lowest cancer, whose true rate exceeds alpha
    with probability P(Bin(40, 0.1) <= 1) = 0.0805 exactly: at most delta, and close to it (MAPIE's count of
    two misses certified only the lowest cancer: 0.9 ** 40 = 0.015)."""
    draws = 3000
    rates = _order_statistic_draws("ltt", 40, 0.1, 0.1, draws, seed=5)
    failed = float(np.mean(rates > 0.1))
    exact = stats.binom.cdf(1, 40, 0.1)
    se = np.sqrt(exact * (1 - exact) / draws)
    assert abs(failed - exact) < 4 * se, (failed, exact)
    assert failed <= 0.1 + 2 * se


def test_crc_controls_the_average_missed_cancer_rate_over_draws_and_only_that():
    """40 cancers, alpha 0.1: CRC allows k = floor(0.1 * 41) - 1 = 3 misses, so the threshold is the 4th-lowest
    cancer, whose expected true rate is 4 / 41 = 0.0976 <= alpha; the rate exceeds alpha in about 42 % of the
    draws (P(Bin(40, 0.1) <= 3)): on average, not with a stated probability."""
    draws = 3000
    rates = _order_statistic_draws(CRC, 40, 0.1, None, draws, seed=6)
    se = rates.std(ddof=1) / np.sqrt(draws)
    assert rates.mean() <= 0.1 + 3 * se
    assert abs(rates.mean() - 4 / 41) < 4 * se
    assert abs(np.mean(rates > 0.1) - stats.binom.cdf(3, 40, 0.1)) < 0.04


def test_crc_on_a_population_law_keeps_the_average_and_its_record_names_the_weaker_promise():
    rng = np.random.default_rng(8)
    rates = []
    for _ in range(300):
        p, y = _draw(rng, 120)
        g = missed_cancer_threshold(p, y, alpha=0.1, delta=None, guarantee=CRC)
        rates.append(CANCER.cdf(g.threshold))
    assert np.mean(rates) <= 0.1 + 3 * np.std(rates) / np.sqrt(len(rates))
    assert g.delta is None and g.guarantee == CRC and g.misses_allowed == int(np.floor(0.1 * (g.n_cancers + 1))) - 1
    assert "on average over draws" in g.statement() and "with probability" not in g.statement()
    d = g.as_dict()
    assert d["promise"].startswith("on average over draws") and "weaker" in d["promise"]
    assert MissedCancerGuarantee.from_dict(d) == g
    # CRC allows more misses than LTT from the same split, so a higher threshold
    assert missed_cancer_threshold(p, y, alpha=0.1, delta=0.1).threshold <= g.threshold


def test_crc_takes_no_delta_and_refuses_too_few_cancers():
    p, y, _ = _cancers_and_others(np.random.default_rng(3), 8)
    with pytest.raises(ConfigError, match="has 8 cancers.*on average.*needs at least 9") as info:
        missed_cancer_threshold(p, y, alpha=0.1, delta=None, guarantee=CRC)
    assert "delta" not in str(info.value.fix)
    with pytest.raises(ConfigError, match="states no confidence"):
        missed_cancer_threshold(p, y, alpha=0.1, delta=0.1, guarantee=CRC)
    with pytest.raises(ConfigError, match="unknown guarantee"):
        missed_cancer_threshold(p, y, alpha=0.1, guarantee="hb")


def test_a_guarantee_written_before_the_kinds_existed_reads_back_as_learn_then_test():
    old = {"threshold": 0.2, "alpha": 0.05, "delta": 0.1, "n": 300, "n_cancers": 60, "positive_rate": 0.4,
           "sensitivity": 0.97, "method": "Learn-then-Test (MAPIE BinaryClassificationController, recall, "
                                           "fixed-sequence testing)", "statement": "...", "fit_split": "val"}
    g = MissedCancerGuarantee.from_dict(old)
    assert g.guarantee == "ltt" and g.misses_allowed is None
    assert "with probability at least 90%" in g.statement()
