"""Significance tests: is a model miscalibrated on these data (:func:`ece_consistency_pvalue`, consistency
resampling), is a difference between two models on the same cases real (:func:`paired_bootstrap_diff`), and
is a difference between two training routes real over repeated trainings as well as over the test cases
(:func:`draws_bootstrap_diff`, a two-level bootstrap)."""
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

__all__ = ["ece_consistency_pvalue", "paired_bootstrap_diff", "draws_bootstrap_diff"]


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
    return {**_percentile_summary(diff, d, alpha),
            "metric": fn if isinstance(fn, str) else getattr(fn, "__name__", "callable")}


# ----------------------------------------------------------------------------- over repeated trainings
def _draw_stack(probs, labels, name: str, binary: bool, like: tuple | None = None) -> list[np.ndarray]:
    """``(D, N[, C])`` as D validated ``(N, C)`` arrays; ``binary`` (from ``probs_a``) says whether the last
    axis is the cases (True: ``(D, N)``) or the classes (False: ``(D, N, C)``)."""
    arr = np.asarray(probs)
    want = 2 if binary else 3
    if arr.ndim == want - 1:  # one fixed model: (N,) or (N, C)
        arr = arr[None]
    if arr.ndim != want or arr.shape[0] == 0:
        raise DataError(f"{name} must be (D, N) for a binary task or (D, N, C): D trainings scored on the same N "
                        f"cases, got shape {tuple(arr.shape)}", field=name,
                        fix="stack each draw's test probabilities along a first axis (np.stack(per_draw))")
    if like is not None and arr.shape[1:] != like:
        raise DataError(f"probs_a scores {like} per draw but {name} {tuple(arr.shape[1:])}", field=name,
                        fix="score both arms on the same test cases and classes")
    return [_as_probs_labels(arr[d], labels)[0] for d in range(arr.shape[0])]


def _percentile_summary(point: float, d: np.ndarray, alpha: float) -> dict:
    d = d[np.isfinite(d)]
    if d.size:
        lo, hi = np.percentile(d, [100 * alpha / 2, 100 * (1 - alpha / 2)])
        below, above = int((d <= 0).sum()), int((d >= 0).sum())
        p_value = min(1.0, 2.0 * (1 + min(below, above)) / (1 + d.size))
    else:
        lo = hi = p_value = float("nan")
    return {"diff": float(point), "ci_low": float(lo), "ci_high": float(hi), "p_value": float(p_value),
            "significant": bool(lo > 0 or hi < 0), "n_bootstrap": int(d.size), "alpha": float(alpha)}


def draws_bootstrap_diff(metric: str | Callable, probs_a, probs_b, labels, n_bootstrap: int = 1000,
                         seed: int = 0, alpha: float = 0.05, n_bins: int = 15,
                         mode: str = "top_label") -> dict:
    """Two-level bootstrap of ``mean_d metric(A_d) - mean_d metric(B_d)`` over repeated trainings and test cases.

    One training of a route on one draw of labelled cases is one sample of that route: another draw, or
    another seed, gives another model. ``probs_a`` holds D such trainings, all scored on the same N test
    cases. Each replicate resamples the test cases (with replacement, the same case indices for every draw
    and both arms) **and** the draws (D with replacement; the same draw indices for both arms when they are
    paired by draw, i.e. draw ``d`` of A and of B were trained on the same labelled cases), so the CI covers
    the training noise across draws as well as the test sampling. With D = 1 it is
    :func:`paired_bootstrap_diff` (the same case resamples, the same interval). A named metric is computed for
    all replicates of a chunk at once per draw; a callable is called once per replicate, draw and arm.
    Replicates where the value is not finite are left out.

    Args:
        metric: a callable ``(probs, labels) -> float`` or the name of a report metric (as for
            :func:`paired_bootstrap_diff`).
        probs_a: ``(D, N)`` (binary, p(y=1)) or ``(D, N, C)``: D trainings on the same N cases.
        probs_b: ``(D, N[, C])`` (paired with A by draw), ``(1, N[, C])`` or ``(N[, C])`` (one fixed model,
            e.g. the shipped one, the same in every replicate), or None: then the result is the mean over
            draws of ``metric(A)`` with its CI (``diff`` is that mean; its ``p_value`` tests it against 0).
        labels: ``(N,)`` class indices.
        n_bootstrap, seed, alpha, n_bins, mode: as for :func:`paired_bootstrap_diff` (the case resamples come
            from the same stream; the draw resamples from a second stream of ``seed``).

    Returns:
        the keys of :func:`paired_bootstrap_diff` (``diff`` = mean over draws of metric(A) minus that of B)
        and ``n_draws`` (D).

    References:
        Davison, Hinkley. "Bootstrap Methods and their Application." Cambridge (1997), sec. 3.8 (hierarchical
        data: resampling at both stages). https://doi.org/10.1017/CBO9780511802843
    """
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha}", field="alpha", fix="use e.g. 0.05")
    arr_a = np.asarray(probs_a)
    if arr_a.ndim not in (2, 3):
        raise DataError(f"probs_a must be (D, N) for a binary task or (D, N, C), got shape {tuple(arr_a.shape)}",
                        field="probs_a", fix="stack each draw's test probabilities along a first axis; "
                        "for one model use paired_bootstrap_diff or pass probs_a[None]")
    binary = arr_a.ndim == 2
    a = _draw_stack(arr_a, labels, "probs_a", binary)
    _, y = _as_probs_labels(a[0], labels)
    b = _draw_stack(probs_b, labels, "probs_b", binary, arr_a.shape[1:]) if probs_b is not None else []
    n_draws = len(a)
    if b and len(b) not in (1, n_draws):
        raise DataError(f"probs_a has {n_draws} draws but probs_b {len(b)}", field="probs_b",
                        fix="pass probs_b paired by draw (the same D) or one fixed model ((N[, C]) or (1, N[, C]))")
    fn = _resolve_metric(metric, a[0].shape[1])
    if not callable(fn):
        _check_mode(mode, a[0].shape[1])

    def point(p: np.ndarray) -> float:
        return float(fn(p, y)) if callable(fn) else float(_point_metrics(p, y, n_bins, mode)[fn])

    diff = float(np.mean([point(p) for p in a])) - (float(np.mean([point(p) for p in b])) if b else 0.0)
    n = y.shape[0]
    reps = []
    if n_bootstrap > 0:
        chunk = _default_chunk(n, a[0].shape[1])
        draw_rng = np.random.default_rng([int(seed), 1])

        def per_draw(stack: list[np.ndarray], idx: np.ndarray) -> np.ndarray:  # (len(stack), bsz)
            if callable(fn):
                return np.array([[float(fn(p[i], y[i])) for i in idx] for p in stack])
            return np.stack([_bootstrap_replicates(p, y, n_bins, mode, idx)[fn] for p in stack])

        for idx in _index_chunks(np.random.default_rng(seed), n, int(n_bootstrap), chunk):
            bsz = idx.shape[0]
            pick = draw_rng.integers(0, n_draws, size=(bsz, n_draws))  # (bsz, D) draw indices
            cols = np.arange(bsz)[:, None]
            rep = per_draw(a, idx).T[cols, pick].mean(1)
            if b:
                mb = per_draw(b, idx).T  # (bsz, D or 1)
                rep = rep - (mb[cols, pick].mean(1) if len(b) == n_draws else mb[:, 0])
            reps.append(rep)
    d = np.concatenate(reps) if reps else np.empty(0)
    out = _percentile_summary(diff, d, alpha)
    out.update(metric=fn if isinstance(fn, str) else getattr(fn, "__name__", "callable"), n_draws=n_draws)
    return out
