"""A decision threshold with a guarantee on the missed-cancer rate (Learn-then-Test, MAPIE).

On a site's labelled calibration split, :func:`missed_cancer_threshold` chooses the threshold above which a
case is called positive (sent on for work-up) so that

    P( missed-cancer rate of the threshold  <=  alpha )  >=  1 - delta

over the draw of the calibration split, where the missed-cancer rate is the share of cancers whose
probability falls below the threshold (1 - sensitivity) in the population the split was drawn from.

It is MAPIE's :class:`mapie.risk_control.BinaryClassificationController` (Learn then Test, Angelopoulos et
al. 2022) controlling the recall at ``1 - alpha`` with confidence ``1 - delta``: one hypothesis per
candidate threshold (the calibration cancers' own probabilities, and 0), tested in ascending order by
fixed-sequence testing (the missed-cancer rate only grows with the threshold, so no multiplicity penalty),
each with a Hoeffding-Bentkus p-value; of the thresholds that pass, the one with the fewest positives is
kept. A split whose cancers are too few for any threshold to pass is refused: even a threshold that
misses none of ``n`` cancers is certified only when ``(1 - alpha) ** n <= delta``.

References:
    Angelopoulos, Bates, Candès, Jordan, Lei. "Learn then Test: Calibrating Predictive Algorithms to
    Achieve Risk Control." 2022. https://arxiv.org/abs/2110.01052
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from mapie.risk_control import BinaryClassificationController

from lungcal.errors import ConfigError, DataError

__all__ = ["MissedCancerGuarantee", "cancers_needed", "missed_cancer_threshold"]


@dataclass(frozen=True)
class MissedCancerGuarantee:
    """A threshold and what it guarantees: the missed-cancer rate is at most ``alpha`` with probability at least
    ``1 - delta`` over the calibration draw. ``positive_rate`` and ``sensitivity`` are measured on the
    calibration split; a test split's are the caller's to report."""

    threshold: float
    alpha: float
    delta: float
    n: int
    n_cancers: int
    positive_rate: float
    sensitivity: float
    method: str = "Learn-then-Test (MAPIE BinaryClassificationController, recall, fixed-sequence testing)"

    def statement(self) -> str:
        """The guarantee as one sentence (what each CT's record states)."""
        return (f"a CT is called positive when p(cancer) >= {self.threshold:.4f}; at most {100 * self.alpha:g}% of "
                f"cancers fall below it, with probability at least {100 * (1 - self.delta):g}% over the site's "
                f"calibration split ({self.n_cancers} cancers among {self.n} CTs)")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "statement": self.statement()}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> MissedCancerGuarantee:
        """The guarantee :meth:`as_dict` wrote (extra keys, such as a test split's numbers, are ignored)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})

    def decide(self, p1: Any) -> np.ndarray:
        """``True`` where a case is called positive (``p1 >= threshold``)."""
        return np.asarray(p1, dtype=np.float64) >= self.threshold


def cancers_needed(alpha: float, delta: float) -> int:
    """The fewest cancers for which any threshold can be certified: ``(1 - alpha) ** n <= delta``."""
    return int(math.ceil(math.log(delta) / math.log1p(-alpha)))


def _check_level(value: float, name: str) -> float:
    v = float(value)
    if not 0.0 < v < 1.0:
        raise ConfigError(f"{name} must be in (0, 1), got {value!r}", field=name,
                          fix=f"pass e.g. --{name.replace('_', '-')} 0.05")
    return v


def missed_cancer_threshold(p1: Any, labels: Any, alpha: float = 0.05, delta: float = 0.1) -> MissedCancerGuarantee:
    """The threshold on p(cancer) whose missed-cancer rate is at most ``alpha`` with probability ``1 - delta``.

    Args:
        p1: calibrated p(cancer) of the calibration split, ``(N,)`` or ``(N, 2)``.
        labels: 1 cancer, 0 not, ``(N,)``.
        alpha: the missed-cancer rate allowed (1 - the sensitivity guaranteed).
        delta: the chance, over the calibration draw, that the guarantee fails.

    Raises:
        ConfigError: ``alpha`` or ``delta`` outside (0, 1); too few cancers for ``alpha`` and ``delta``
            (the message names the number needed).
        DataError: probabilities and labels disagree in length, or a probability lies outside [0, 1].
    """
    alpha, delta = _check_level(alpha, "alpha"), _check_level(delta, "delta")
    p = np.asarray(p1, dtype=np.float64)
    p = p[:, 1] if p.ndim == 2 else p
    y = np.asarray(labels).astype(int).reshape(-1)
    if p.shape != y.shape:
        raise DataError(f"{p.size} probabilities but {y.size} labels", field="labels", fix="pass one label per case")
    if p.size and (np.nanmin(p) < 0 or np.nanmax(p) > 1 or np.isnan(p).any()):
        raise DataError("probabilities must lie in [0, 1]", field="probabilities", fix="pass calibrated p(cancer)")
    n_cancers, needed = int((y == 1).sum()), cancers_needed(alpha, delta)
    if n_cancers < needed:
        raise ConfigError(f"the calibration split has {n_cancers} cancers: a missed-cancer rate of at most "
                          f"{100 * alpha:g}% with probability {100 * (1 - delta):g}% needs at least {needed}",
                          field="alpha", fix=f"label more of the site's CTs (at least {needed} cancers), or ask for "
                                             "a larger alpha or delta")
    grid = np.unique(np.concatenate([[0.0], p[y == 1]]))  # the rate changes only at the cancers' probabilities
    controller = BinaryClassificationController(
        predict_function=lambda q: np.column_stack([1.0 - np.asarray(q), np.asarray(q)]), risk="recall",
        target_level=1.0 - alpha, confidence_level=1.0 - delta, best_predict_param_choice="predicted_positive_fraction",
        list_predict_params=grid, fwer_method="fixed_sequence")
    controller.calibrate(p, y)
    if controller.best_predict_param is None:  # cannot happen above the count needed: 0 is always certified
        raise ConfigError("no threshold controls the missed-cancer rate on this split", field="alpha",
                          fix="ask for a larger alpha or delta, or label more cancers")
    t = float(controller.best_predict_param)
    called = p >= t
    return MissedCancerGuarantee(threshold=t, alpha=alpha, delta=delta, n=int(p.size), n_cancers=n_cancers,
                                 positive_rate=float(called.mean()), sensitivity=float(called[y == 1].mean()))
