"""The missed-cancer guarantee of a decision threshold (Learn-then-Test through MAPIE).

Oracle: a population whose cancers' probabilities follow a known Beta law, so the true missed-cancer rate
of any threshold is the Beta CDF; the guarantee must hold in at least 1 - delta of 200 calibration draws.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from lungcal.calibration.guarantee import cancers_needed, missed_cancer_threshold
from lungcal.errors import ConfigError, DataError

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
