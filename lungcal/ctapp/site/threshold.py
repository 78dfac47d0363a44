"""The site's decision threshold with a missed-cancer guarantee: ``lungcal recalibrate --miss-rate ALPHA``.

The threshold is chosen on one labelled split of the site, the *certify split* (``--certify-split``, default
``val``), on the probabilities of the calibrator the recalibration chose
(:func:`lungcal.calibration.guarantee.missed_cancer_threshold`). With ``--guarantee ltt`` (default,
Learn-then-Test on the exact binomial tail of the integer count of misses) at most ``alpha`` of the cancers
of the population that split was drawn from fall below it, with probability at least ``1 - delta`` over the
draw (``--confidence`` = 1 - delta); with ``--guarantee crc`` (conformal risk control) at most ``alpha`` on
average over draws, a weaker promise with no confidence.

The test split never chooses it. Certified on val, the test split reports what the threshold does there:
the share of CTs called positive (sent on for work-up) and the sensitivity, with a Clopper-Pearson interval.
Certified on test (the way out when the model's checkpoint was chosen on val:
:mod:`lungcal.ctapp.site.certify_split`), no split is left to check it, and the report says so.

A threshold that sends more than :data:`WORKUP_WARNING` of the certify split's CTs on to work-up keeps its
promise by calling nearly everyone positive: :meth:`SiteThreshold.warnings` says so, with the cancers that
would buy the next allowed miss (:func:`~lungcal.calibration.guarantee.cancers_needed`).

The calibrator is fitted on val. The auto candidates (TS, Platt, isotonic) and the prior adjustment are
non-decreasing in the frozen network's score, so a threshold on their probability is a threshold on that
score; provided the network's checkpoint was not chosen on the certify split, that score was fixed before
the split was drawn and the guarantee is the method's own.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binomtest

from lungcal.calibration.guarantee import (
    CRC,
    LTT,
    MissedCancerGuarantee,
    cancers_needed,
    check_guarantee,
    missed_cancer_threshold,
)
from lungcal.errors import ConfigError
from lungcal.tracking import POSITIVE_RATE_AT_THRESHOLD, SENSITIVITY_AT_THRESHOLD, THRESHOLD_METRIC, metric_name

__all__ = ["CERTIFY_SPLITS", "DEFAULT_CONFIDENCE", "SENSITIVITY_CI", "WORKUP_WARNING", "SiteThreshold",
           "check_certify_split", "check_levels", "check_cancers", "site_threshold"]

#: ``--confidence`` (1 - delta) when only ``--miss-rate`` is given (Learn-then-Test)
DEFAULT_CONFIDENCE = 0.9
#: the level of the test sensitivity's Clopper-Pearson interval
SENSITIVITY_CI = 0.95
#: ``--certify-split`` choices: the split the threshold is chosen on
CERTIFY_SPLITS = ("val", "test")
#: a certified threshold that sends more than this share of the certify split's CTs on to work-up is warned of
WORKUP_WARNING = 0.9


def _level(value: Any, flag: str, example: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not 0.0 < v < 1.0:
        raise ConfigError(f"{flag} must be a fraction strictly between 0 and 1, got {value!r}", field=flag,
                          fix=f"pass e.g. {flag} {example}")
    return v


def check_levels(miss_rate: Any, confidence: Any, guarantee: str = LTT) -> tuple[float, float | None]:
    """``(alpha, delta)`` of ``--miss-rate`` and ``--confidence`` (default :data:`DEFAULT_CONFIDENCE`; ``delta``
    None for ``--guarantee crc``, which takes no confidence), else a ConfigError naming the flag."""
    guarantee = check_guarantee(guarantee)
    alpha = _level(miss_rate, "--miss-rate", "0.05 (at most 5% of cancers below the threshold)")
    if guarantee == CRC:
        if confidence is not None:
            raise ConfigError("--guarantee crc states no confidence: conformal risk control bounds the missed-cancer "
                              "rate on average over val draws, not with a probability", field="--confidence",
                              fix="drop --confidence, or use --guarantee ltt for a guarantee with a confidence")
        return alpha, None
    conf = _level(DEFAULT_CONFIDENCE if confidence is None else confidence, "--confidence", "0.9")
    return alpha, round(1.0 - conf, 12)  # 1 - 0.9 is 0.0999...98 in floats


def check_certify_split(split: Any) -> str:
    """``split`` if it is one of :data:`CERTIFY_SPLITS`, else a ConfigError naming them."""
    if split not in CERTIFY_SPLITS:
        raise ConfigError(f"unknown --certify-split {split!r}", field="--certify-split",
                          fix=f"use one of: {', '.join(CERTIFY_SPLITS)} (a datalist has train, val and test splits)")
    return str(split)


def _promise(alpha: float, delta: float | None) -> str:
    if delta is None:
        return f"a missed-cancer rate of at most {100 * alpha:g}% on average (--guarantee crc)"
    return f"a missed-cancer rate of at most {100 * alpha:g}% with confidence {100 * (1 - delta):g}%"


def check_cancers(rows: Sequence[Mapping[str, Any]], alpha: float, delta: float | None, datalist: str | Path,
                  guarantee: str = LTT, split: str = "val") -> int:
    """The number of cancers in the site's certify split (``rows``), else, when they are too few for ``alpha``
    and ``delta`` (:func:`cancers_needed`), a one-line ConfigError naming the number needed."""
    n = sum(int(r["label"]) == 1 for r in rows)
    needed = cancers_needed(alpha, delta, 0, guarantee)
    if n < needed:
        looser = "a larger --miss-rate" + ("" if guarantee == CRC else " or a lower --confidence")
        raise ConfigError(f"the site's {split} split has {n} cancers: {_promise(alpha, delta)} needs at least "
                          f"{needed}", file=datalist, field="--miss-rate",
                          fix=f"label more of the site's CTs (at least {needed} cancers in {split}; `lungcal "
                              f"cancers-needed` gives the count per missed cancer allowed), or pass {looser}")
    return n


@dataclass(frozen=True)
class SiteThreshold:
    """The guaranteed threshold (fitted on ``fit_split``, with its positive rate and sensitivity there) and the
    test split's numbers (NaN, with ``test_n`` 0, when the test split certified it: nothing is left to check it).

    ``certify_note`` says how the certify split relates to the model's checkpoint
    (:mod:`lungcal.ctapp.site.certify_split`); ``certify_checked`` is False when that could not be checked.
    """

    guarantee: MissedCancerGuarantee
    test_n: int
    test_cancers: int
    test_positive_rate: float
    test_sensitivity: float
    test_sensitivity_ci: tuple[float, float]
    fit_split: str = "val"
    certify_note: str = ""
    certify_checked: bool = True
    #: the cancers needed for 1, 2, 3 more allowed misses (filled by :func:`site_threshold`)
    next_needed: tuple[int, ...] = field(default=())

    @property
    def checked_on_test(self) -> bool:
        """Whether an independent test split reports what the threshold does."""
        return self.fit_split != "test" and self.test_n > 0

    def workup_warning(self) -> str | None:
        """One sentence when the threshold sends more than :data:`WORKUP_WARNING` of the certify split's CTs on to
        work-up (what it means, and how many labelled cancers would buy a more useful threshold); else None."""
        g = self.guarantee
        if g.positive_rate <= WORKUP_WARNING:
            return None
        test = f" (test {100 * self.test_positive_rate:.1f}%)" if self.checked_on_test else ""
        k = g.misses_allowed if g.misses_allowed is not None else 0
        more = ", ".join(f"{n} allow {k + 1 + i}" for i, n in enumerate(self.next_needed))
        level = (f"--miss-rate {g.alpha:g}, --confidence {1 - g.delta:g}" if g.delta is not None
                 else f"--miss-rate {g.alpha:g}, --guarantee crc")
        return (f"the certified threshold sends {100 * g.positive_rate:.1f}% of the {self.fit_split} CTs{test} on to "
                f"work-up: the guarantee is kept by calling nearly every CT positive, so the threshold does not "
                f"triage. {g.n_cancers} cancers in {self.fit_split} allow {k} missed cancer(s) below it; {more} "
                f"({level}; `lungcal cancers-needed`, docs/hospital.md). Label more cancers for the "
                f"{self.fit_split} split, or accept a larger --miss-rate")

    def warnings(self) -> list[str]:
        """What the printed summary and ``guarantee.json`` warn of: a threshold that hardly triages, a certify
        split whose independence of the checkpoint could not be checked."""
        out = [w for w in (self.workup_warning(),) if w]
        if not self.certify_checked:
            out.append(self.certify_note)
        return out

    def metrics(self) -> dict[str, float]:
        """The recalibration run's metrics (names in :mod:`lungcal.tracking.names`): the threshold, its positive
        rate and sensitivity on the certify split, and on test when test did not certify it."""
        g = self.guarantee
        out = {THRESHOLD_METRIC: g.threshold,
               metric_name(self.fit_split, POSITIVE_RATE_AT_THRESHOLD): g.positive_rate,
               metric_name(self.fit_split, SENSITIVITY_AT_THRESHOLD): g.sensitivity}
        if self.checked_on_test:
            sens = metric_name("test", SENSITIVITY_AT_THRESHOLD)
            out.update({metric_name("test", POSITIVE_RATE_AT_THRESHOLD): self.test_positive_rate,
                        sens: self.test_sensitivity, f"{sens}_ci_low": self.test_sensitivity_ci[0],
                        f"{sens}_ci_high": self.test_sensitivity_ci[1]})
        return out

    def as_dict(self) -> dict[str, Any]:
        """The run's ``guarantee.json``: the guarantee (:meth:`MissedCancerGuarantee.as_dict`, what ``predict
        --site`` reads back), the split it was fitted on and how it relates to the checkpoint, the warnings, and
        the test split's numbers (None when test certified it)."""
        test = None
        if self.checked_on_test:
            test = {"n": self.test_n, "n_cancers": self.test_cancers, "positive_rate": self.test_positive_rate,
                    "sensitivity": self.test_sensitivity, "sensitivity_ci": list(self.test_sensitivity_ci),
                    "sensitivity_ci_method": f"Clopper-Pearson {100 * SENSITIVITY_CI:g}%"}
        return {**self.guarantee.as_dict(), "fit_split": self.fit_split,
                "certify_split": {"name": self.fit_split, "checked": self.certify_checked, "note": self.certify_note},
                "warnings": self.warnings(), "test": test}


