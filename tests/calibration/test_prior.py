"""Prior (prevalence) adaptation against closed forms: Bayes' rule on Gaussian classes, the EM
fixed-point equation and the maximum-likelihood prevalence (scipy)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from scipy.special import expit

from lungcal.calibration.metrics import auroc
from lungcal.calibration.prior import adjust_to_prior, estimate_prior_em
from lungcal.errors import ConfigError, DataError

MU = 1.0  # x | y=1 ~ N(+MU, 1), x | y=0 ~ N(-MU, 1): log-likelihood ratio 2 MU x


def _posterior(x, prior):
    """The exact (calibrated) P(y=1 | x) when the prevalence is ``prior``."""
    return expit(np.log(prior / (1 - prior)) + 2 * MU * x)


def _site(n, prevalence, seed):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < prevalence).astype(int)
    x = rng.normal(size=n) + np.where(y == 1, MU, -MU)
    return x, y


def test_adjust_to_prior_equals_bayes_rule():
    x = np.linspace(-4, 4, 101)
    p_source = _posterior(x, 0.4)  # a model calibrated where the prevalence was 0.4
    np.testing.assert_allclose(adjust_to_prior(p_source, 0.4, 0.11), _posterior(x, 0.11), rtol=1e-12, atol=1e-15)
    # the odds are multiplied by (pi1 / pi0) / (s1 / s0)
    q = adjust_to_prior(np.array([0.5, 0.2]), 0.4, 0.11)
    odds = np.array([1.0, 0.25]) * (0.11 / 0.89) / (0.4 / 0.6)
    np.testing.assert_allclose(q, odds / (1 + odds), rtol=1e-14)
    # identity when the target is the source; 0 and 1 stay put
    p = np.array([0.0, 1e-9, 0.3, 0.999, 1.0])
    np.testing.assert_allclose(adjust_to_prior(p, 0.25, 0.25), p, rtol=1e-15, atol=0)
    assert adjust_to_prior(p, 0.25, 0.9)[[0, -1]].tolist() == [0.0, 1.0]


def test_adjust_to_prior_shapes_types_and_ranks():
    x, y = _site(500, 0.3, seed=0)
    p = _posterior(x, 0.5)
    p2 = np.stack([1 - p, p], 1)
    q2 = adjust_to_prior(p2, 0.5, 0.3)
    assert q2.shape == (500, 2) and np.allclose(q2.sum(1), 1)
    np.testing.assert_allclose(q2[:, 1], adjust_to_prior(p, 0.5, 0.3), rtol=1e-15)
    qt = adjust_to_prior(torch.from_numpy(p2).float(), 0.5, 0.3)
    assert isinstance(qt, torch.Tensor) and qt.dtype == torch.float32 and qt.shape == (500, 2)
    assert auroc(adjust_to_prior(p, 0.5, 0.3), y) == auroc(p, y)  # monotone: AUC unchanged


@pytest.mark.parametrize("bad", [0.0, 1.0, 1.5, -0.1, float("nan"), "eleven", None, 11])
def test_priors_outside_the_open_unit_interval_are_refused(bad):
    with pytest.raises(ConfigError, match="target_prior.*strictly between 0 and 1.*Fix"):
        adjust_to_prior(np.array([0.2, 0.7]), 0.4, bad)
    with pytest.raises(ConfigError, match="source_prior"):
        estimate_prior_em(np.array([0.2, 0.7]), bad)


def test_bad_probabilities_are_refused():
    with pytest.raises(DataError, match=r"\[0, 1\]"):
        adjust_to_prior(np.array([0.2, 1.7]), 0.4, 0.1)
    with pytest.raises(DataError, match="sum to 1"):
        adjust_to_prior(np.array([[0.2, 0.2]]), 0.4, 0.1)
    with pytest.raises(DataError, match=r"\(N, 2\)"):
        estimate_prior_em(np.full((3, 3), 1 / 3), 0.4)


@pytest.mark.parametrize("target", [0.11, 0.4, 0.7])
def test_em_recovers_a_known_prior_and_its_fixed_point_is_the_mle(target):
    x, _ = _site(20_000, target, seed=1)
    p = _posterior(x, 0.4)  # calibrated at the source (prevalence 0.4), applied at the site
    est = estimate_prior_em(p, 0.4)
    assert est == pytest.approx(target, abs=0.01)
    # the EM equation: pi = mean(adjust_to_prior(p, s, pi))
    assert float(adjust_to_prior(p, 0.4, est).mean()) == pytest.approx(est, abs=1e-9)
    # and the maximum-likelihood prevalence: argmax sum log(pi p/s1 + (1 - pi)(1 - p)/s0)
    res = minimize_scalar(lambda t: -np.log(t * p / 0.4 + (1 - t) * (1 - p) / 0.6).sum(),
                          bounds=(1e-6, 1 - 1e-6), method="bounded", options={"xatol": 1e-12})
    assert est == pytest.approx(res.x, abs=1e-6)
    # (N, 2) input gives the same estimate
    assert estimate_prior_em(np.stack([1 - p, p], 1), 0.4) == est


def test_em_with_too_few_iterations_warns():
    x, _ = _site(2000, 0.11, seed=2)
    with pytest.warns(RuntimeWarning, match="did not converge"):
        est = estimate_prior_em(_posterior(x, 0.4), 0.4, max_iter=2)
    assert 0.11 < est < 0.4  # on its way from the source prior
