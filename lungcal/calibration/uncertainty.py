"""Predictive uncertainty of a set of stochastic predictions: MC-dropout samples or ensemble members.

Given ``M`` probability vectors per case (``(M, N, C)``; for a binary task ``(M, N)`` p(y=1)),
the prediction is their mean ``p̄ = mean_m p_m`` and its uncertainty splits (Depeweg et al. 2018;
Smith & Gal 2018) into

* ``entropy``    ``H[p̄] = -sum_c p̄_c log p̄_c``: the total predictive uncertainty;
* ``aleatoric``  ``mean_m H[p_m]``: what each sample is unsure of on its own (noise in the data);
* ``mi``         ``H[p̄] - mean_m H[p_m]``: the mutual information between the prediction and the
  model parameters (BALD; Houlsby et al. 2011), i.e. the *epistemic* part, where the samples disagree.

All in nats (natural log). ``mi >= 0`` by Jensen's inequality; 0 when every sample agrees (values
below 1e-12 nats, rounding noise, are snapped to 0, as :func:`lungcal.calibration.selective.mutual_information`
does). With one sample (or a deterministic model) ``mi = 0`` and ``entropy = aleatoric``.

:func:`log_probs` turns averaged probabilities back into logits (``softmax(log p̄) = p̄``), so a
temperature can be fitted on an ensemble's or MC-dropout mean ("pool, then calibrate"; Rahaman &
Thiery 2021 find it better calibrated than averaging calibrated members).

References:
    Houlsby, Huszar, Ghahramani, Lengyel. "Bayesian Active Learning for Classification and Preference
    Learning." 2011. https://arxiv.org/abs/1112.5745
    Depeweg, Hernandez-Lobato, Doshi-Velez, Udluft. "Decomposition of Uncertainty in Bayesian Deep
    Learning for Efficient and Risk-sensitive Learning." ICML 2018. https://arxiv.org/abs/1710.07283
    Smith, Gal. "Understanding Measures of Uncertainty for Adversarial Example Detection." UAI 2018.
    https://arxiv.org/abs/1803.08533
    Rahaman, Thiery. "Uncertainty Quantification and Deep Ensembles." NeurIPS 2021.
    https://arxiv.org/abs/2007.08792
"""
from __future__ import annotations

import numpy as np

from .measures.inputs import _to_numpy
from .selective import _MI_ZERO, _entropy, _member_array, predictive_entropy

__all__ = ["decompose_uncertainty", "log_probs", "predictive_entropy"]


def decompose_uncertainty(member_probs) -> dict[str, np.ndarray]:
    """Mean prediction and its uncertainty of ``M`` stochastic predictions.

    Args:
        member_probs: ``(M, N, C)`` probabilities of M MC-dropout samples or ensemble members
            (numpy or torch), or ``(M, N)`` p(y=1) of a binary task.

    Returns:
        ``{"probs" (N, C) mean probabilities, "entropy" (N,) H[mean], "aleatoric" (N,) mean H,
        "mi" (N,) entropy - aleatoric (>= 0)}``, float64, nats.
    """
    m = _member_array(member_probs)
    mean = m.mean(axis=0)
    entropy = _entropy(mean)
    aleatoric = _entropy(m).mean(axis=0)
    mi = entropy - aleatoric
    return {"probs": mean, "entropy": entropy, "aleatoric": aleatoric, "mi": np.where(mi < _MI_ZERO, 0.0, mi)}


def log_probs(probs, floor: float = 1e-12) -> np.ndarray:
    """``log(max(p, floor))`` of ``(N, C)`` probabilities: logits whose softmax gives ``p`` back
    (exactly up to the floor), for fitting a temperature on averaged probabilities."""
    p = _to_numpy(probs).astype(np.float64)
    return np.log(np.maximum(p, float(floor)))
