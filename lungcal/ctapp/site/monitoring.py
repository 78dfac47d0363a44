"""The statistics of ``lungcal monitor``, per chunk of a site's CTs after go-live: pure, no I/O, no model.

A site's CTs arrive month by month; their labels (biopsy, follow-up) months later. The monitor groups the CTs
by acquisition date into chunks (calendar months, or runs of N CTs in date order: :func:`make_chunks`), and
gives each chunk (:func:`chunk_statistics`):

- **the site check** against the site's own reference (the calibration CTs ``lungcal recalibrate`` fitted the
  calibrator and threshold on) and against the training data (the model's validation split): verdict, reasons,
  effect size (:func:`lungcal.ctapp.evaluate.site_assessment.assess`);
- the share of CTs flagged **out of distribution** (the caller places each CT, as ``predict --site`` does);
- the **work-up rate** at the site's threshold (no label needed; Clopper-Pearson CI);
- **without labels**, CBPE (:mod:`lungcal.calibration.performance_estimation`): the expected sensitivity at the
  threshold with its interval, and the band of O/E that labels would show while the calibration holds. It is
  valid only where the calibration is: a ``comparable`` chunk, or a ``prevalence_shift`` chunk once the
  probabilities are adjusted to the chunk's estimated prevalence (Saerens' Bayes re-weighting from the site's
  calibration prevalence to the chunk's BBSE estimate; the calls stay those of the unadjusted probabilities);
  every other chunk's estimate is marked invalid, with why;
- **with labels** (where they have arrived; a chunk may be partly labelled): the observed sensitivity and work-up
  rate (Clopper-Pearson), O/E and the 10-bin ECE (percentile bootstrap,
  :func:`lungcal.calibration.measures.calibration_report`).

**The alert rule** (:class:`AlertRule`, :func:`chunk_alerts`). A chunk raises an alert when

1. its site check against the site's reference is not ``comparable`` (a ``scanner_shift`` or a
   ``prevalence_shift`` alert), the check run at the per-chunk level ``alpha_year / chunks_per_year``
   (Bonferroni over a year: 0.05 / 12 by default); ``prevalence_shift`` by two exact tests (:func:`check_chunk`:
   the outputs' KS permutation test, and Fisher's test of the share called positive, which is whether the
   prevalence BBSE estimates moved from the reference's own);
2. or its CBPE sensitivity is valid and the interval's upper end lies below the site's promise (the sensitivity
   the guarantee of ``recalibrate --miss-rate`` promises, ``1 - miss rate``);
3. or its labelled CTs' observed sensitivity has a Clopper-Pearson upper end below the promise.

An alert whose kind the previous chunk did not raise is *new*, else *continuing*. Stated bound, by Bonferroni:
over a stable year of 12 chunks, the probability of any ``scanner_shift`` alert is at most ``alpha_year`` and of
any ``prevalence_shift`` alert at most ``2 alpha_year`` (two tests, each at the per-chunk level); rules 2 and 3
have no closed bound. The probability is over the year's CTs *and* the draw of the site's calibration CTs: the
tests count the reference's own sampling error, but a site whose calibration CTs happen to be unrepresentative
(a prevalence two standard errors off, say) alerts more often than that, every year, until it recalibrates on
more CTs. :func:`false_alarm_rate` measures the whole rule by Monte-Carlo over simulated stable years, with a fresh
reference each year or a fixed one.

**Privacy.** Dates are patient identifiers: they are read here to group rows and never leave this module.
A chunk is named by its ordinal and its offset from the first (``month +3``), never by a calendar date; a row
with a bad date is named by its row number, not its value.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

import numpy as np

from lungcal.calibration.measures import calibration_report
from lungcal.calibration.performance_estimation import cbpe_sensitivity, estimate_validity, expected_oe_interval
from lungcal.calibration.prior import adjust_to_prior
from lungcal.calibration.shift import call_rate_test
from lungcal.ctapp.evaluate.site_assessment import (
    COMPARABLE,
    MIN_SITE_CTS,
    PREVALENCE_SHIFT,
    SCANNER_SHIFT,
    Reference,
    assess,
)
from lungcal.ctapp.site.subgroups import clopper_pearson
from lungcal.errors import ConfigError, DataError

__all__ = ["DATE_COLUMN", "MONTH", "MIN_CHUNK_CTS", "Chunk", "AlertRule", "parse_date", "parse_chunk", "dated_rows",
           "make_chunks", "check_chunk", "estimate_chunk", "observed_chunk", "chunk_statistics", "chunk_alerts",
           "run_alerts", "false_alarm_rate", "reference_draw", "reference_splits", "ChunkDraw", "DrawFn", "SiteDraw"]

#: the datalist column holding a CT's acquisition date (``lungcal import-site`` copies the site CSV's ``study_date``,
#: or a DICOM CT's ``StudyDate`` where the CSV gives none)
DATE_COLUMN = "study_date"
#: ``--chunk month``: one chunk per calendar month
MONTH = "month"
#: the fewest CTs a chunk needs to say anything: a site check's minimum
MIN_CHUNK_CTS = MIN_SITE_CTS
#: ECE bins on CT (the project's contract)
N_BINS = 10
_ISO = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(?:[T ][0-9:.]+)?$")
_DICOM = re.compile(r"^(\d{4})(\d{2})(\d{2})(?:[0-9.]*)?$")


def parse_date(value: Any) -> date | None:
    """A CT's date from ``YYYY-MM-DD`` (ISO, optionally with a time), ``YYYYMMDD`` (DICOM DA), a :class:`date` or
    :class:`datetime`; ``None`` for anything else (ambiguous forms such as ``01/02/2024`` included)."""
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    if not isinstance(value, str):
        return None
    text = value.strip()
    m = _ISO.match(text) or _DICOM.match(text)
    if m is None:
        return None
    try:
        return date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError:
        return None


def parse_chunk(value: Any) -> str | int:
    """``--chunk``: :data:`MONTH` or a number of CTs (at least :data:`MIN_CHUNK_CTS`)."""
    text = str(value).strip().lower()
    if text == MONTH:
        return MONTH
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < MIN_CHUNK_CTS:
        raise ConfigError(f"--chunk {value!r} is neither 'month' nor a number of CTs of at least {MIN_CHUNK_CTS}",
                          field="--chunk", fix=f"use --chunk month, or --chunk N with N >= {MIN_CHUNK_CTS} (a site "
                                               "check needs that many CTs)")
    return n


def dated_rows(rows: Sequence[Mapping[str, Any]], column: str = DATE_COLUMN) -> tuple[list[tuple[int, date]],
                                                                                      list[str]]:
    """``([(row index, date)], problems)``: the rows whose ``column`` holds a date, and one line per row left out
    (no date, or a date in an unknown format), naming the row but never its value."""
    kept, problems = [], []
    for i, r in enumerate(rows):
        value = r.get(column)
        if value is None or (isinstance(value, str) and not value.strip()):
            problems.append(f"row {i}: no {column}: left out (import-site copies it from the site CSV's "
                            f"{column} column, or a DICOM CT's StudyDate)")
            continue
        d = parse_date(value)
        if d is None:
            problems.append(f"row {i}: {column} in an unknown format: left out (use YYYY-MM-DD or DICOM's "
                            "YYYYMMDD)")
            continue
        kept.append((i, d))
    return kept, problems


@dataclass
class Chunk:
    """One chunk of CTs: its ordinal (1, 2, ...), its name (relative, never a date) and its members (indices into
    the dates :func:`make_chunks` was given)."""

    ordinal: int
    name: str
    members: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.members)

    def label(self) -> str:
        return f"chunk {self.ordinal} ({self.name})"


def make_chunks(dates: Sequence[date], chunk: str | int = MONTH) -> list[Chunk]:
    """The chunks of CTs acquired on ``dates``: calendar months (``month +0`` is the first month that holds a CT;
    months without a CT in between are chunks with no members), or runs of ``chunk`` CTs in date order (the last
    may be shorter). Members are kept in date order."""
    if not dates:
        return []
    order = sorted(range(len(dates)), key=lambda i: dates[i])
    if chunk == MONTH:
        months = [dates[i].year * 12 + dates[i].month - 1 for i in range(len(dates))]
        first = min(months)
        out = [Chunk(k + 1, f"month +{k}") for k in range(max(months) - first + 1)]
        for i in order:
            out[months[i] - first].members.append(i)
        return out
    size = int(chunk)
    return [Chunk(k // size + 1, f"CTs {k + 1}-{min(k + size, len(order))} in date order", order[k:k + size])
            for k in range(0, len(order), size)]


@dataclass(frozen=True)
class AlertRule:
    """When a chunk raises an alert (module doc): the site check at ``alpha_year / chunks_per_year``, and the
    sensitivity against ``promise`` (None: no promise, rules 2 and 3 off)."""

    alpha_year: float = 0.05
    chunks_per_year: int = 12
    promise: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.alpha_year < 0.5:
            raise ConfigError(f"--alpha {self.alpha_year} is not in (0, 0.5)", field="--alpha",
                              fix="use e.g. 0.05: the false-alarm rate of a scanner alert over a year")
        if self.promise is not None and not 0 < self.promise <= 1:
            raise ConfigError(f"promised sensitivity {self.promise} is not in (0, 1]", field="--promise",
                              fix="pass a sensitivity such as 0.9")

    @property
    def alpha_chunk(self) -> float:
        return self.alpha_year / self.chunks_per_year

    def describe(self) -> str:
        promise = (f"; or its valid CBPE sensitivity's upper end, or its labelled CTs' observed sensitivity's "
                   f"upper end, lies below the promised {self.promise:.3f}") if self.promise is not None else ""
        return (f"a chunk alerts when its site check against the site's calibration CTs is not comparable (at "
                f"alpha {self.alpha_year:g}/{self.chunks_per_year} = {self.alpha_chunk:.4f} per chunk){promise}")

    def bound(self) -> str:
        return (f"stated (Bonferroni) over a stable year of {self.chunks_per_year} chunks: a scanner_shift alert "
                f"with probability at most {self.alpha_year:g}, a prevalence_shift alert at most "
                f"{2 * self.alpha_year:g} (over the year's CTs and the draw of the calibration CTs); the "
                "sensitivity rules have no closed bound (measured by simulation)")

    def as_dict(self) -> dict[str, Any]:
        return {"alpha_year": self.alpha_year, "chunks_per_year": self.chunks_per_year,
                "alpha_chunk": self.alpha_chunk, "promise": self.promise}


def _resamples(alpha: float, family: int, given: int) -> int:
    """Permutations enough for the smallest merged p-value (2 / (n + 1)) to fall below ``alpha / family``."""
    return max(int(given), math.ceil(2.5 * max(1, family) / alpha))


def check_chunk(reference: Reference | None, scores: np.ndarray, features: np.ndarray | None,
                acquisition: Mapping[str, Mapping[str, Any]] | None, *, alpha: float, n_resamples: int = 1000,
                n_subsamples: int = 20, n_bootstrap: int = 1000, seed: int = 0) -> dict[str, Any]:
    """A chunk's site check against ``reference`` at ``alpha`` (the permutations raised as the level needs):
    ``{"verdict", "reasons", "effect", "prevalence", "prevalence_ci", "source_prevalence", "tests"}``, or
    ``{"verdict": None, "note"}`` when it cannot be said (no reference, too small a reference, fewer than
    :data:`MIN_CHUNK_CTS` CTs).

    ``scanner_shift`` is the site check's (:func:`~lungcal.ctapp.evaluate.site_assessment.assess`: the outputs
    and embeddings beyond what a prevalence change explains, the acquisition fields; Bonferroni over them at
    ``alpha``). Otherwise the chunk is ``prevalence_shift`` when its outputs moved (the KS permutation test,
    ``outputs_any_change``, p < ``alpha``) or the prevalence BBSE estimates moved from the reference's own
    (:func:`~lungcal.calibration.shift.call_rate_test`, ``call_rate``: Fisher's exact test of the share called
    positive at the pooled median, p < ``alpha``): two tests exact at every chunk size, each counting both
    samples' error. (The site check's own criterion, the chunk's bootstrap prevalence interval at ``1 - alpha``
    excluding the reference's prevalence, leaves out the reference's sampling error and is too narrow in the tails
    for small chunks: at 50 CTs it excluded about 2.4 times as often as ``alpha`` says, measured in
    ``docs/results/hospital.md``, 2026-12-07. ``prevalence_ci`` is still given, a 95 % interval that describes the
    estimate and decides nothing.)"""
    n = len(scores)
    if reference is None:
        return {"verdict": None, "note": "no reference to compare with"}
    if n < MIN_CHUNK_CTS:
        return {"verdict": None, "note": f"{n} CTs, too few (a check needs {MIN_CHUNK_CTS})"}
    try:
        reference.check()
    except DataError as exc:
        return {"verdict": None, "note": exc.message}
    feats = features if reference.features is not None else None
    acq = dict(acquisition or {})
    family = (2 if feats is not None else 1) + len(acq)
    found = assess(reference, scores, feats, acq, alpha=alpha, n_subsamples=n_subsamples,
                   n_resamples=_resamples(alpha, family, n_resamples), seed=seed, n_bootstrap=n_bootstrap)
    calls = call_rate_test(reference.scores, scores)
    tests = {**found["tests"], "call_rate": {**calls.as_dict(), "level": alpha}}
    verdict, reasons = found["verdict"], list(found["reasons"])
    if verdict != SCANNER_SHIFT:
        moved = tests["outputs_any_change"]["pvalue"] < alpha
        called = calls.pvalue < alpha
        reasons = []
        if moved:
            reasons.append(f"the outputs moved (p = {tests['outputs_any_change']['pvalue']:.3g} < {alpha:.3g}), "
                           "as a change of prevalence alone explains")
        if called:
            q, q_ci = found["prevalence"], found["prevalence_ci"]
            reasons.append(f"the share called positive moved by {calls.statistic:+.2f} (Fisher p = "
                           f"{calls.pvalue:.3g} < {alpha:.3g}): estimated prevalence {q:.2f} [{q_ci[0]:.2f}, "
                           f"{q_ci[1]:.2f}] against the calibration CTs' {found['source_prevalence']:.2f}")
        verdict = PREVALENCE_SHIFT if moved or called else COMPARABLE
    return {"verdict": verdict, "reasons": reasons, "effect": found["effect"], "prevalence": found["prevalence"],
            "prevalence_ci": found["prevalence_ci"], "source_prevalence": found["source_prevalence"], "tests": tests}


def estimate_chunk(p1: np.ndarray, threshold: float | None, verdict: str | None, *,
                   source_prevalence: float | None = None, prevalence: float | None = None, n_draws: int = 2000,
                   seed: int = 0) -> dict[str, Any]:
    """CBPE of a chunk (module doc): ``{"valid", "why", "prior_adjusted", "target_prevalence", "sensitivity",
    "interval", "expected_cancers", "oe", "oe_interval"}``. Under ``prevalence_shift`` the probabilities are first
    adjusted from ``source_prevalence`` (the site's calibration CTs') to ``prevalence`` (the chunk's estimate), the
    calls kept at ``threshold`` on the unadjusted ones."""
    p = np.asarray(p1, np.float64).reshape(-1)
    t = threshold
    adjusted = False
    target = None
    if (verdict == PREVALENCE_SHIFT and source_prevalence is not None and prevalence is not None
            and math.isfinite(prevalence) and 0 < source_prevalence < 1):
        target = float(np.clip(prevalence, 1e-3, 1 - 1e-3))
        p = np.asarray(adjust_to_prior(p, source_prevalence, target), np.float64)
        if t is not None:  # the same calls: the adjustment is monotone, so p >= t <=> p' >= t'
            t = float(np.asarray(adjust_to_prior(np.array([t]), source_prevalence, target))[0])
        adjusted = True
    valid, why = estimate_validity(verdict, adjusted)
    out: dict[str, Any] = {"valid": valid, "why": why, "prior_adjusted": adjusted, "target_prevalence": target,
                           "sensitivity": math.nan, "interval": (math.nan, math.nan), "expected_cancers":
                           float(p.sum()), "oe": 1.0, "oe_interval": expected_oe_interval(p, n_draws=n_draws,
                                                                                           seed=seed)}
    if t is not None:
        est = cbpe_sensitivity(p, t, n_draws=n_draws, seed=seed)
        out.update(sensitivity=est.sensitivity, interval=est.interval)
    return out


def observed_chunk(p1: np.ndarray, labels: np.ndarray | None, threshold: float | None, *, n_bootstrap: int = 1000,
                   seed: int = 0) -> dict[str, Any] | None:
    """What a chunk's labelled CTs show (labels 0/1; anything else is not labelled yet): ``{"n", "n_cancers",
    "work_up_rate", "work_up_ci", "sensitivity", "sensitivity_ci", "oe", "oe_ci", "ece", "ece_ci"}``; ``None``
    when none is labelled."""
    if labels is None:
        return None
    y_all = np.asarray(labels).reshape(-1)
    m = (y_all == 0) | (y_all == 1)
    if not m.any():
        return None
    p, y = np.asarray(p1, np.float64).reshape(-1)[m], y_all[m].astype(int)
    n, cancers = int(m.sum()), int(y.sum())
    out: dict[str, Any] = {"n": n, "n_cancers": cancers}
    if threshold is not None:
        called = p >= threshold
        k_found = int((called & (y == 1)).sum())
        out.update(work_up_rate=float(called.mean()), work_up_ci=clopper_pearson(int(called.sum()), n),
                   sensitivity=k_found / cancers if cancers else math.nan,
                   sensitivity_ci=clopper_pearson(k_found, cancers))
    rep = calibration_report(p, y, n_bins=N_BINS, n_bootstrap=n_bootstrap if n >= 2 else 0, seed=seed)
    out.update(oe=rep["oe_ratio"], oe_ci=(rep["oe_ratio_ci_low"], rep["oe_ratio_ci_high"]), ece=rep["ece"],
               ece_ci=(rep["ece_ci_low"], rep["ece_ci_high"]))
    return out


def chunk_statistics(scores: np.ndarray, p1: np.ndarray, *, threshold: float | None, rule: AlertRule,
                     site: Reference | None, training: Reference | None = None, features: np.ndarray | None = None,
                     site_acquisition: Mapping[str, Mapping[str, Any]] | None = None,
                     training_acquisition: Mapping[str, Mapping[str, Any]] | None = None,
                     labels: np.ndarray | None = None, flagged: Sequence[bool | None] | None = None,
                     n_resamples: int = 1000, n_subsamples: int = 20, n_bootstrap: int = 1000, n_draws: int = 2000,
                     seed: int = 0) -> dict[str, Any]:
    """Everything the monitor says of one chunk (module doc), on its CTs' binary scores (``scores``), calibrated
    p(cancer) (``p1``), embeddings, acquisition checks (:func:`lungcal.ctapp.evaluate.site_assessment.
    acquisition_checks` against the site's and the training data's summaries), labels (-1: not yet) and
    out-of-distribution flags (None: not checked)."""
    scores = np.asarray(scores, np.float64).reshape(-1)
    p = np.asarray(p1, np.float64).reshape(-1)
    n = int(p.size)
    kw = {"n_resamples": n_resamples, "n_subsamples": n_subsamples, "n_bootstrap": n_bootstrap, "seed": seed}
    vs_site = check_chunk(site, scores, features, site_acquisition, alpha=rule.alpha_chunk, **kw)
    vs_training = check_chunk(training, scores, features, training_acquisition, alpha=0.05, **kw)
    out: dict[str, Any] = {"n": n, "site_check": vs_site, "training_check": vs_training}
    checked = [bool(f) for f in (flagged or []) if f is not None]
    out["ood"] = {"n_checked": len(checked), "n_flagged": sum(checked),
                  "share": sum(checked) / len(checked) if checked else math.nan}
    if threshold is not None:
        k = int((p >= threshold).sum())
        out["work_up"] = {"rate": k / n if n else math.nan, "ci": clopper_pearson(k, n)}
    out["estimate"] = estimate_chunk(p, threshold, vs_site["verdict"],
                                     source_prevalence=None if site is None else float(np.mean(site.labels)),
                                     prevalence=vs_site.get("prevalence"), n_draws=n_draws, seed=seed)
    out["observed"] = observed_chunk(p, labels, threshold, n_bootstrap=n_bootstrap, seed=seed)
    return out


def chunk_alerts(stats: Mapping[str, Any], previous: Sequence[Mapping[str, Any]] | None,
                 rule: AlertRule) -> list[dict[str, Any]]:
    """The alerts of one chunk under ``rule`` (module doc), each ``{"kind", "why", "new"}``; ``previous``: the
    alerts of the chunk before (None: the first chunk, or one too small to say anything)."""
    out = []
    verdict = stats["site_check"].get("verdict")
    if verdict in (SCANNER_SHIFT, PREVALENCE_SHIFT):
        reasons = stats["site_check"].get("reasons") or []
        out.append({"kind": verdict, "why": f"site check against the site's calibration CTs: {verdict}"
                    + (f" ({reasons[0]})" if reasons else "")})
    est = stats.get("estimate") or {}
    if rule.promise is not None and est.get("valid") and math.isfinite(est["interval"][1]) \
            and est["interval"][1] < rule.promise:
        out.append({"kind": "sensitivity", "why": f"estimated sensitivity {est['sensitivity']:.3f} "
                    f"[{est['interval'][0]:.3f}, {est['interval'][1]:.3f}] (CBPE) below the promised "
                    f"{rule.promise:.3f}"})
    obs = stats.get("observed") or {}
    if rule.promise is not None and obs.get("sensitivity_ci") and math.isfinite(obs["sensitivity_ci"][1]) \
            and obs["sensitivity_ci"][1] < rule.promise:
        out.append({"kind": "observed_sensitivity", "why": f"observed sensitivity {obs['sensitivity']:.3f} "
                    f"[{obs['sensitivity_ci'][0]:.3f}, {obs['sensitivity_ci'][1]:.3f}] on "
                    f"{obs['n_cancers']} labelled cancers below the promised {rule.promise:.3f}"})
    before = {a["kind"] for a in previous or []}
    for a in out:
        a["new"] = a["kind"] not in before
    return out


def run_alerts(chunk_stats: Sequence[Mapping[str, Any] | None], rule: AlertRule) -> list[list[dict[str, Any]]]:
    """The alerts of each chunk in order (a chunk that said nothing, None, has none and breaks continuity)."""
    out: list[list[dict[str, Any]]] = []
    previous = None
    for stats in chunk_stats:
        alerts = [] if stats is None else chunk_alerts(stats, previous, rule)
        out.append(alerts)
        previous = None if stats is None else alerts
    return out


#: a chunk drawn by a simulation: ``(scores, features or None, p1, labels or None)``
ChunkDraw = tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]
#: draws a chunk of ``n`` CTs: ``draw(rng, n)``
DrawFn = Callable[[np.random.Generator, int], ChunkDraw]
#: a simulated site for one year: ``site(rng) -> (reference, draw)``, its calibration CTs and its chunks
SiteDraw = Callable[[np.random.Generator], tuple[Reference, DrawFn]]


def _split(reference: Reference, p1: np.ndarray, holdout: float,
           rng: np.random.Generator) -> tuple[Reference, DrawFn]:
    n = len(reference.scores)
    idx = rng.permutation(n)
    k = max(1, int(round(holdout * n)))
    pool, keep = idx[:k], idx[k:]
    feats = reference.features
    part = Reference(reference.scores[keep], reference.labels[keep], None if feats is None else feats[keep],
                     f"{reference.source}, {len(keep)} of {n} (the rest drawn as chunks)")
    p = np.asarray(p1, np.float64)

    def draw(g: np.random.Generator, size: int) -> ChunkDraw:
        j = g.choice(pool, size, replace=size > len(pool))
        return (reference.scores[j], None if feats is None else feats[j], p[j], reference.labels[j])

    return part, draw


def reference_draw(reference: Reference, p1: np.ndarray, *, holdout: float = 1 / 3,
                   seed: int = 0) -> tuple[Reference, DrawFn]:
    """A stable site from its own calibration CTs: the reference split at random into the part the checks compare
    with (returned) and a held-out pool the chunks are drawn from (without replacement while a chunk fits in the
    pool, else with), so that a chunk is not compared with the very CTs it was drawn from. ``p1``: each reference
    case's calibrated p(cancer)."""
    return _split(reference, p1, holdout, np.random.default_rng(seed))


