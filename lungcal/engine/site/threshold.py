"""The site's decision threshold with a missed-cancer guarantee: ``lungcal recalibrate --miss-rate ALPHA``.

The threshold is chosen on the site's labelled calibration split, its ``val`` split, on the probabilities
of the calibrator the recalibration chose (:func:`lungcal.calibration.guarantee.missed_cancer_threshold`,
Learn-then-Test through MAPIE): at most ``alpha`` of the cancers of the population that split was drawn
from fall below it, with probability at least ``1 - delta`` over the draw (``--confidence`` = 1 - delta).
The test split is never used to choose it; it only reports what the threshold does there: the share of
CTs called positive (sent on for work-up) and the sensitivity, with a Clopper-Pearson interval.

The calibrator is fitted on the same val split. The auto candidates (TS, Platt, isotonic) and the prior
adjustment are non-decreasing in the frozen network's score, so a threshold on their probability is a
threshold on that score, which was fixed before the site's data: the guarantee is Learn-then-Test's own.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binomtest

from lungcal.calibration.guarantee import MissedCancerGuarantee, cancers_needed, missed_cancer_threshold
from lungcal.errors import ConfigError
from lungcal.tracking import POSITIVE_RATE_AT_THRESHOLD, SENSITIVITY_AT_THRESHOLD, THRESHOLD_METRIC, metric_name

__all__ = ["DEFAULT_CONFIDENCE", "SENSITIVITY_CI", "SiteThreshold", "check_levels", "check_cancers",
           "site_threshold"]

#: ``--confidence`` (1 - delta) when only ``--miss-rate`` is given
DEFAULT_CONFIDENCE = 0.9
#: the level of the test sensitivity's Clopper-Pearson interval
SENSITIVITY_CI = 0.95


def _level(value: Any, flag: str, example: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not 0.0 < v < 1.0:
        raise ConfigError(f"{flag} must be a fraction strictly between 0 and 1, got {value!r}", field=flag,
                          fix=f"pass e.g. {flag} {example}")
    return v


def check_levels(miss_rate: Any, confidence: Any) -> tuple[float, float]:
    """``(alpha, delta)`` of ``--miss-rate`` and ``--confidence`` (default :data:`DEFAULT_CONFIDENCE`), else a
    ConfigError naming the flag."""
    alpha = _level(miss_rate, "--miss-rate", "0.05 (at most 5% of cancers below the threshold)")
    conf = _level(DEFAULT_CONFIDENCE if confidence is None else confidence, "--confidence", "0.9")
    return alpha, round(1.0 - conf, 12)  # 1 - 0.9 is 0.0999...98 in floats


def check_cancers(val_rows: Sequence[Mapping[str, Any]], alpha: float, delta: float, datalist: str | Path) -> int:
    """The number of cancers in the site's val split, else, when they are too few for ``alpha`` and ``delta``
    (:func:`cancers_needed`), a one-line ConfigError naming the number needed."""
    n = sum(int(r["label"]) == 1 for r in val_rows)
    needed = cancers_needed(alpha, delta)
    if n < needed:
        raise ConfigError(f"the site's val split has {n} cancers: a missed-cancer rate of at most {100 * alpha:g}% "
                          f"with confidence {100 * (1 - delta):g}% needs at least {needed}", file=datalist,
                          field="--miss-rate", fix=f"label more of the site's CTs (at least {needed} cancers in val), "
                                                   "or pass a larger --miss-rate or a lower --confidence")
    return n


@dataclass(frozen=True)
class SiteThreshold:
    """The guaranteed threshold (fitted on val, with val's positive rate and sensitivity) and its test numbers."""

    guarantee: MissedCancerGuarantee
    test_n: int
    test_cancers: int
    test_positive_rate: float
    test_sensitivity: float
    test_sensitivity_ci: tuple[float, float]

    def metrics(self) -> dict[str, float]:
        """The recalibration run's metrics (names in :mod:`lungcal.tracking.names`)."""
        g, sens = self.guarantee, metric_name("test", SENSITIVITY_AT_THRESHOLD)
        return {THRESHOLD_METRIC: g.threshold,
                metric_name("val", POSITIVE_RATE_AT_THRESHOLD): g.positive_rate,
                metric_name("val", SENSITIVITY_AT_THRESHOLD): g.sensitivity,
                metric_name("test", POSITIVE_RATE_AT_THRESHOLD): self.test_positive_rate,
                sens: self.test_sensitivity, f"{sens}_ci_low": self.test_sensitivity_ci[0],
                f"{sens}_ci_high": self.test_sensitivity_ci[1]}

    def as_dict(self) -> dict[str, Any]:
        """The run's ``guarantee.json``: the guarantee (:meth:`MissedCancerGuarantee.as_dict`, what ``predict
        --site`` reads back), the split it was fitted on, and the test split's numbers."""
        return {**self.guarantee.as_dict(), "fit_split": "val",
                "test": {"n": self.test_n, "n_cancers": self.test_cancers, "positive_rate": self.test_positive_rate,
                         "sensitivity": self.test_sensitivity, "sensitivity_ci": list(self.test_sensitivity_ci),
                         "sensitivity_ci_method": f"Clopper-Pearson {100 * SENSITIVITY_CI:g}%"}}


def site_threshold(p_val: Any, y_val: Any, p_test: Any, y_test: Any, alpha: float, delta: float) -> SiteThreshold:
    """The threshold fitted on ``(p_val, y_val)`` only, and what it does on ``(p_test, y_test)``.

    ``p_*``: calibrated p(cancer), ``(N,)`` or ``(N, 2)``; ``y_*``: 1 cancer, 0 not.
    """
    g = missed_cancer_threshold(p_val, y_val, alpha=alpha, delta=delta)
    p = np.asarray(p_test, dtype=np.float64)
    p = p[:, 1] if p.ndim == 2 else p
    y = np.asarray(y_test).astype(int).reshape(-1)
    called = g.decide(p)
    k, n = int(called[y == 1].sum()), int((y == 1).sum())
    ci = binomtest(k, n).proportion_ci(confidence_level=SENSITIVITY_CI, method="exact") if n else None
    return SiteThreshold(guarantee=g, test_n=int(y.size), test_cancers=n, test_positive_rate=float(called.mean()),
                         test_sensitivity=k / n if n else float("nan"),
                         test_sensitivity_ci=(float(ci.low), float(ci.high)) if ci else (float("nan"), float("nan")))
