"""Decision curve analysis of a binary task's p(y=1): the net benefit of acting on the model at each threshold
probability, beside acting on every case and on none (Vickers and Elkin 2006).

At a threshold probability ``p_t`` a clinician works a case up when p(cancer) >= ``p_t``; choosing ``p_t`` says
how many false positives one cancer found is worth (``(1 - p_t) / p_t``). The net benefit counts the true
positives and charges each false positive at that exchange rate:

    NB(p_t) = TP / N - FP / N * p_t / (1 - p_t)

*Treat all* (work every case up) has ``NB = prevalence - (1 - prevalence) * p_t / (1 - p_t)``, *treat none*
has 0. A model is useful at ``p_t`` where its curve lies above both. Unlike ECE or AUC this needs calibrated
probabilities to mean what it says: a miscalibrated model's curve is read at the wrong exchange rate.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lungcal.calibration.measures.clinical import _binary_positive
from lungcal.errors import DataError

__all__ = ["DecisionCurve", "decision_curve", "net_benefit", "DEFAULT_THRESHOLDS"]

#: threshold probabilities of a screening work-up decision: 1 % to 50 %
DEFAULT_THRESHOLDS = tuple(np.round(np.arange(0.01, 0.501, 0.01), 2))


def _check_thresholds(thresholds: Sequence[float] | np.ndarray) -> np.ndarray:
    t = np.asarray(thresholds, np.float64).reshape(-1)
    if t.size == 0 or not np.all((t > 0) & (t < 1)):
        raise DataError("threshold probabilities must lie strictly between 0 and 1", field="thresholds",
                        fix="pass values in (0, 1), e.g. 0.01 to 0.5")
    return t


def net_benefit(probs, labels, thresholds: Sequence[float] | np.ndarray) -> np.ndarray:
    """The model's net benefit at each threshold probability (module doc): a case is positive when
    p(y=1) >= the threshold. ``probs``: ``(N,)`` p(y=1) or ``(N, 2)``; ``labels``: ``(N,)`` 0/1."""
    p1, y = _binary_positive(probs, labels, "net_benefit")
    t = _check_thresholds(thresholds)
    n = float(len(y))
    positive = p1[None, :] >= t[:, None]  # (T, N)
    tp = (positive & (y[None, :] == 1)).sum(axis=1)
    fp = (positive & (y[None, :] == 0)).sum(axis=1)
    return tp / n - fp / n * t / (1.0 - t)


@dataclass(frozen=True)
class DecisionCurve:
    """Net benefit of the model, of treating all and of treating none, at each threshold probability."""

    thresholds: np.ndarray
    model: np.ndarray
    treat_all: np.ndarray
    prevalence: float
    n: int

    @property
    def treat_none(self) -> np.ndarray:
        return np.zeros_like(self.thresholds)

    def useful(self) -> np.ndarray:
        """Where the model beats both treating all and treating none (a bool per threshold)."""
        return (self.model > self.treat_all) & (self.model > 0)

    def at(self, threshold: float) -> dict[str, float]:
        """The three net benefits at one threshold probability (the nearest one on the curve's grid)."""
        i = int(np.argmin(np.abs(self.thresholds - threshold)))
        return {"threshold": float(self.thresholds[i]), "model": float(self.model[i]),
                "treat_all": float(self.treat_all[i]), "treat_none": 0.0}

    def as_dict(self) -> dict[str, object]:
        """Plain JSON: the thresholds and the three curves."""
        return {"thresholds": self.thresholds.tolist(), "model": self.model.tolist(),
                "treat_all": self.treat_all.tolist(), "treat_none": self.treat_none.tolist(),
                "prevalence": self.prevalence, "n": self.n}


def decision_curve(probs, labels, thresholds: Sequence[float] | np.ndarray = DEFAULT_THRESHOLDS) -> DecisionCurve:
    """The :class:`DecisionCurve` of p(y=1) on these cases (module doc).

    References:
        Vickers, Elkin. "Decision curve analysis: a novel method for evaluating prediction models."
        Medical Decision Making 26, 565-574 (2006). https://doi.org/10.1177/0272989X06295361
    """
    p1, y = _binary_positive(probs, labels, "decision_curve")
    t = _check_thresholds(thresholds)
    prev = float(np.mean(y == 1))
    return DecisionCurve(t, net_benefit(p1, y, t), prev - (1.0 - prev) * t / (1.0 - t), prev, int(len(y)))
