"""lungcal.calibration.posthoc: TS, the ECE-best temperature, logit adjustment and vector scaling on a
long-tailed model whose true miscalibration is known."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.calibration.metrics import ece
from lungcal.calibration.posthoc import (
    POSTHOC_METHODS,
    adjust_logits_to_prior,
    ece_optimal_temperature,
    posthoc_probs,
)
from lungcal.calibration.scaling import probabilities
from lungcal.errors import DataError

COUNTS = np.array([4500, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50], np.float64)


def shown(rng, n_per_class: int, scale: float, prior_bias):
    """Cases whose calibrated logits are ``s`` (labels drawn from softmax(s)); the model shows
    ``s / scale + prior_bias``."""
    y = np.repeat(np.arange(10), n_per_class)
    s = rng.normal(0.0, 1.0, (len(y), 10))
    s[np.arange(len(y)), y] += 2.0
    s *= 1.5
    p = probabilities(s)
    y = (p.cumsum(1) > rng.random((len(y), 1))).argmax(1)
    return s / scale + prior_bias, y


def test_the_ece_best_temperature_of_a_purely_scaled_model():
    z, y = shown(np.random.default_rng(0), 600, scale=2.0, prior_bias=0.0)  # under-confident by 2, no prior error
    t = ece_optimal_temperature(z, y)
    assert 0.4 < t < 0.62  # the true temperature is 0.5
    assert ece(probabilities(z, t), y) < ece(probabilities(z), y) / 3
    assert ece_optimal_temperature(z, y, grid=[0.5, 1.0, 2.0]) == 0.5


def test_the_prior_error_is_what_one_temperature_cannot_fix():
    """Calibrated scores shown under-confident (/2) and biased toward the head (+ log prior): TS alone
    stays near the compromise, the prior adjustment then TS recovers T = 0.5, vector scaling fits both."""
    rng = np.random.default_rng(1)
    bias = np.log(COUNTS / COUNTS.sum())
    zv, yv = shown(rng, 500, 2.0, bias)
    zt, yt = shown(rng, 800, 2.0, bias)
    fits = posthoc_probs(zv, yv, zt, COUNTS)
    assert tuple(fits) == POSTHOC_METHODS
    np.testing.assert_allclose(fits["prior"][0], probabilities(zt - bias), atol=1e-12)  # nothing fitted
    np.testing.assert_allclose(adjust_logits_to_prior(zt, COUNTS), zt - bias)
    assert fits["prior+ts"][1]["T"] == pytest.approx(0.5, abs=0.05)
    e = {k: ece(p, yt) for k, (p, _) in fits.items()}
    acc = {k: float((p.argmax(1) == yt).mean()) for k, (p, _) in fits.items()}
    assert acc["ts"] == acc["ts-ece"] == acc["none"]  # a temperature never changes the argmax
    assert acc["prior"] > acc["none"] + 0.05 and acc["prior+ts"] == acc["prior"]
    assert e["prior+ts"] < 0.03 and e["vector"] < 0.03
    assert e["prior+ts"] < e["ts"] / 2 and e["ts-ece"] <= e["ts"] + 1e-9
    with pytest.raises(DataError, match="one positive count per class"):
        posthoc_probs(zv, yv, zt, COUNTS[:9])
