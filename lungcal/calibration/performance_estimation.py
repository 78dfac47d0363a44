"""Performance without labels: confidence-based performance estimation (CBPE) at a decision threshold.

Labels (biopsy, follow-up) reach a hospital months after its CTs. While they are missing, a *calibrated*
probability can stand in for each CT's label: if ``p_i`` is the probability that CT ``i`` is a cancer, the
expected number of cancers at or above a threshold ``t`` is ``sum_i p_i 1[p_i >= t]`` and of all cancers
``sum_i p_i``, so the expected sensitivity at ``t`` is their ratio (NannyML's CBPE, written here on numpy; Kivimäki
et al. 2024). The work-up rate needs no label at all.

The interval is the spread of the sensitivity the labels would give if they were drawn from the probabilities
(each ``y_i ~ Bernoulli(p_i)``, a Poisson-binomial world; percentile interval over ``n_draws`` draws): the
uncertainty that remains even when the calibration is right. It says nothing of a wrong calibration, which is
why the estimate is valid only where the calibration can be trusted (:func:`estimate_validity`): a chunk whose
site check is ``comparable``, or ``prevalence_shift`` once the probabilities were prior-adjusted to it. Under a
``scanner_shift`` the probabilities are not calibrated to the CTs any more, and neither is the estimate.

References:
    NannyML, "Confidence-based performance estimation" (CBPE), https://nannyml.readthedocs.io
    Kivimäki, Białek, Nurminen, Kuberski. "Confidence-based estimators for predictive performance in model
    monitoring." arXiv:2407.08649 (2024).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from lungcal.errors import DataError

__all__ = ["SensitivityEstimate", "cbpe_sensitivity", "expected_oe_interval", "estimate_validity"]


@dataclass(frozen=True)
class SensitivityEstimate:
    """CBPE at one threshold: the expected sensitivity with its interval, the work-up rate, the expected
    number of cancers, and the number of CTs."""

    sensitivity: float
    interval: tuple[float, float]
    work_up_rate: float
    expected_cancers: float
    n: int

    def as_dict(self) -> dict[str, float | int | list[float]]:
        return {"sensitivity": self.sensitivity, "interval": list(self.interval), "work_up_rate": self.work_up_rate,
                "expected_cancers": self.expected_cancers, "n": self.n}


def cbpe_sensitivity(p1: ArrayLike, threshold: float, *, n_draws: int = 2000, level: float = 0.95,
                     seed: int = 0) -> SensitivityEstimate:
    """The expected sensitivity at ``threshold`` of calibrated p(cancer) ``p1`` (module doc), with the interval
    of the sensitivity labels drawn from ``p1`` would give.

    Raises:
        DataError: ``p1`` empty or outside [0, 1], or ``threshold`` outside [0, 1].
    """
    p = np.asarray(p1, np.float64).reshape(-1)
    if p.size == 0 or not np.all((p >= 0) & (p <= 1)) or not np.all(np.isfinite(p)):
        raise DataError("CBPE needs calibrated probabilities in [0, 1]", field="probs",
                        fix="pass p(cancer) of each CT after the site's calibrator")
    if not 0.0 <= threshold <= 1.0:
        raise DataError(f"threshold {threshold} outside [0, 1]", field="threshold", fix="pass a probability")
    called = p >= threshold
    expected = float(p.sum())
    sens = float(p[called].sum() / expected) if expected > 0 else math.nan
    lo = hi = math.nan
    if n_draws > 0 and expected > 0:
        rng = np.random.default_rng(seed)
        y = rng.random((n_draws, p.size)) < p[None, :]
        cancers = y.sum(axis=1)
        found = (y & called[None, :]).sum(axis=1)
        ok = cancers > 0
        if ok.any():
            draws = found[ok] / cancers[ok]
            a = (1 - level) / 2
            lo, hi = float(np.quantile(draws, a)), float(np.quantile(draws, 1 - a))
    return SensitivityEstimate(sens, (lo, hi), float(called.mean()), expected, int(p.size))


def expected_oe_interval(p1: ArrayLike, *, n_draws: int = 2000, level: float = 0.95,
                         seed: int = 0) -> tuple[float, float]:
    """The interval of the O/E ratio (observed cancers over ``sum(p1)``) that labels drawn from calibrated ``p1``
    would give (each ``y_i ~ Bernoulli(p_i)``; percentile interval over ``n_draws`` draws).

    CBPE's own O/E is 1 by construction (the probabilities stand in for the labels); this is the band around it
    that an observed O/E of the same CTs falls in while the calibration holds, so an observed O/E outside it, once
    the labels arrive, says the calibration did not hold. NaN when ``sum(p1)`` is 0.

    Raises:
        DataError: ``p1`` empty or outside [0, 1].
    """
    p = np.asarray(p1, np.float64).reshape(-1)
    if p.size == 0 or not np.all((p >= 0) & (p <= 1)) or not np.all(np.isfinite(p)):
        raise DataError("CBPE needs calibrated probabilities in [0, 1]", field="probs",
                        fix="pass p(cancer) of each CT after the site's calibrator")
    expected = float(p.sum())
    if expected <= 0 or n_draws <= 0:
        return math.nan, math.nan
    cancers = (np.random.default_rng(seed).random((n_draws, p.size)) < p[None, :]).sum(axis=1) / expected
    a = (1 - level) / 2
    return float(np.quantile(cancers, a)), float(np.quantile(cancers, 1 - a))


def estimate_validity(verdict: str | None, prior_adjusted: bool = False) -> tuple[bool, str]:
    """Whether a CBPE estimate can be trusted for CTs whose site check gave ``verdict`` (module doc), and why."""
    if verdict == "comparable":
        return True, "the CTs are comparable with the calibration CTs: the probabilities stay calibrated"
    if verdict == "prevalence_shift":
        if prior_adjusted:
            return True, "only the prevalence changed, and the probabilities were adjusted to it"
        return False, "the prevalence changed and the probabilities were not adjusted to it: adjust them first"
    if verdict == "scanner_shift":
        return False, "the images changed: the probabilities are not calibrated to these CTs, nor is the estimate"
    return False, "not checked: too few CTs or no reference to compare with, so nothing says the calibration holds"
