"""The binning contract of every binned measure: equal-width ``(lo, hi]`` bins over [0, 1], a confidence
of exactly 0 in the first bin, counts and sums accumulated in float64 (docs/architecture.md, "ECE")."""
from __future__ import annotations

import numpy as np

_NORMS = ("l1", "l2", "max")


def _bin_thresholds(n_bins: int, dtype) -> np.ndarray:
    """Interior edges of ``linspace(0, 1, n_bins + 1)`` (float64), as exact thresholds in ``dtype``.

    For a value x of ``dtype``: ``x > edge`` (compared exactly, in float64 or wider) iff
    ``x > thr`` where ``thr`` is the largest ``dtype`` value <= edge. So binning a float32
    confidence against float32 thresholds is bit-for-bit the float64 ``(lo, hi]`` rule, without
    a float64 copy and with half the memory traffic.
    """
    edges = np.linspace(0.0, 1.0, n_bins + 1)[1:-1]
    dtype = np.dtype(dtype)
    if dtype.kind != "f" or np.finfo(dtype).nmant >= np.finfo(np.float64).nmant:
        return edges.astype(np.result_type(dtype, np.float64))
    thr = edges.astype(dtype)
    above = thr.astype(np.float64) > edges
    thr[above] = np.nextafter(thr[above], dtype.type(-np.inf))
    return thr


def _bin_index(conf: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-width ``(lo, hi]`` bin of each confidence; 0 (and anything below the first edge)
    goes into bin 0, 1 (and the tolerated overshoot above it) into the last.

    Equals ``clip(searchsorted(linspace(0, 1, n_bins + 1), conf, "left") - 1, 0, n_bins - 1)``
    with float64 edges: one ``searchsorted`` of ``conf`` (in its own dtype) against the
    interior edges, which counts the edges strictly below each confidence.
    """
    if int(n_bins) != n_bins or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    return np.searchsorted(_bin_thresholds(int(n_bins), conf.dtype), conf, side="left")


def _binned_sums(conf: np.ndarray, hit: np.ndarray, n_bins: int):
    """Per-bin count, sum of confidences and sum of hits, all float64.

    ``hit`` is bool (or 0/1). Two ``bincount`` passes over the key ``2 * bin + hit``: one
    unweighted (count and hits), one weighted by the confidence (accumulated in float64).
    """
    key = _bin_index(conf, n_bins)
    key <<= 1
    key += hit.astype(np.int64, copy=False)
    m = 2 * int(n_bins)
    c2 = np.bincount(key, minlength=m).astype(np.float64)
    w2 = np.bincount(key, weights=conf, minlength=m)
    return c2[0::2] + c2[1::2], w2[0::2] + w2[1::2], c2[1::2]


def _gap_norm(count, s_conf, s_hit, n, norm: str):
    """Calibration error from per-bin sums; works on (..., n_bins) arrays (bootstrap rows)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        gap = np.abs(s_conf - s_hit) / count
    gap = np.where(count > 0, gap, 0.0)
    if norm == "l1":
        return (count * gap).sum(-1) / n
    if norm == "l2":
        return np.sqrt((count * gap**2).sum(-1) / n)
    if norm == "max":
        return gap.max(-1)
    raise ValueError(f"norm must be one of {_NORMS}, got {norm!r}")
