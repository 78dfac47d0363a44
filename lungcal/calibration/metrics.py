"""The old home of the calibration measures: a thin re-export module, kept so old import paths work.

Stored runs, bundles and user code name ``lungcal.calibration.metrics.<name>``; every name this module
held still resolves here, to the same object. The code lives in :mod:`lungcal.calibration.measures`:

* :mod:`~lungcal.calibration.measures.calibration_error`: ``ece``, ``mce``, ``adaptive_ece``,
  ``classwise_ece``, ``reliability_bins``;
* :mod:`~lungcal.calibration.measures.scores`: ``brier_score``, ``nll``, ``accuracy``, ``auroc``;
* :mod:`~lungcal.calibration.measures.clinical`: ``calibration_slope_intercept``, ``oe_ratio``;
* :mod:`~lungcal.calibration.measures.bootstrap`: ``calibration_report``, ``REPORT_METRICS``,
  ``BINARY_REPORT_METRICS``;
* :mod:`~lungcal.calibration.measures.significance`: ``ece_consistency_pvalue``, ``paired_bootstrap_diff``,
  ``draws_bootstrap_diff``.

The private helpers that scripts and tests reach for (``_bin_index``, ``_bootstrap_replicates``, the
input checks) are re-exported too. New code imports from :mod:`lungcal.calibration.measures` (or from
:mod:`lungcal.calibration`).
"""
from lungcal.calibration.measures.binning import _bin_index, _binned_sums, _gap_norm
from lungcal.calibration.measures.bootstrap import (
    BINARY_REPORT_METRICS,
    REPORT_METRICS,
    _bootstrap_replicates,
    calibration_report,
)
from lungcal.calibration.measures.calibration_error import adaptive_ece, classwise_ece, ece, mce, reliability_bins
from lungcal.calibration.measures.clinical import LOGIT_EPS, calibration_slope_intercept, oe_ratio
from lungcal.calibration.measures.inputs import _as_probs_labels, _confidence_correct, _confidence_hit, _to_numpy
from lungcal.calibration.measures.scores import accuracy, auroc, brier_score, nll
from lungcal.calibration.measures.significance import (
    draws_bootstrap_diff,
    ece_consistency_pvalue,
    paired_bootstrap_diff,
)

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
    "draws_bootstrap_diff",
    "ece_consistency_pvalue",
    "REPORT_METRICS",
    "BINARY_REPORT_METRICS",
    "LOGIT_EPS",
    "_bin_index",
    "_binned_sums",
    "_gap_norm",
    "_bootstrap_replicates",
    "_as_probs_labels",
    "_confidence_correct",
    "_confidence_hit",
    "_to_numpy",
]
