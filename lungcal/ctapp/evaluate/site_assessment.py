"""The statistics and verdict of a site check, on scores already computed: what ``lungcal site-check`` decides
(:mod:`lungcal.ctapp.site.site_check`, which reads the CTs, scores them and logs the run) and what ``lungcal
predict --site`` asks of a batch of new CTs against the site's own calibration CTs
(:mod:`lungcal.ctapp.infer.inference`). Pure: no I/O, no model; the method is in the site check's docstring.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lungcal.calibration.shift import (
    ShiftTest,
    bbse_prevalence,
    domain_effect,
    ks_permutation_test,
    label_shift_test,
    prevalence_interval,
    range_test,
    reduce_features,
)
from lungcal.ct.acquisition import ACQUISITION_FIELDS, AcquisitionStats, training_range
from lungcal.errors import ConfigError, DataError

__all__ = ["COMPARABLE", "PREVALENCE_SHIFT", "SCANNER_SHIFT", "VERDICTS", "MIN_SITE_CTS", "MIN_REFERENCE_PER_CLASS",
           "Reference", "acquisition_checks", "assess"]

COMPARABLE, PREVALENCE_SHIFT, SCANNER_SHIFT = "comparable", "prevalence_shift", "scanner_shift"
VERDICTS = (COMPARABLE, PREVALENCE_SHIFT, SCANNER_SHIFT)
#: the fewest site CTs (passing the series checks) a check is run on. At 20 CTs against a 200-case
#: reference, only a KS distance above about 0.32 can reach p < 0.05 (1.36 sqrt(1/20 + 1/200)), i.e.
#: a gross change; below that, "comparable" would mean "too few to tell".
MIN_SITE_CTS = 20
#: the fewest reference cases of each label
MIN_REFERENCE_PER_CLASS = 10


@dataclass
class Reference:
    """The source side: the network's scores, labels and bag embeddings on held-out cases of its own data."""

    scores: np.ndarray
    labels: np.ndarray
    features: np.ndarray | None
    source: str

    def check(self) -> Reference:
        counts = [int((self.labels == c).sum()) for c in (0, 1)]
        if min(counts) < MIN_REFERENCE_PER_CLASS:
            raise DataError(f"the reference holds {counts[1]} cancer and {counts[0]} other cases",
                            field="reference",
                            fix=f"a site check needs at least {MIN_REFERENCE_PER_CLASS} of each in the model's "
                                "validation split; pass --reference with a larger datalist")
        return self


def acquisition_checks(summary: Mapping[str, Any] | None,
                       stats: Sequence[AcquisitionStats | None]) -> dict[str, dict[str, Any]]:
    """Per acquisition field: the training range (1st-99th percentile, widened by the tolerance), the site's
    median, how many site CTs lie outside it and the binomial p-value (:func:`range_test`). Fields the
    summary or the site lacks are left out."""
    if summary is None:
        return {}
    out = {}
    for name in ACQUISITION_FIELDS:
        rng = training_range(summary, name, central=True)
        values = np.array([getattr(a, name) for a in stats if a is not None], float)
        values = values[np.isfinite(values)]
        if rng is None or values.size < 2:
            continue
        outside, n, p = range_test(values, *rng)
        train = (summary.get("fields") or {}).get(name) or {}
        out[name] = {"training_low": rng[0], "training_high": rng[1], "training_median":
                     (train.get("quantiles") or {}).get("0.5"), "site_median": float(np.median(values)),
                     "outside": outside, "n": n, "pvalue": p}
    return out


