"""Calibration and discrimination measures (numpy / torch inputs, float64 accumulation), one concept per module.

Conventions shared by every function here:

* ``probs`` is ``(N, C)`` class probabilities, or ``(N,)`` = p(y=1) of a binary task (read as
  ``[1 - p, p]``). Measures never take logits; inputs outside [0, 1] raise
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

The modules:

* :mod:`.inputs` (the input checks, confidence and hit) and :mod:`.binning` (the ``(lo, hi]`` bins
  and the gap norms): private helpers shared by the rest;
* :mod:`.calibration_error`: :func:`ece`, :func:`mce`, :func:`adaptive_ece`, :func:`classwise_ece`,
  :func:`reliability_bins`;
* :mod:`.scores`: :func:`brier_score`, :func:`nll`, :func:`accuracy`, :func:`auroc`;
* :mod:`.clinical` (binary tasks, on p(y=1)): :func:`calibration_slope_intercept`, :func:`oe_ratio`
  (Van Calster et al. 2019);
* :mod:`.decision_curve` (binary tasks, on p(y=1)): :func:`decision_curve`, :func:`net_benefit` (Vickers and
  Elkin 2006): the net benefit of a work-up threshold beside treating all and none;
* :mod:`.bootstrap`: :func:`calibration_report`, every measure with a percentile-bootstrap CI, its
  replicates vectorised; :data:`REPORT_METRICS`, :data:`BINARY_REPORT_METRICS`;
* :mod:`.significance`: :func:`ece_consistency_pvalue` (is a model miscalibrated on these data?) and
  :func:`paired_bootstrap_diff` (the CI of a difference between two models on the same cases) and
  :func:`draws_bootstrap_diff` (the same over repeated trainings: a two-level bootstrap of draws and cases).

:mod:`lungcal.calibration.metrics` re-exports all of these under their old path.
"""
from lungcal.calibration.measures.bootstrap import BINARY_REPORT_METRICS, REPORT_METRICS, calibration_report
from lungcal.calibration.measures.calibration_error import adaptive_ece, classwise_ece, ece, mce, reliability_bins
from lungcal.calibration.measures.clinical import LOGIT_EPS, calibration_slope_intercept, oe_ratio
from lungcal.calibration.measures.decision_curve import DecisionCurve, decision_curve, net_benefit
from lungcal.calibration.measures.scores import accuracy, auroc, brier_score, nll
from lungcal.calibration.measures.significance import (
    draws_bootstrap_diff,
    ece_consistency_pvalue,
    paired_bootstrap_diff,
)

__all__ = [
    "ece", "mce", "adaptive_ece", "classwise_ece", "brier_score", "nll", "accuracy", "auroc", "reliability_bins",
    "calibration_slope_intercept", "oe_ratio", "calibration_report", "paired_bootstrap_diff", "draws_bootstrap_diff",
    "ece_consistency_pvalue", "REPORT_METRICS", "BINARY_REPORT_METRICS", "LOGIT_EPS", "decision_curve",
    "net_benefit", "DecisionCurve",
]
