"""Calibration and discrimination metrics (numpy / torch inputs, float64 accumulation).

Conventions shared by every function here:

* ``probs`` is ``(N, C)`` class probabilities, or ``(N,)`` = p(y=1) of a binary task (read as
  ``[1 - p, p]``). Metrics never take logits; inputs outside [0, 1] raise
  :class:`lungcal.errors.DataError`.
* ``labels`` is ``(N,)`` integer class indices (``(N, 1)`` and integral floats are accepted).
* The predicted class is ``argmax`` over classes (ties -> lowest index; for ``(N,)`` input
  p = 0.5 predicts class 0).
* **Binning** (``ece``, ``mce``, ``classwise_ece``, ``reliability_bins``): ``n_bins`` equal-width
  bins over [0, 1], each bin is ``(lo, hi]`` and a confidence of exactly 0 goes into the first
  bin (Guo et al. 2017; MiSLAS). This equals netcal's ECE. torchmetrics differs: its bins are
  ``[lo, hi)`` with a confidence of exactly 1.0 put into an extra (n_bins + 1)-th bin, so
  saturated predictions are scored against themselves alone (see :func:`ece`).
* ``mode="top_label"`` (default) measures the reliability of the top-label confidence
  ``max_k p_k``; ``mode="positive_class"`` (binary tasks only) measures the reliability of
  p(y=1) against the frequency of y = 1.

All binning uses ``np.searchsorted`` + ``np.bincount``: no per-sample Python loops.

Clinical calibration measures (binary tasks, on p(y=1)): :func:`calibration_slope_intercept`
and :func:`oe_ratio` (Van Calster et al. 2019). :func:`calibration_report` gives every metric with
a percentile-bootstrap CI; :func:`paired_bootstrap_diff` the CI of a difference between two
models on the same cases.

This module is longer than the house ~400 lines on purpose: every metric, its vectorised
bootstrap replicate and the report share the input conventions and binning helpers above, and
splitting them would split each metric from its bootstrap twin.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from scipy import sparse
from scipy.stats import rankdata

from lungcal.calibration._logistic import fit_logistic, fit_logistic_batch
from lungcal.errors import ConfigError, DataError

__all__ = [
    "ece",
    "mce",
    "adaptive_ece",
    "classwise_ece",
    "brier_score",
    "nll",
    "accuracy",
    "auroc",
    "reliability_bins",
    "calibration_slope_intercept",
    "oe_ratio",
    "calibration_report",
    "paired_bootstrap_diff",
    "ece_consistency_pvalue",
    "REPORT_METRICS",
    "BINARY_REPORT_METRICS",
]

_MODES = ("top_label", "positive_class")
_NORMS = ("l1", "l2", "max")
#: Metric keys of :func:`calibration_report` that carry a bootstrap CI.
REPORT_METRICS = (
    "acc", "auc", "ece", "mce", "adaptive_ece", "classwise_ece", "brier", "nll", "mean_confidence"
)
#: Keys :func:`calibration_report` adds, with their CIs, for binary tasks only (absent for C > 2).
BINARY_REPORT_METRICS = ("cal_slope", "cal_intercept", "oe_ratio")
_PROB_TOL = 1e-6
#: p(y=1) is clipped to [eps, 1 - eps] before the logit of the calibration slope / intercept.
LOGIT_EPS = 1e-8


# ----------------------------------------------------------------------------- input handling
def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _as_probs_labels(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate and return ``(P (N, C) float, y (N,) int64)``; ``(N,)`` input becomes ``(N, 2)``.

    The float dtype of ``probs`` is kept (float32 stays float32); accumulations upcast later.
    """
    p = _to_numpy(probs)
    y = _to_numpy(labels)
    if not np.issubdtype(p.dtype, np.floating):
        p = p.astype(np.float64)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if p.ndim == 2 and p.shape[1] == 1:
        p = p[:, 0]
    if y.ndim != 1:
        raise DataError(f"labels must be 1-D class indices, got shape {tuple(y.shape)}",
                        field="labels", fix="pass integer class indices of shape (N,), not one-hot")
    if p.ndim == 1:
        p = np.stack([1.0 - p, p], axis=1)
    elif p.ndim != 2:
        raise DataError(f"probs must be (N, C) or (N,), got shape {tuple(p.shape)}", field="probs",
                        fix="flatten extra dimensions so that probs is (N, C)")
    if p.shape[0] != y.shape[0]:
        raise DataError(f"probs has {p.shape[0]} rows but labels has {y.shape[0]}", field="labels",
                        fix="pass one label per row of probs")
    if p.shape[0] == 0:
        raise DataError("no samples", field="probs", fix="pass at least one sample")
    if np.issubdtype(y.dtype, np.floating):
        if not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
            raise DataError("labels are not integral", field="labels", fix="pass class indices")
    y = y.astype(np.int64, copy=False)
    lo, hi = y.min(), y.max()
    if lo < 0 or hi >= p.shape[1]:
        raise DataError(f"labels span [{lo}, {hi}] but probs has {p.shape[1]} classes",
                        field="labels", fix="labels must be in [0, C) for probs of shape (N, C)")
    pmin, pmax = p.min(), p.max()
    if not (np.isfinite(pmin) and np.isfinite(pmax)) or pmin < -_PROB_TOL or pmax > 1 + _PROB_TOL:
        raise DataError(
            f"probs must be probabilities in [0, 1], got values in [{pmin:.4g}, {pmax:.4g}]",
            field="probs", fix="apply softmax (or sigmoid) to logits before computing metrics",
        )
    return p, y