def assess(reference: Reference, scores: np.ndarray, features: np.ndarray | None,
           acquisition: Mapping[str, Mapping[str, Any]], *, alpha: float = 0.05, n_resamples: int = 1000,
           n_subsamples: int = 20, n_bootstrap: int = 1000, seed: int = 0,
           prevalence_level: float = 0.95, effect_size: bool = True) -> dict[str, Any]:
    """The statistics and the verdict of a site (everything but the I/O of :func:`site_check`).

    ``prevalence_level``: the level of the prevalence's bootstrap interval that can call ``prevalence_shift``
    (``lungcal monitor`` sets it to one minus its per-chunk alpha).

    ``effect_size``: False leaves the effect size out (``"effect"`` None): the verdict does not use it, and it
    is a third of the time of a check with embeddings (``experiments/site_check_power.py`` draws verdicts only).

    Returns ``{"verdict", "reasons", "tests", "prevalence", "prevalence_ci", "source_prevalence"}``.
    """
    family_size = (3 if features is not None and reference.features is not None else 2) - 1 + len(acquisition)
    level = alpha / max(1, family_size)  # Bonferroni over the scanner-change family
    # the smallest merged p-value is 2 / (n_resamples + 1): it must be able to fall below the level
    if 2.0 / (n_resamples + 1) >= level:
        raise ConfigError(f"{n_resamples} permutations cannot reach the level {level:.2g} (alpha {alpha:g} over "
                          f"{family_size} tests)", field="--permutations",
                          fix=f"use at least {math.ceil(2.0 / level) * 2} permutations (the default is 1000)")
    s_ref, y_ref = np.asarray(reference.scores, float), np.asarray(reference.labels).astype(int)
    scores = np.asarray(scores, float)
    q = bbse_prevalence(s_ref, y_ref, scores)
    q_ci = prevalence_interval(s_ref, y_ref, scores, n_bootstrap=n_bootstrap, level=prevalence_level, seed=seed)
    source_q = float(y_ref.mean())
    tests: dict[str, ShiftTest] = {
        "outputs_any_change": ks_permutation_test(s_ref, scores, n_resamples=n_resamples, seed=seed),
        "outputs_beyond_prevalence": label_shift_test(s_ref, y_ref, scores, prevalence=q if math.isfinite(q) else None,
                                                      n_subsamples=n_subsamples, n_resamples=n_resamples,
                                                      seed=seed),
    }
    if features is not None and reference.features is not None:
        a, b = reduce_features(reference.features, features)
        tests["embeddings_beyond_prevalence"] = label_shift_test(
            s_ref, y_ref, scores, prevalence=q if math.isfinite(q) else None, n_subsamples=n_subsamples,
            n_resamples=n_resamples, seed=seed, source_features=a, target_features=b)
    effect = None
    if effect_size and features is not None and reference.features is not None and len(features) >= 2:
        # the size beside the p-values: how well the embeddings tell the site from the reference, the reference
        # re-weighted to the site's estimated prevalence (a change of prevalence alone is no difference)
        qq = q if math.isfinite(q) else source_q
        w = np.where(y_ref == 1, qq / max(source_q, 1e-9), (1 - qq) / max(1 - source_q, 1e-9))
        effect = domain_effect(reference.features, features, source_weights=w, alpha=alpha, seed=seed)
    reasons = []
    for name, t in tests.items():
        if name.endswith("beyond_prevalence") and t.pvalue < level:
            reasons.append(f"{name.replace('_', ' ')}: p = {t.pvalue:.3g} < {level:.3g}")
    for name, acq in acquisition.items():
        if acq["pvalue"] < level:
            reasons.append(f"{name}: {acq['outside']}/{acq['n']} CTs outside the training range "
                           f"[{acq['training_low']:.3g}, {acq['training_high']:.3g}] "
                           f"(median {acq['site_median']:.3g}), p = {acq['pvalue']:.3g} < {level:.3g}")
    if reasons:
        verdict = SCANNER_SHIFT
    else:
        moved = tests["outputs_any_change"].pvalue < alpha
        excluded = all(map(math.isfinite, q_ci)) and not q_ci[0] <= source_q <= q_ci[1]
        if moved or excluded:
            verdict = PREVALENCE_SHIFT
            if moved:
                reasons.append(f"the outputs moved (p = {tests['outputs_any_change'].pvalue:.3g} < {alpha:g}), "
                               "as a change of prevalence alone explains")
            if excluded:
                reasons.append(f"estimated prevalence {q:.2f} [{q_ci[0]:.2f}, {q_ci[1]:.2f}] excludes the "
                               f"model's {source_q:.2f}")
        else:
            verdict = COMPARABLE
    return {"verdict": verdict, "reasons": reasons, "tests": {k: {**t.as_dict(), "level": (
        level if k.endswith("beyond_prevalence") else alpha)} for k, t in tests.items()},
            "prevalence": q, "prevalence_ci": q_ci, "source_prevalence": source_q, "level": level,
            "effect": None if effect is None else effect.as_dict()}
