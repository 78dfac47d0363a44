"""CBPE: the expected sensitivity at a threshold from calibrated probabilities, its interval, its validity."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lungcal.calibration.performance_estimation import cbpe_sensitivity, estimate_validity
from lungcal.errors import DataError


def test_the_expected_sensitivity_by_hand():
    p = np.array([0.9, 0.6, 0.2, 0.1, 0.05])
    est = cbpe_sensitivity(p, 0.5, n_draws=0)
    assert est.sensitivity == pytest.approx(1.5 / 1.85) and est.expected_cancers == pytest.approx(1.85)
    assert est.work_up_rate == pytest.approx(0.4) and est.n == 5 and math.isnan(est.interval[0])
    none = cbpe_sensitivity(np.zeros(4), 0.5)  # no expected cancer: undefined
    assert math.isnan(none.sensitivity) and math.isnan(none.interval[0]) and none.work_up_rate == 0.0
    with pytest.raises(DataError, match=r"\[0, 1\]"):
        cbpe_sensitivity([0.2, 1.3], 0.5)
    with pytest.raises(DataError, match="threshold"):
        cbpe_sensitivity([0.2, 0.3], 1.5)


def test_with_calibrated_probabilities_the_interval_covers_the_realised_sensitivity():
    """Labels drawn from the probabilities themselves (the calibrated world): the estimate is unbiased for the
    realised sensitivity and its 95 % interval covers it about 95 % of the time (200 sites of 300 CTs)."""
    rng = np.random.default_rng(1)
    covered, errors = 0, []
    for site in range(200):
        p = rng.beta(0.6, 3.0, size=300)
        y = rng.random(300) < p
        est = cbpe_sensitivity(p, 0.15, n_draws=500, seed=site)
        true = float((y & (p >= 0.15)).sum() / y.sum())
        covered += est.interval[0] <= true <= est.interval[1]
        errors.append(est.sensitivity - true)
    assert 0.90 <= covered / 200 <= 0.99
    assert abs(np.mean(errors)) < 0.01


def test_an_over_confident_model_makes_the_estimate_wrong_which_is_why_validity_is_stated():
    rng = np.random.default_rng(2)
    p_true = rng.beta(0.6, 3.0, size=3000)
    y = rng.random(3000) < p_true
    logit = np.log(p_true / (1 - p_true))
    p_over = 1 / (1 + np.exp(-3.0 * logit))  # the same ranking, over-confident
    true = float((y & (p_over >= 0.2)).sum() / y.sum())
    est = cbpe_sensitivity(p_over, 0.2, n_draws=500)
    assert not est.interval[0] <= true <= est.interval[1]
    assert estimate_validity("comparable")[0] and not estimate_validity("scanner_shift")[0]
    assert estimate_validity("prevalence_shift", prior_adjusted=True)[0]
    assert not estimate_validity("prevalence_shift")[0] and not estimate_validity(None)[0]
