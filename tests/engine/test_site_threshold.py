"""The site's guaranteed decision threshold (``lungcal recalibrate --miss-rate``): the calibrator and the threshold
are both fitted on the site's val split, and the guarantee still holds.

Oracle: a site population whose network scores are known (cancers N(1.2, 1.3), others N(-0.8, 1.3), the
logit scaled by 3 so the network is overconfident); the true missed-cancer rate of a threshold is its rate
on 200 000 of the population's cancers. Over 200 random val (calibration) / test splits the rate must be at
most alpha in at least 1 - delta of them; scipy's exact binomial interval is the oracle of the test CI.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binomtest

from lungcal.calibration.guarantee import missed_cancer_threshold
from lungcal.calibration.scaling import calibrated_probs, make_calibrator
from lungcal.engine.site.threshold import check_cancers, check_levels, site_threshold
from lungcal.errors import ConfigError

SCALE = 3.0


def _logits(z):
    return np.stack([np.zeros(z.size), z], 1)


def _site(rng, n, prevalence=0.3):
    y = (rng.random(n) < prevalence).astype(int)
    return _logits(SCALE * rng.normal(np.where(y == 1, 1.2, -0.8), 1.3)), y


def _missed_rate(cal, cancers, threshold):
    """The share of ``cancers`` (sorted scores) whose calibrated p is below ``threshold``: the calibrators are
    non-decreasing in the score, so it is the index of the first cancer at or above it (found on 1001 quantiles,
    then exactly within the bracket)."""
    n = cancers.size
    idx = np.linspace(0, n - 1, 1001).astype(int)
    above = calibrated_probs(cal, _logits(cancers[idx]))[:, 1] >= threshold
    if not above.any():
        return 1.0
    k = int(above.argmax())
    lo, hi = (idx[k - 1] if k else 0), idx[k]
    seg = calibrated_probs(cal, _logits(cancers[lo:hi + 1]))[:, 1] >= threshold
    return (lo + int(seg.argmax())) / n


@pytest.mark.parametrize(("method", "alpha", "delta"), [("platt", 0.1, 0.1), ("isotonic", 0.05, 0.2)])
def test_calibrator_and_threshold_fitted_on_the_same_val_split_keep_the_guarantee_over_200_splits(method, alpha,
                                                                                                    delta):
    rng = np.random.default_rng(11)
    cancers = np.sort(SCALE * rng.normal(1.2, 1.3, 200_000))  # the site's cancers
    true_rates, test_rates = [], []
    for _ in range(200):
        (zv, yv), (zt, yt) = _site(rng, 400), _site(rng, 400)
        cal = make_calibrator(method).fit(zv, yv)
        t = site_threshold(calibrated_probs(cal, zv), yv, calibrated_probs(cal, zt), yt, alpha, delta)
        true_rates.append(_missed_rate(cal, cancers, t.guarantee.threshold))
        test_rates.append(1 - t.test_sensitivity)
    held = float(np.mean(np.asarray(true_rates) <= alpha))
    assert held >= 1 - delta, held
    assert alpha / 5 < float(np.median(true_rates)) < alpha  # not vacuous: close below alpha
    assert float(np.mean(np.asarray(test_rates) <= alpha)) >= 1 - delta - 0.1  # a 120-cancer test split is noisy


def test_test_numbers_are_the_direct_computation_and_val_alone_chooses_the_threshold():
    rng = np.random.default_rng(3)
    (zv, yv), (zt, yt), (zt2, yt2) = _site(rng, 500), _site(rng, 300), _site(rng, 300)
    cal = make_calibrator("platt").fit(zv, yv)
    pv, pt = calibrated_probs(cal, zv), calibrated_probs(cal, zt)
    t = site_threshold(pv, yv, pt, yt, 0.05, 0.1)
    oracle = missed_cancer_threshold(pv[:, 1], yv, alpha=0.05, delta=0.1)
    assert t.guarantee == oracle
    called = pt[:, 1] >= oracle.threshold
    k, n = int(called[yt == 1].sum()), int((yt == 1).sum())
    assert t.test_sensitivity == pytest.approx(k / n) and t.test_positive_rate == pytest.approx(called.mean())
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert t.test_sensitivity_ci == pytest.approx((ci.low, ci.high))
    assert t.test_n == 300 and t.test_cancers == n
    # another test split changes the test numbers, never the threshold
    other = site_threshold(pv, yv, calibrated_probs(cal, zt2), yt2, 0.05, 0.1)
    assert other.guarantee == t.guarantee and other.test_cancers != t.test_cancers
    m = t.metrics()
    assert m["val/threshold_missrate"] == oracle.threshold
    assert m["val/positive_rate_at_threshold"] == oracle.positive_rate
    assert m["val/sensitivity_at_threshold"] == oracle.sensitivity
    assert m["test/sensitivity_at_threshold"] == t.test_sensitivity
    assert m["test/positive_rate_at_threshold"] == t.test_positive_rate
    assert (m["test/sensitivity_at_threshold_ci_low"], m["test/sensitivity_at_threshold_ci_high"]) == \
        t.test_sensitivity_ci
    d = t.as_dict()
    assert d["statement"] == oracle.statement() and d["fit_split"] == "val" and d["test"]["n_cancers"] == n
    assert type(oracle).from_dict(d) == oracle  # what predict --site reads back


def test_levels_and_the_cancer_count_are_checked_with_the_cli_flags():
    assert check_levels("0.05", None) == (0.05, pytest.approx(0.1))
    assert check_levels(0.1, "0.8") == (0.1, pytest.approx(0.2))
    for bad, flag in ((("5%", None), "--miss-rate"), ((0, None), "--miss-rate"), ((0.05, 1), "--confidence")):
        with pytest.raises(ConfigError, match="strictly between 0 and 1") as info:
            check_levels(*bad)
        assert info.value.field == flag
    rows = [{"label": i < 44} for i in range(100)]
    with pytest.raises(ConfigError, match="has 44 cancers: .* at most 5% with confidence 90% needs at least 45") as e:
        check_cancers(rows, 0.05, 0.1, "site.json")
    assert "\n" not in str(e.value) and "--miss-rate" in str(e.value) and "--confidence" in str(e.value)
    assert check_cancers([*rows, {"label": 1}], 0.05, 0.1, "site.json") == 45
