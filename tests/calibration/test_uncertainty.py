"""Entropy / mutual-information decomposition against closed forms and scipy.stats.entropy."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from lungcal.calibration import decompose_uncertainty, log_probs
from lungcal.calibration.selective import mutual_information, predictive_entropy
from lungcal.errors import DataError


def _random_members(m=7, n=50, c=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(c) * 0.7, size=(m, n))


def test_decomposition_matches_scipy_entropy():
    s = _random_members()
    out = decompose_uncertainty(s)
    mean = s.mean(axis=0)
    assert np.allclose(out["probs"], mean)
    assert np.allclose(out["entropy"], scipy_entropy(mean, axis=1), atol=1e-12)
    assert np.allclose(out["aleatoric"], scipy_entropy(s, axis=2).mean(axis=0), atol=1e-12)
    assert np.allclose(out["mi"], scipy_entropy(mean, axis=1) - scipy_entropy(s, axis=2).mean(axis=0), atol=1e-12)
    assert np.all(out["mi"] >= 0) and np.all(out["mi"] <= out["entropy"] + 1e-12)
    # the same as the referral module's functions (one definition of each quantity)
    assert np.allclose(out["mi"], mutual_information(s))
    assert np.allclose(out["entropy"], predictive_entropy(mean))


def test_closed_forms_binary():
    # two confident members that disagree completely: no aleatoric part, MI = H[0.5] = log 2
    out = decompose_uncertainty(np.array([[1.0], [0.0]]))  # (M=2, N=1) p(y=1)
    assert out["mi"][0] == pytest.approx(np.log(2), abs=1e-15)
    assert out["aleatoric"][0] == 0.0 and out["entropy"][0] == pytest.approx(np.log(2))
    # members that agree on 0.5: all aleatoric, no epistemic part
    out = decompose_uncertainty(np.array([[0.5], [0.5], [0.5]]))
    assert out["mi"][0] == 0.0 and out["aleatoric"][0] == pytest.approx(np.log(2))

    def h(p):
        return -(p * np.log(p) + (1 - p) * np.log(1 - p))

    a, b = 0.9, 0.3  # binary MI of two members: h((a + b) / 2) - (h(a) + h(b)) / 2
    out = decompose_uncertainty(np.array([[a], [b]]))
    assert out["mi"][0] == pytest.approx(h((a + b) / 2) - (h(a) + h(b)) / 2, abs=1e-14)
    assert out["entropy"][0] == pytest.approx(h(0.6), abs=1e-14)


def test_one_member_has_no_epistemic_part_and_accepts_torch():
    p = torch.softmax(torch.randn(1, 20, 2, dtype=torch.float64), dim=2)
    out = decompose_uncertainty(p)
    assert np.all(out["mi"] == 0.0)
    assert np.allclose(out["entropy"], out["aleatoric"])


def test_bad_member_probs_are_one_line_errors():
    with pytest.raises(DataError, match="member_probs"):
        decompose_uncertainty(np.ones(5))
    with pytest.raises(DataError, match="probabilities"):
        decompose_uncertainty(np.full((2, 3, 2), 1.5))


def test_log_probs_are_logits_of_the_probabilities():
    p = _random_members(m=1)[0]
    z = log_probs(p)
    assert np.allclose(torch.softmax(torch.from_numpy(z), dim=1).numpy(), p, atol=1e-12)
    assert np.isfinite(log_probs(np.array([[0.0, 1.0]]))).all()
