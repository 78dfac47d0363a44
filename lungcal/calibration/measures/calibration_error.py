"""Calibration errors: ECE (l1 / l2 / max), MCE, adaptive (equal-mass) ECE, class-wise ECE and the
per-bin statistics of a reliability diagram."""
from __future__ import annotations

import numpy as np

from lungcal.calibration.measures.binning import _bin_index, _binned_sums, _gap_norm
from lungcal.calibration.measures.inputs import _as_probs_labels, _confidence_correct, _confidence_hit

__all__ = ["ece", "mce", "adaptive_ece", "classwise_ece", "reliability_bins"]


def ece(probs, labels, n_bins: int = 15, norm: str = "l1", mode: str = "top_label") -> float:
    """Expected calibration error with equal-width ``(lo, hi]`` bins.

    ``ECE = sum_b |B_b|/N * |acc(B_b) - conf(B_b)|`` (``norm="l1"``); ``"l2"`` is the
    count-weighted root-mean-square gap and ``"max"`` the largest gap over non-empty bins (MCE).

    Args:
        probs: ``(N, C)`` probabilities, or ``(N,)`` p(y=1) for a binary task.
        labels: ``(N,)`` class indices.
        n_bins: number of equal-width bins over [0, 1].
        norm: ``"l1"``, ``"l2"`` or ``"max"``.
        mode: ``"top_label"`` (max-probability confidence vs. correctness of the argmax) or
            ``"positive_class"`` (p(y=1) vs. frequency of y=1; binary tasks only).

    Why this differs from torchmetrics at confidence 1.0: a confidence of exactly 1.0 belongs
    to the last bin ``(1 - 1/n_bins, 1]`` here (and in netcal, Guo et al., MiSLAS), whereas
    torchmetrics bins with ``bucketize(right=True)`` into ``[lo, hi)`` and so puts 1.0 into an
    extra bin of its own. For preds ``[0.95, 1.0]``, targets ``[1, 0]`` and 10 bins both samples
    share the bin (0.9, 1]: mean confidence 0.975, accuracy 0.5, ECE = 0.475. torchmetrics
    scores them apart: 0.5 * |0.95 - 1| + 0.5 * |1.0 - 0| = 0.525.

    Agreement with the peers: this equals netcal to 1e-6 (bins and float64 sums alike). It
    equals torchmetrics to 1e-6 on moderate N without confidences of 1.0, but on large inputs
    torchmetrics drifts: it casts the confidences to float32 (``confidences.float()``) and sums
    each bin with a float32 ``scatter_add_``, so a bin of ~10^5 samples loses ~1e-5 to
    rounding. Measured on 2,000,000 x 10 float32 probabilities (15 bins): no sample changes
    bin between its float32 bins and ours, our bins summed in float32 reproduce its value to
    3e-9, and the whole 1.48e-5 gap is that float32 accumulation (``scripts/bench_calibration.py``
    prints this check). Here confidences are binned exactly against the float64 edges in
    their own dtype and summed in float64.

    Returns:
        the calibration error as a Python float.
    """
    p, y = _as_probs_labels(probs, labels)
    conf, hit = _confidence_hit(p, y, mode)
    count, s_conf, s_hit = _binned_sums(conf, hit, n_bins)
    return float(_gap_norm(count, s_conf, s_hit, conf.shape[0], norm))


def mce(probs, labels, n_bins: int = 15, mode: str = "top_label") -> float:
    """Maximum calibration error: the largest ``|acc - conf|`` over non-empty bins
    (``ece(..., norm="max")``)."""
    return ece(probs, labels, n_bins=n_bins, norm="max", mode=mode)


def _adaptive_from_sorted(conf_sorted: np.ndarray, hit_sorted: np.ndarray, n_bins: int):
    """Equal-mass ECE on (..., N) arrays already sorted by confidence along the last axis."""
    n = conf_sorted.shape[-1]
    nb = int(min(n_bins, n))
    starts = (np.arange(nb) * n) // nb
    s_conf = np.add.reduceat(conf_sorted, starts, axis=-1)
    s_hit = np.add.reduceat(hit_sorted, starts, axis=-1)
    return np.abs(s_conf - s_hit).sum(-1) / n


def adaptive_ece(probs, labels, n_bins: int = 15, mode: str = "top_label") -> float:
    """Adaptive (equal-mass) ECE (Nixon et al. 2019): the samples sorted by confidence (stable
    sort) are cut into ``n_bins`` consecutive groups whose sizes differ by at most one (sample
    at sorted position j goes to group ``j * n_bins // N``); then ``sum_b |sum conf - sum hit| / N``.
    With fewer samples than bins, each sample is its own bin."""
    p, y = _as_probs_labels(probs, labels)
    conf, hit = _confidence_correct(p, y, mode)
    order = np.argsort(conf, kind="stable")
    return float(_adaptive_from_sorted(conf[order], hit[order], n_bins))


def _classwise_sums(p: np.ndarray, y: np.ndarray, n_bins: int):
    n, c = p.shape
    pf = p.astype(np.float64).ravel()  # row-major: sample-major, class-minor
    idx = _bin_index(pf, n_bins) + np.tile(np.arange(c) * n_bins, n)
    hit = (y[:, None] == np.arange(c)[None, :]).ravel().astype(np.float64)
    m = c * n_bins
    count = np.bincount(idx, minlength=m).astype(np.float64).reshape(c, n_bins)
    s_conf = np.bincount(idx, weights=pf, minlength=m).reshape(c, n_bins)
    s_hit = np.bincount(idx, weights=hit, minlength=m).reshape(c, n_bins)
    return idx, pf, hit, count, s_conf, s_hit


def classwise_ece(probs, labels, n_bins: int = 15) -> float:
    """Class-wise ECE (Kull et al. 2019; "SCE" of Nixon et al. 2019): for every class k the ECE of
    p_k against 1[y = k] with equal-width ``(lo, hi]`` bins, averaged over the C classes."""
    p, y = _as_probs_labels(probs, labels)
    *_, count, s_conf, s_hit = _classwise_sums(p, y, n_bins)
    return float(_gap_norm(count, s_conf, s_hit, p.shape[0], "l1").mean())


def reliability_bins(probs, labels, n_bins: int = 15, mode: str = "top_label") -> dict:
    """Per-bin statistics of the equal-width ``(lo, hi]`` binning used by :func:`ece`.

    Returns:
        dict with ``edges`` (n_bins + 1,), ``count`` (n_bins,) int, ``confidence`` and
        ``accuracy`` (n_bins,) float64 means (nan for empty bins), and ``ece`` (l1).
        In ``positive_class`` mode "accuracy" is the observed frequency of y = 1.
    """
    p, y = _as_probs_labels(probs, labels)
    conf, hit = _confidence_hit(p, y, mode)
    count, s_conf, s_hit = _binned_sums(conf, hit, n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.where(count > 0, s_conf / count, np.nan)
        mean_acc = np.where(count > 0, s_hit / count, np.nan)
    return {
        "edges": np.linspace(0.0, 1.0, int(n_bins) + 1),
        "count": count.astype(np.int64),
        "confidence": mean_conf,
        "accuracy": mean_acc,
        "ece": float(_gap_norm(count, s_conf, s_hit, conf.shape[0], "l1")),
    }
