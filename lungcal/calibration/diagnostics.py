"""Fit diagnostics of a calibrator: when a fit is "no signal" rather than a result."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from scipy.stats import mannwhitneyu

from lungcal.calibration.calibrators.base import Calibrator, _check_labels, _check_logits, _softmax_np
from lungcal.calibration.calibrators.platt import PlattScaler
from lungcal.calibration.calibrators.temperature import TemperatureScaler

__all__ = ["fit_warnings", "no_signal", "FEW_EVENTS", "CHANCE_P"]

#: Fewer cases than this in the rarer class of the fit split: :func:`fit_warnings` says CIs are wide.
FEW_EVENTS = 100
#: Mann-Whitney p-value at or above which the fit split's AUC is "~ chance" in :func:`fit_warnings`.
CHANCE_P = 0.05


def fit_warnings(calibrator: Calibrator, logits, labels) -> list[str]:
    """Why a fitted calibrator is "no signal" rather than a result, as short sentences.

    Checks the calibrator's ``fit_info`` (a parameter on its bound, e.g. ``"temperature at its
    bound 100: no signal"``, or at 0.01: separated classes; a fit that did not converge; a Platt
    slope <= 0) and the fit split
    itself: its AUC is "~ chance" when the two-sided Mann-Whitney p-value of the logits is
    >= :data:`CHANCE_P`, and its CIs are wide when the rarer class has fewer than
    :data:`FEW_EVENTS` cases. An empty list means nothing to flag.

    Args:
        calibrator: a fitted calibrator. logits, labels: the split it was fitted on.
    """
    calibrator._require_fit()
    z, _, _ = _check_logits(logits, strict=False)
    y = _check_labels(labels, z.shape[0], z.shape[1], fitting=True)
    out = []
    info = calibrator.fit_info
    if isinstance(calibrator, TemperatureScaler) and info.get("at_bound"):
        t = calibrator.temperature
        why = "no signal" if t > 1 else "the classes are (nearly) separated on the fit split: not a result"
        out.append(f"temperature at its bound {t:.3g}: {why}")
    elif info.get("at_bound"):
        out.append(f"{calibrator.name}: a parameter is at its bound: no signal")
    if not info.get("converged", True):
        why = " (the classes are separated on the fit split)" if info.get("separated") else ""
        out.append(f"{calibrator.name}: the fit did not converge{why}: not a result")
    if isinstance(calibrator, PlattScaler) and calibrator.slope <= 0:
        out.append(f"Platt slope {calibrator.slope:.3g} <= 0: no signal")
    auc, p = _signal_test(z, y)
    if not p < CHANCE_P:
        out.append(f"validation AUC {auc:.2f} ~ chance (Mann-Whitney p = {p:.2g})")
    counts = np.bincount(y.numpy(), minlength=z.shape[1])
    rare = int(counts[counts > 0].min())
    if rare < FEW_EVENTS:
        out.append(f"only {rare} cases of the rarer class (< {FEW_EVENTS}) in the fit split: CIs are wide")
    return out


def no_signal(warnings: Sequence[str]) -> list[str]:
    """The warnings of :func:`fit_warnings` that make a fit "no signal" (all but the few-events one)."""
    return [w for w in warnings if "CIs are wide" not in w]


def _signal_test(z: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """AUC of the logits on the labels and the two-sided Mann-Whitney p-value of "no signal".

    Binary: the score is ``z1 - z0``. C > 2: one-vs-rest on log-softmax, macro AUC, and the
    smallest class p-value times C (Bonferroni).
    """
    zn, yn = z.numpy(), y.numpy()
    scores = [zn[:, 1] - zn[:, 0]] if zn.shape[1] == 2 else list(np.log(_softmax_np(zn)).T)
    classes = [1] if zn.shape[1] == 2 else range(zn.shape[1])
    aucs, pvals = [], []
    for k, s in zip(classes, scores, strict=True):
        pos, neg = s[yn == k], s[yn != k]
        if pos.size == 0 or neg.size == 0:
            continue
        res = mannwhitneyu(pos, neg, alternative="two-sided")
        aucs.append(float(res.statistic) / (pos.size * neg.size))
        pvals.append(float(res.pvalue))
    if not aucs:
        return float("nan"), float("nan")
    return float(np.mean(aucs)), min(1.0, min(pvals) * len(pvals))
