"""Every measure with a percentile-bootstrap CI (:func:`calibration_report`), its replicates vectorised.

The resamples are a (B, N) matrix of resampling counts per chunk; each measure is computed for all
rows at once (sparse products, sorts, one batched Newton fit), never by a per-replicate Python loop.
:mod:`.significance` reuses these replicates for paired differences.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from scipy import sparse

from lungcal.calibration._logistic import fit_logistic, fit_logistic_batch
from lungcal.calibration.measures.binning import _bin_index, _gap_norm
from lungcal.calibration.measures.calibration_error import (
    _adaptive_from_sorted,
    _classwise_sums,
    adaptive_ece,
    classwise_ece,
    ece,
    mce,
)
from lungcal.calibration.measures.clinical import LOGIT_EPS, _clipped_logit, calibration_slope_intercept, oe_ratio
from lungcal.calibration.measures.inputs import _as_probs_labels, _check_mode, _confidence_correct
from lungcal.calibration.measures.scores import _brier_per_sample, _nll_per_sample, accuracy, auroc, brier_score, nll

__all__ = ["calibration_report", "REPORT_METRICS", "BINARY_REPORT_METRICS"]

#: Metric keys of :func:`calibration_report` that carry a bootstrap CI.
REPORT_METRICS = (
    "acc", "auc", "ece", "mce", "adaptive_ece", "classwise_ece", "brier", "nll", "mean_confidence"
)
#: Keys :func:`calibration_report` adds, with their CIs, for binary tasks only (absent for C > 2).
BINARY_REPORT_METRICS = ("cal_slope", "cal_intercept", "oe_ratio")


def _clinical_replicates(p1: np.ndarray, y: np.ndarray, w: np.ndarray,
                         eps: float = LOGIT_EPS) -> dict[str, np.ndarray]:
    """Slope, intercept and O/E of every bootstrap replicate (rows of the (B, N) counts ``w``):
    one batched Newton fit for all replicates. Replicates with one class only are nan."""
    x = _clipped_logit(p1, eps)
    yf = y.astype(np.float64)
    events = w @ yf
    both = (events > 0) & (events < w.sum(1))
    a0, b0, _ = fit_logistic(x, yf)  # warm start: replicates lie near the full-data fit
    c0, _, _ = fit_logistic(x, yf, fit_slope=False)
    _, slope, _ = fit_logistic_batch(x, yf, w, start=(a0, b0))
    intercept, _, _ = fit_logistic_batch(x, yf, w, fit_slope=False, start=(c0, 1.0))
    with np.errstate(invalid="ignore", divide="ignore"):
        oe = events / (w @ p1)
    return {"cal_slope": np.where(both, slope, np.nan), "cal_intercept": np.where(both, intercept, np.nan),
            "oe_ratio": oe}


# ----------------------------------------------------------------------------- bootstrap report
def _onehot_sparse(col: np.ndarray, n_cols: int, values: np.ndarray | None = None):
    n = col.shape[0]
    data = np.ones(n) if values is None else values
    return sparse.csr_matrix((data, (np.arange(n), col)), shape=(n, n_cols))


def _auc_weighted(score: np.ndarray, pos: np.ndarray, w: np.ndarray) -> np.ndarray:
    """AUC of every bootstrap replicate at once. ``w`` is (B, N) resampling counts."""
    uniq, group = np.unique(score, return_inverse=True)
    g = uniq.shape[0]
    gp = _onehot_sparse(group[pos], g)
    gn = _onehot_sparse(group[~pos], g)
    posw = np.asarray((gp.T @ w[:, pos].T).T)  # (B, G): positive weight per score value
    negw = np.asarray((gn.T @ w[:, ~pos].T).T)
    neg_below = np.cumsum(negw, axis=1) - negw
    num = (posw * (neg_below + 0.5 * negw)).sum(1)
    den = posw.sum(1) * negw.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _bootstrap_replicates(p: np.ndarray, y: np.ndarray, n_bins: int, mode: str,
                          idx: np.ndarray) -> dict[str, np.ndarray]:
    """All report metrics for the resamples ``p[idx[b]]`` (idx is (B, N)), vectorised."""
    n, c = p.shape
    b = idx.shape[0]
    # resampling counts: w[b, i] = how often sample i is drawn in replicate b
    w = np.bincount((idx + (np.arange(b) * n)[:, None]).ravel(), minlength=b * n)
    w = w.reshape(b, n).astype(np.float64)
    conf, hit = _confidence_correct(p, y, mode)
    out: dict[str, np.ndarray] = {}
    pred_hit = (p.argmax(1) == y).astype(np.float64)
    dense = np.stack([pred_hit, _brier_per_sample(p, y), _nll_per_sample(p, y), conf], axis=1)
    means = (w @ dense) / n
    out["acc"], out["brier"], out["nll"], out["mean_confidence"] = means.T
    # equal-width ECE / MCE: per-sample bin is fixed, only the weights change
    bins = _bin_index(conf, n_bins)
    count = np.asarray((_onehot_sparse(bins, n_bins).T @ w.T).T)
    s_conf = np.asarray((_onehot_sparse(bins, n_bins, conf).T @ w.T).T)
    s_hit = np.asarray((_onehot_sparse(bins, n_bins, hit).T @ w.T).T)
    out["ece"] = _gap_norm(count, s_conf, s_hit, n, "l1")
    out["mce"] = _gap_norm(count, s_conf, s_hit, n, "max")
    # class-wise ECE
    cidx, pf, chit, *_ = _classwise_sums(p, y, n_bins)
    m = c * n_bins
    rows_w = np.repeat(w, c, axis=1)  # (B, N*C) weights of the flattened (sample, class) entries
    cc = np.asarray((_onehot_sparse(cidx, m).T @ rows_w.T).T).reshape(b, c, n_bins)
    cs = np.asarray((_onehot_sparse(cidx, m, pf).T @ rows_w.T).T).reshape(b, c, n_bins)
    ch = np.asarray((_onehot_sparse(cidx, m, chit).T @ rows_w.T).T).reshape(b, c, n_bins)
    out["classwise_ece"] = _gap_norm(cc, cs, ch, n, "l1").mean(-1)
    # adaptive ECE: sort each resample by confidence (ranks of a stable sort of the full data)
    order = np.argsort(conf, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    r = np.sort(rank[idx], axis=1)
    out["adaptive_ece"] = _adaptive_from_sorted(conf[order][r], hit[order][r], n_bins)
    # AUC (and, for binary tasks, the clinical measures)
    if c == 2:
        out["auc"] = _auc_weighted(p[:, 1], y == 1, w)
        out.update(_clinical_replicates(p[:, 1].astype(np.float64), y, w))
    else:
        per = np.stack([_auc_weighted(p[:, k], y == k, w) for k in range(c)], axis=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-nan rows -> nan
            out["auc"] = np.nanmean(per, axis=1)
    return out


def _index_chunks(rng: np.random.Generator, n: int, n_bootstrap: int, chunk: int):
    """Bootstrap index matrices ``(bsz, n)`` (with replacement), ``n_bootstrap`` rows in all."""
    done = 0
    while done < n_bootstrap:
        bsz = min(chunk, n_bootstrap - done)
        yield rng.integers(0, n, size=(bsz, n))
        done += bsz


def _default_chunk(n: int, c: int) -> int:
    return max(1, int(4e6 // (n * max(c, 2))))


def _point_metrics(p: np.ndarray, y: np.ndarray, n_bins: int, mode: str) -> dict[str, float]:
    conf, _ = _confidence_correct(p, y, mode)
    out = {
        "acc": accuracy(p, y),
        "auc": auroc(p, y),
        "ece": ece(p, y, n_bins, "l1", mode),
        "mce": mce(p, y, n_bins, mode),
        "adaptive_ece": adaptive_ece(p, y, n_bins, mode),
        "classwise_ece": classwise_ece(p, y, n_bins),
        "brier": brier_score(p, y),
        "nll": nll(p, y),
        "mean_confidence": float(conf.mean()),
    }
    if p.shape[1] == 2:
        out["cal_slope"], out["cal_intercept"] = calibration_slope_intercept(p, y)
        out["oe_ratio"] = oe_ratio(p, y)
    return out


def calibration_report(probs, labels, n_bins: int = 15, n_bootstrap: int = 1000, seed: int = 0,
                       mode: str = "top_label", chunk_size: int | None = None) -> dict:
    """Every metric of this module with a 95% percentile-bootstrap CI.

    The ``n_bootstrap`` resamples (with replacement, ``numpy.random.default_rng(seed)``) are
    evaluated in chunks of ``chunk_size`` replicates at once: each chunk is a (B, N) matrix of
    resampling counts, and every metric is computed for all its rows by sparse products, sorts
    and one batched Newton fit (slope / intercept), never by a per-replicate Python loop.
    Replicates where a metric is undefined (AUC, slope or intercept of a resample with a single
    class) are left out of that metric's percentiles.

    Args:
        probs: ``(N, C)`` probabilities or ``(N,)`` p(y=1).
        labels: ``(N,)`` class indices.
        n_bins: equal-width bins for ``ece``/``mce``/``classwise_ece``; equal-mass bins for
            ``adaptive_ece``.
        n_bootstrap: number of bootstrap replicates (0 skips the CIs; they are then nan).
        seed: seed of the resampling.
        mode: ``"top_label"`` or ``"positive_class"``: applies to ece, mce, adaptive_ece and
            mean_confidence; recorded as ``ece_mode``. The clinical measures always use p(y=1).
        chunk_size: replicates per chunk (default: about 4e6 / (N * C), at least 1).

    Returns:
        dict with ``acc, auc, ece, mce, adaptive_ece, classwise_ece, brier, nll,
        mean_confidence`` (:data:`REPORT_METRICS`), for binary tasks also ``cal_slope,
        cal_intercept, oe_ratio`` (:data:`BINARY_REPORT_METRICS`), for each ``{key}_ci_low`` and
        ``{key}_ci_high``, and ``n``, ``n_bins``, ``ece_mode``. All values are Python floats /
        ints / str.
    """
    p, y = _as_probs_labels(probs, labels)
    _check_mode(mode, p.shape[1])
    n = p.shape[0]
    report: dict[str, Any] = _point_metrics(p, y, n_bins, mode)
    keys = REPORT_METRICS + (BINARY_REPORT_METRICS if p.shape[1] == 2 else ())
    reps: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    if n_bootstrap > 0:
        chunk = chunk_size or _default_chunk(n, p.shape[1])
        for idx in _index_chunks(np.random.default_rng(seed), n, int(n_bootstrap), chunk):
            for k, v in _bootstrap_replicates(p, y, n_bins, mode, idx).items():
                reps[k].append(v)
    for k in keys:
        vals = np.concatenate(reps[k]) if reps[k] else np.empty(0)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            lo, hi = np.percentile(vals, [2.5, 97.5])
        else:
            lo = hi = float("nan")
        report[f"{k}_ci_low"], report[f"{k}_ci_high"] = float(lo), float(hi)
    report.update(n=int(n), n_bins=int(n_bins), ece_mode=mode)
    return report