def _check_mode(mode: str, n_classes: int) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "positive_class" and n_classes != 2:
        raise DataError(f"mode='positive_class' needs a binary task, got {n_classes} classes",
                        field="mode", fix="use mode='top_label' (or classwise_ece) for C > 2")


def _top_label(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-label confidence (in ``p``'s dtype) and prediction (ties -> lowest index), one pass.

    ``torch.max(dim=1)`` on a zero-copy view returns values and indices together (and runs
    multithreaded); torch documents that the first maximal index is returned. Arrays torch
    cannot view (negative strides, non-native byte order) take the numpy path.
    """
    try:
        t = torch.from_numpy(p)
    except (TypeError, ValueError, RuntimeError):
        pred = p.argmax(axis=1)
        return np.take_along_axis(p, pred[:, None], axis=1)[:, 0], pred
    conf, pred = t.max(dim=1)
    return conf.numpy(), pred.numpy()


def _confidence_hit(p: np.ndarray, y: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample confidence (``p``'s dtype, no copy of the (N, C) array) and hit (bool)."""
    _check_mode(mode, p.shape[1])
    if mode == "positive_class":
        return p[:, 1], y == 1
    conf, pred = _top_label(p)
    return conf, pred == y


def _confidence_correct(p: np.ndarray, y: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample confidence (float64) and 'hit' (float64 0/1) for the given mode."""
    conf, hit = _confidence_hit(p, y, mode)
    return conf.astype(np.float64), hit.astype(np.float64)


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


# ----------------------------------------------------------------------------- public metrics
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


def _brier_per_sample(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    p64 = p.astype(np.float64)
    if p.shape[1] == 2:
        return (p64[:, 1] - (y == 1)) ** 2
    onehot = np.zeros_like(p64)
    onehot[np.arange(p.shape[0]), y] = 1.0
    return ((p64 - onehot) ** 2).sum(1)


def brier_score(probs, labels) -> float:
    """Brier score, as in scikit-learn's ``brier_score_loss``.

    Binary tasks (``(N,)`` or ``(N, 2)`` input): ``mean((p1 - y)^2)``, in [0, 1].
    Multi-class: ``mean(sum_k (p_k - 1[y=k])^2)``, in [0, 2] (the original Brier 1950 score).
    """
    p, y = _as_probs_labels(probs, labels)
    return float(_brier_per_sample(p, y).mean())


_NLL_EPS = 1e-12


def _nll_per_sample(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    py = np.take_along_axis(p, y[:, None], axis=1)[:, 0].astype(np.float64)
    return -np.log(np.clip(py, _NLL_EPS, 1.0))


def nll(probs, labels) -> float:
    """Mean negative log-likelihood ``-mean(log p_y)`` (natural log; p_y clipped at 1e-12)."""
    p, y = _as_probs_labels(probs, labels)
    return float(_nll_per_sample(p, y).mean())


def accuracy(probs, labels) -> float:
    """Fraction of samples whose argmax class equals the label."""
    p, y = _as_probs_labels(probs, labels)
    return float((_top_label(p)[1] == y).mean())


def _auc_from_scores(score: np.ndarray, pos: np.ndarray) -> float:
    """Mann-Whitney AUC with average ranks for ties; nan when one class is absent."""
    n1 = int(pos.sum())
    n0 = pos.shape[0] - n1
    if n1 == 0 or n0 == 0:
        return float("nan")
    r = rankdata(score, method="average")
    return float((r[pos].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0))


def auroc(probs, labels) -> float:
    """Area under the ROC curve via rank statistics (ties count one half).

    Binary tasks (``(N,)`` or ``(N, 2)``): AUC of p(y=1). Multi-class: macro average of the
    one-vs-rest AUCs of p_k (as scikit-learn's ``multi_class="ovr", average="macro"``).
    Returns nan when AUC is undefined (a binary label set with one class); classes absent from
    ``labels`` are left out of the macro average.
    """
    p, y = _as_probs_labels(probs, labels)
    if p.shape[1] == 2:
        return _auc_from_scores(p[:, 1], y == 1)
    vals = np.array([_auc_from_scores(p[:, k], y == k) for k in range(p.shape[1])])
    return float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")


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


# ----------------------------------------------------------------------------- clinical measures
def _binary_positive(probs, labels, what: str) -> tuple[np.ndarray, np.ndarray]:
    """p(y=1) as float64 and labels of a binary task; DataError for C > 2."""
    p, y = _as_probs_labels(probs, labels)
    if p.shape[1] != 2:
        raise DataError(f"{what} needs a binary task, got {p.shape[1]} classes", field="probs",
                        fix="pass (N,) p(y=1) or (N, 2) probabilities of a binary task")
    return p[:, 1].astype(np.float64), y


def _clipped_logit(p1: np.ndarray, eps: float) -> np.ndarray:
    q = np.clip(p1, eps, 1.0 - eps)
    return np.log(q) - np.log1p(-q)


def calibration_slope_intercept(probs, labels, eps: float = LOGIT_EPS) -> tuple[float, float]:
    """Calibration slope and calibration intercept (calibration-in-the-large) of p(y=1).

    With ``x = logit(clip(p, eps, 1 - eps))``:

    * slope = b of the logistic fit ``logit P(y=1) = a + b x`` (1 when calibrated; < 1 means
      predictions too extreme, > 1 too modest);
    * intercept = a' of the fit ``logit P(y=1) = a' + x`` (x as an offset, slope fixed at 1);
      0 when calibrated in the large, < 0 when the model over-predicts the event rate.

    Both are maximum-likelihood fits by Newton's method in float64 (:mod:`._logistic`). Under
    separation (the x-ranges of events and non-events do not overlap) the slope has no finite
    MLE: the iterations are capped and the last iterate is returned.

    Args:
        probs: ``(N,)`` p(y=1) or ``(N, 2)`` probabilities (binary tasks only).
        labels: ``(N,)`` 0/1 labels.
        eps: clipping of p before the logit (p of exactly 0 or 1 would give an infinite logit).

    Returns:
        ``(slope, intercept)`` as Python floats; ``(nan, nan)`` when only one class occurs.

    References:
        Van Calster, McLernon, van Smeden, Wynants, Steyerberg. "Calibration: the Achilles heel
        of predictive analytics." BMC Medicine 17, 230 (2019).
        https://doi.org/10.1186/s12916-019-1466-7
        Cox. "Two further applications of a model for binary regression." Biometrika 45 (1958).
        https://doi.org/10.1093/biomet/45.3-4.562
    """
    p1, y = _binary_positive(probs, labels, "calibration_slope_intercept")
    if y.min() == y.max():
        return float("nan"), float("nan")
    x = _clipped_logit(p1, eps)
    _, slope, _ = fit_logistic(x, y)
    intercept, _, _ = fit_logistic(x, y, fit_slope=False)
    return slope, intercept


def oe_ratio(probs, labels) -> float:
    """Observed / expected events ``sum(y) / sum(p)`` of p(y=1) (binary tasks; 1 when calibrated
    in the large, > 1 when the model under-predicts). inf when ``sum(p) == 0 < sum(y)``, nan
    when both are 0.

    References:
        Van Calster et al. "Calibration: the Achilles heel of predictive analytics." BMC
        Medicine 17, 230 (2019). https://doi.org/10.1186/s12916-019-1466-7
    """
    p1, y = _binary_positive(probs, labels, "oe_ratio")
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.float64(y.sum()) / p1.sum())


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