def reference_splits(reference: Reference, p1: np.ndarray, *, holdout: float = 1 / 3) -> SiteDraw:
    """:func:`reference_draw` with a fresh random split each simulated year (``site(rng)``), so that a measured
    false-alarm rate is averaged over which calibration CTs form the reference, as the stated bound is."""
    return lambda g: _split(reference, p1, holdout, g)


def false_alarm_rate(site: Reference | SiteDraw, draw: DrawFn | None, rule: AlertRule, *,
                     threshold: float | None, n_per_chunk: int, n_years: int = 100, labelled: bool = False,
                     n_subsamples: int = 20, n_resamples: int = 1000, n_bootstrap: int = 200, n_draws: int = 500,
                     seed: int = 0) -> dict[str, Any]:
    """The alert rule's false-alarm rate over a year, by Monte-Carlo: ``n_years`` stable years of
    ``rule.chunks_per_year`` chunks of ``n_per_chunk`` CTs, each drawn by ``draw(rng, n)`` from one population
    that the reference was also drawn from (no change: any alert is a false one). ``site``: the reference, fixed
    over the years (the rate *given* that reference), or a :data:`SiteDraw` that gives each year a fresh reference
    and its ``draw`` (``draw`` then None: the rate over references too, which the stated bound is about;
    :func:`reference_splits` makes one from a site's calibration CTs). ``labelled``: the chunks' labels are known
    (rule 3 on too).

    Returns ``{"years", "years_with_alert", "rate", "ci" (Clopper-Pearson), "by_kind" (years with an alert of
    each kind), "chunk_rate" (share of chunks that alerted), "n_per_chunk", "chunks_per_year", "labelled",
    "fresh_reference"}``.
    """
    rng = np.random.default_rng(seed)
    fresh = not isinstance(site, Reference)
    make: SiteDraw
    if isinstance(site, Reference):
        if draw is None:
            raise ConfigError("a fixed reference needs the draw of its chunks", field="draw",
                              fix="pass draw, or a SiteDraw (reference_splits) as site")
        fixed: tuple[Reference, DrawFn] = (site, draw)
        make = lambda _g: fixed  # noqa: E731
    else:
        make = site
    years_with, by_kind = 0, {k: 0 for k in (SCANNER_SHIFT, PREVALENCE_SHIFT, "sensitivity", "observed_sensitivity")}
    chunks_alerting = 0
    for _ in range(n_years):
        reference, chunk_draw = make(rng)
        stats = []
        for _c in range(rule.chunks_per_year):
            scores, feats, p, y = chunk_draw(rng, n_per_chunk)
            stats.append(chunk_statistics(scores, p, threshold=threshold, rule=rule, site=reference,
                                          features=feats, labels=y if labelled else None, n_subsamples=n_subsamples,
                                          n_resamples=n_resamples, n_bootstrap=n_bootstrap, n_draws=n_draws,
                                          seed=int(rng.integers(2 ** 31))))
        alerts = run_alerts(stats, rule)
        chunks_alerting += sum(1 for a in alerts if a)
        kinds = {a["kind"] for chunk in alerts for a in chunk}
        years_with += bool(kinds)
        for k in kinds:
            by_kind[k] += 1
    return {"years": n_years, "years_with_alert": years_with, "rate": years_with / n_years if n_years else math.nan,
            "ci": clopper_pearson(years_with, n_years), "by_kind": by_kind,
            "chunk_rate": chunks_alerting / (n_years * rule.chunks_per_year) if n_years else math.nan,
            "n_per_chunk": n_per_chunk, "chunks_per_year": rule.chunks_per_year, "labelled": labelled,
            "fresh_reference": fresh}
