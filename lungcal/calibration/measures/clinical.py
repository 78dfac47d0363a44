"""Clinical calibration measures of a binary task's p(y=1): calibration slope and intercept, O:E ratio
(Van Calster et al. 2019)."""
from __future__ import annotations

import numpy as np

from lungcal.calibration._logistic import fit_logistic
from lungcal.calibration.measures.inputs import _as_probs_labels
from lungcal.errors import DataError

__all__ = ["calibration_slope_intercept", "oe_ratio", "LOGIT_EPS"]

#: p(y=1) is clipped to [eps, 1 - eps] before the logit of the calibration slope / intercept.
LOGIT_EPS = 1e-8


def _binary_positive(probs, labels, what: str) -> tuple[np.ndarray, np.ndarray]:
    """p(y=1) as float64 and labels of a binary task; DataError for C > 2."""
    p, y = _as_probs_labels(probs, labels)
    if p.shape[1] != 2:
        raise DataError(f"{what} needs a binary task, got {p.shape[1]} classes", field="probs",
                        fix="pass (N,) p(y=1) or (N, 2) probabilities of a binary task")
    return p[:, 1].astype(np.float64), y


def _clipped_logit(p1: np.ndarray, eps: float) -> np.ndarray:
    q = np.clip(p1, eps, 1.0 - eps)
    return np.log(q) - np.log1p(-q)


def calibration_slope_intercept(probs, labels, eps: float = LOGIT_EPS) -> tuple[float, float]:
    """Calibration slope and calibration intercept (calibration-in-the-large) of p(y=1).

    With ``x = logit(clip(p, eps, 1 - eps))``:

    * slope = b of the logistic fit ``logit P(y=1) = a + b x`` (1 when calibrated; < 1 means
      predictions too extreme, > 1 too modest);
    * intercept = a' of the fit ``logit P(y=1) = a' + x`` (x as an offset, slope fixed at 1);
      0 when calibrated in the large, < 0 when the model over-predicts the event rate.

    Both are maximum-likelihood fits by Newton's method in float64 (:mod:`._logistic`). Under
    separation (the x-ranges of events and non-events do not overlap) the slope has no finite
    MLE: the iterations are capped and the last iterate is returned.

    Args:
        probs: ``(N,)`` p(y=1) or ``(N, 2)`` probabilities (binary tasks only).
        labels: ``(N,)`` 0/1 labels.
        eps: clipping of p before the logit (p of exactly 0 or 1 would give an infinite logit).

    Returns:
        ``(slope, intercept)`` as Python floats; ``(nan, nan)`` when only one class occurs.

    References:
        Van Calster, McLernon, van Smeden, Wynants, Steyerberg. "Calibration: the Achilles heel
        of predictive analytics." BMC Medicine 17, 230 (2019).
        https://doi.org/10.1186/s12916-019-1466-7
        Cox. "Two further applications of a model for binary regression." Biometrika 45 (1958).
        https://doi.org/10.1093/biomet/45.3-4.562
    """
    p1, y = _binary_positive(probs, labels, "calibration_slope_intercept")
    if y.min() == y.max():
        return float("nan"), float("nan")
    x = _clipped_logit(p1, eps)
    _, slope, _ = fit_logistic(x, y)
    intercept, _, _ = fit_logistic(x, y, fit_slope=False)
    return slope, intercept


def oe_ratio(probs, labels) -> float:
    """Observed / expected events ``sum(y) / sum(p)`` of p(y=1) (binary tasks; 1 when calibrated
    in the large, > 1 when the model under-predicts). inf when ``sum(p) == 0 < sum(y)``, nan
    when both are 0.

    References:
        Van Calster et al. "Calibration: the Achilles heel of predictive analytics." BMC
        Medicine 17, 230 (2019). https://doi.org/10.1186/s12916-019-1466-7
    """
    p1, y = _binary_positive(probs, labels, "oe_ratio")
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.float64(y.sum()) / p1.sum())