def _probs(p: Any) -> np.ndarray:
    q = np.asarray(p, dtype=np.float64)
    return q[:, 1] if q.ndim == 2 else q


def site_threshold(p_val: Any, y_val: Any, p_test: Any, y_test: Any, alpha: float, delta: float | None, *,
                   guarantee: str = LTT, fit_split: str = "val", certify_note: str = "",
                   certify_checked: bool = True) -> SiteThreshold:
    """The threshold fitted on ``(p_val, y_val)`` (the certify split, ``fit_split``) only, and what it does on
    ``(p_test, y_test)`` (None, None when the test split is the certify split).

    ``p_*``: calibrated p(cancer), ``(N,)`` or ``(N, 2)``; ``y_*``: 1 cancer, 0 not.
    """
    g = missed_cancer_threshold(_probs(p_val), y_val, alpha=alpha, delta=delta, guarantee=guarantee)
    k0 = g.misses_allowed if g.misses_allowed is not None else 0
    nxt = tuple(cancers_needed(alpha, delta, k0 + i, guarantee) for i in (1, 2, 3))
    n_test = n = k = 0
    rate = sens = lo = hi = math.nan
    if p_test is not None:
        p = _probs(p_test)
        y = np.asarray(y_test).astype(int).reshape(-1)
        called = g.decide(p)
        k, n, n_test, rate = int(called[y == 1].sum()), int((y == 1).sum()), int(y.size), float(called.mean())
        if n:
            ci = binomtest(k, n).proportion_ci(confidence_level=SENSITIVITY_CI, method="exact")
            sens, lo, hi = k / n, float(ci.low), float(ci.high)
    return SiteThreshold(guarantee=g, test_n=n_test, test_cancers=n, test_positive_rate=rate, test_sensitivity=sens,
                         test_sensitivity_ci=(lo, hi), fit_split=fit_split, certify_note=certify_note,
                         certify_checked=certify_checked, next_needed=nxt)
