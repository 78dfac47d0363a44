"""Significance tests: is a model miscalibrated on these data (:func:`ece_consistency_pvalue`, consistency
resampling), and is a difference between two models on the same cases real (:func:`paired_bootstrap_diff`)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lungcal.calibration.measures.binning import _bin_index, _gap_norm
from lungcal.calibration.measures.bootstrap import (
    BINARY_REPORT_METRICS,
    REPORT_METRICS,
    _bootstrap_replicates,
    _default_chunk,
    _index_chunks,
    _point_metrics,
)
from lungcal.calibration.measures.inputs import _as_probs_labels, _check_mode, _confidence_hit
from lungcal.errors import ConfigError, DataError

__all__ = ["ece_consistency_pvalue", "paired_bootstrap_diff"]


def ece_consistency_pvalue(probs, labels, n_bins: int = 15, n_resamples: int = 2000, seed: int = 0,
                           mode: str = "top_label") -> tuple[float, float]:
    """Is the model miscalibrated on these data? ECE and its consistency-resampling p-value.

    ECE is biased upwards on finite samples (a perfectly calibrated model scores ECE > 0, more so
    with few samples per bin), so two ECEs on splits of different sizes, or an ECE against 0, do
    not say whether a model is miscalibrated. Consistency resampling (Broecker & Smith 2007;
    Vaicenavicius et al. 2019) builds the null distribution directly: keep the confidences, draw
    the outcomes from them as if the model were calibrated (``hit* ~ Bernoulli(conf)``, which is
    ``P(y* = argmax)`` in top-label mode), and recompute the ECE with the same bins.

    Args:
        probs, labels, n_bins, mode: as for :func:`ece`.
        n_resamples: null draws (vectorised, in chunks).
        seed: RNG seed of the draws.

    Returns:
        ``(ece, p_value)`` with ``p = (1 + #{ECE* >= ECE}) / (1 + n_resamples)``: small when an
        ECE this large is unlikely for a calibrated model with these confidences.
    """
    p, y = _as_probs_labels(probs, labels)
    conf, hit = _confidence_hit(p, y, mode)
    conf = conf.astype(np.float64)
    n = conf.shape[0]
    onehot = np.zeros((n, int(n_bins)))
    onehot[np.arange(n), _bin_index(conf, n_bins)] = 1.0
    s_conf = conf @ onehot
    observed = float(_gap_norm(onehot.sum(0), s_conf, hit.astype(np.float64) @ onehot, n, "l1"))
    rng = np.random.default_rng(seed)
    chunk = max(1, min(int(n_resamples), 4_000_000 // max(n, 1)))
    exceed, done = 0, 0
    while done < n_resamples:
        r = min(chunk, int(n_resamples) - done)
        hits = (rng.random((r, n)) < conf).astype(np.float64)
        null = np.abs(s_conf - hits @ onehot).sum(-1) / n  # count * |gap| summed = |s_conf - s_hit|
        exceed += int((null >= observed - 1e-12).sum())
        done += r
    return observed, (1 + exceed) / (1 + int(n_resamples))


# ----------------------------------------------------------------------------- paired differences
def _resolve_metric(metric: str | Callable, n_classes: int) -> str | Callable:
    if callable(metric):
        return metric
    names = REPORT_METRICS + (BINARY_REPORT_METRICS if n_classes == 2 else ())
    if metric not in names:
        raise ConfigError(f"unknown metric {metric!r}", field="metric",
                          fix=f"pass a callable(probs, labels) or one of: {', '.join(names)}")
    return metric


def paired_bootstrap_diff(metric: str | Callable, probs_a, probs_b, labels, n_bootstrap: int = 1000,
                          seed: int = 0, alpha: float = 0.05, n_bins: int = 15,
                          mode: str = "top_label") -> dict:
    """Paired bootstrap of ``metric(A) - metric(B)`` for two models scored on the same cases.

    Every replicate resamples the cases (rows of ``probs_a``, ``probs_b`` and ``labels``
    together), so the CI accounts for the correlation between the two models' errors; it is
    much narrower than comparing two separate CIs. A named metric is computed for all replicates
    at once (the vectorised replicates of :func:`calibration_report`); a callable is called once
    per replicate and model. Replicates where either value is not finite are left out.

    Args:
        metric: a callable ``(probs, labels) -> float`` or the name of a report metric
            (:data:`REPORT_METRICS`; for binary tasks also :data:`BINARY_REPORT_METRICS`).
        probs_a, probs_b: probabilities of the two models, same shape (``(N, C)`` or ``(N,)``).
        labels: ``(N,)`` class indices.
        n_bootstrap: replicates; seed: their seed (same resamples as :func:`calibration_report`).
        alpha: the CI is the ``(alpha/2, 1 - alpha/2)`` percentile interval.
        n_bins, mode: binning and ECE mode of a named metric (ignored for a callable).

    Returns:
        dict with ``diff`` (metric(A) - metric(B) on all cases), ``ci_low``, ``ci_high``,
        ``p_value`` (two-sided percentile-bootstrap p-value,
        ``min(1, 2 * min(1 + #{d* <= 0}, 1 + #{d* >= 0}) / (1 + B))``), ``significant``
        (the CI excludes 0), ``n_bootstrap`` (replicates used), ``alpha`` and ``metric``.

    References:
        Efron, Tibshirani. "An Introduction to the Bootstrap." Chapman & Hall (1993), ch. 13
        and 16. https://doi.org/10.1201/9780429246593
    """
    pa, y = _as_probs_labels(probs_a, labels)
    pb, _ = _as_probs_labels(probs_b, labels)
    if pa.shape != pb.shape:
        raise DataError(f"probs_a has shape {pa.shape} but probs_b has {pb.shape}", field="probs_b",
                        fix="score both models on the same cases and classes")
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha}", field="alpha", fix="use e.g. 0.05")
    fn = _resolve_metric(metric, pa.shape[1])
    n = pa.shape[0]
    if callable(fn):
        diff = float(fn(pa, y)) - float(fn(pb, y))
    else:
        _check_mode(mode, pa.shape[1])
        diff = _point_metrics(pa, y, n_bins, mode)[fn] - _point_metrics(pb, y, n_bins, mode)[fn]
    reps = []
    if n_bootstrap > 0:
        chunk = _default_chunk(n, pa.shape[1])
        for idx in _index_chunks(np.random.default_rng(seed), n, int(n_bootstrap), chunk):
            if callable(fn):
                reps.append(np.array([float(fn(pa[i], y[i])) - float(fn(pb[i], y[i])) for i in idx]))
            else:
                reps.append(_bootstrap_replicates(pa, y, n_bins, mode, idx)[fn]
                            - _bootstrap_replicates(pb, y, n_bins, mode, idx)[fn])
    d = np.concatenate(reps) if reps else np.empty(0)
    d = d[np.isfinite(d)]
    if d.size:
        lo, hi = np.percentile(d, [100 * alpha / 2, 100 * (1 - alpha / 2)])
        below, above = int((d <= 0).sum()), int((d >= 0).sum())
        p_value = min(1.0, 2.0 * (1 + min(below, above)) / (1 + d.size))
    else:
        lo = hi = p_value = float("nan")
    return {"diff": float(diff), "ci_low": float(lo), "ci_high": float(hi), "p_value": float(p_value),
            "significant": bool(lo > 0 or hi < 0), "n_bootstrap": int(d.size), "alpha": float(alpha),
            "metric": fn if isinstance(fn, str) else getattr(fn, "__name__", "callable")}
