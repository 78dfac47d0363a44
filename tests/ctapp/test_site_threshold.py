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
from lungcal.ctapp.site.threshold import (
    WORKUP_WARNING,
    check_cancers,
    check_certify_split,
    check_levels,
    site_threshold,
)
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


def _hardly_separable(rng, n_cancers, n_others):
    """Cancers and others drawn from the same law: any certified threshold sends nearly everyone on."""
    p = rng.uniform(0.05, 0.95, n_cancers + n_others)
    return p, np.r_[np.ones(n_cancers, int), np.zeros(n_others, int)]


def test_a_threshold_that_sends_over_90_percent_on_to_work_up_is_warned_of_with_the_cancers_that_would_help():
    rng = np.random.default_rng(4)
    (pv, yv), (pt, yt) = _hardly_separable(rng, 30, 90), _hardly_separable(rng, 30, 90)
    t = site_threshold(pv, yv, pt, yt, 0.1, 0.1)
    g = t.guarantee
    assert g.misses_allowed == 0 and g.positive_rate > WORKUP_WARNING  # 30 cancers: only the lowest one's p
    w = t.workup_warning()
    assert w is not None and t.warnings() == [w] and t.as_dict()["warnings"] == [w]
    rates = f"{100 * g.positive_rate:.1f}% of the val CTs (test {100 * t.test_positive_rate:.1f}%)"
    assert f"sends {rates} on to work-up" in w
    assert "does not triage" in w and "30 cancers in val allow 0 missed cancer(s)" in w
    assert "38 allow 1, 52 allow 2, 65 allow 3" in w  # cancers_needed(0.1, 0.1, k), the published table
    assert "Label more cancers" in w and "--miss-rate" in w
    # CRC allows more misses from the same split (2 of 30), so fewer work-ups
    c = site_threshold(pv, yv, pt, yt, 0.1, None, guarantee="crc")
    assert c.guarantee.misses_allowed == 2 and c.guarantee.positive_rate < g.positive_rate
    # and names its own counts, and no confidence, when it too hardly triages
    pc, yc = np.r_[np.linspace(0.1, 0.9, 20), np.full(80, 0.95)], np.r_[np.ones(20, int), np.zeros(80, int)]
    wc = site_threshold(pc, yc, pc, yc, 0.1, None, guarantee="crc").workup_warning() or ""
    assert "sends 99.0% of the val CTs" in wc and "20 cancers in val allow 1 missed cancer(s)" in wc
    assert "29 allow 2, 39 allow 3, 49 allow 4" in wc and "--guarantee crc" in wc and "--confidence" not in wc
    # a threshold that triages is not warned of
    (zv, yv2), (zt, yt2) = _site(rng, 600), _site(rng, 300)
    cal = make_calibrator("platt").fit(zv, yv2)
    ok = site_threshold(calibrated_probs(cal, zv), yv2, calibrated_probs(cal, zt), yt2, 0.1, 0.1)
    assert ok.guarantee.positive_rate <= WORKUP_WARNING and ok.warnings() == [] and ok.as_dict()["warnings"] == []


def test_certified_on_test_nothing_is_left_to_check_it_and_the_record_says_so():
    rng = np.random.default_rng(9)
    zt, yt = _site(rng, 400)
    cal = make_calibrator("platt").fit(*_site(rng, 400))
    pt = calibrated_probs(cal, zt)
    t = site_threshold(pt, yt, None, None, 0.1, 0.1, fit_split="test", certify_note="val chose the checkpoint")
    assert t.guarantee == missed_cancer_threshold(pt[:, 1], yt, alpha=0.1, delta=0.1)
    assert not t.checked_on_test and t.test_n == 0
    m = t.metrics()
    assert set(m) == {"val/threshold_missrate", "test/positive_rate_at_threshold", "test/sensitivity_at_threshold"}
    assert m["test/positive_rate_at_threshold"] == t.guarantee.positive_rate
    d = t.as_dict()
    assert d["fit_split"] == "test" and d["test"] is None
    assert d["certify_split"] == {"name": "test", "checked": True, "note": "val chose the checkpoint"}
    # a certify split that could not be checked is warned of
    u = site_threshold(pt, yt, None, None, 0.1, 0.1, fit_split="test", certify_note="could not be checked",
                       certify_checked=False)
    assert "could not be checked" in u.warnings() and u.as_dict()["certify_split"]["checked"] is False


def test_crc_levels_take_no_confidence_and_the_certify_split_is_val_or_test():
    assert check_levels("0.1", None, "crc") == (0.1, None)
    with pytest.raises(ConfigError, match="states no confidence") as info:
        check_levels("0.1", "0.9", "crc")
    assert info.value.field == "--confidence"
    with pytest.raises(ConfigError, match="unknown guarantee"):
        check_levels("0.1", None, "hoeffding")
    assert check_certify_split("test") == "test"
    with pytest.raises(ConfigError, match="unknown --certify-split 'calib'"):
        check_certify_split("calib")
    rows = [{"label": i < 8} for i in range(40)]
    with pytest.raises(ConfigError, match="test split has 8 cancers: .* on average .* needs at least 9") as e:
        check_cancers(rows, 0.1, None, "site.json", "crc", "test")
    assert "lower --confidence" not in str(e.value)
    assert check_cancers([*rows, {"label": 1}], 0.1, None, "site.json", "crc", "test") == 9
