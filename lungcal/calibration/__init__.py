"""Shared calibration toolkit: metrics, losses, mixup, post-hoc scaling, prior adaptation, selective
prediction (referral), plots, ignite handlers.

Imports only numpy/scipy/torch (matplotlib in :mod:`.plots`, ignite in :mod:`.handlers`, both
loaded lazily) and the stdlib-only :mod:`lungcal.errors`. See docs/architecture.md.
"""
from .calibrators import (
    CALIBRATORS,
    Calibrator,
    HistogramBinning,
    IsotonicCalibrator,
    MatrixScaler,
    PlattScaler,
    TemperatureScaler,
    VectorScaler,
    calibrator_from_json,
    make_calibrator,
)
from .diagnostics import fit_warnings
from .losses import (
    FocalLoss,
    FocalLossAdaptiveGamma,
    LabelAwareSmoothingLoss,
    MMCELoss,
    las_epsilons,
    mmce_squared,
    soft_cross_entropy,
)
from .measures import (
    BINARY_REPORT_METRICS,
    REPORT_METRICS,
    accuracy,
    adaptive_ece,
    auroc,
    brier_score,
    calibration_report,
    calibration_slope_intercept,
    classwise_ece,
    draws_bootstrap_diff,
    ece,
    ece_consistency_pvalue,
    mce,
    nll,
    oe_ratio,
    paired_bootstrap_diff,
    reliability_bins,
)
from .mixup import mixup, mixup_bags
from .prior import adjust_to_prior, estimate_prior_em
from .selection import select_calibrator
from .selective import (
    aurc,
    metrics_at_coverage,
    mutual_information,
    predictive_entropy,
    risk_coverage,
    selective_report,
    uncertainty_score,
)
from .uncertainty import decompose_uncertainty, log_probs

__all__ = [
    "REPORT_METRICS", "BINARY_REPORT_METRICS", "accuracy", "adaptive_ece", "auroc", "brier_score",
    "calibration_report", "calibration_slope_intercept", "classwise_ece", "ece", "ece_consistency_pvalue",
    "mce", "nll", "oe_ratio", "paired_bootstrap_diff", "draws_bootstrap_diff", "reliability_bins",
    "FocalLoss", "FocalLossAdaptiveGamma", "LabelAwareSmoothingLoss", "las_epsilons", "MMCELoss", "mmce_squared",
    "soft_cross_entropy", "mixup", "mixup_bags",
    "Calibrator", "TemperatureScaler", "PlattScaler", "VectorScaler", "MatrixScaler", "HistogramBinning",
    "IsotonicCalibrator",
    "CALIBRATORS", "make_calibrator", "calibrator_from_json", "select_calibrator", "fit_warnings",
    "adjust_to_prior", "estimate_prior_em",
    "risk_coverage", "aurc", "metrics_at_coverage", "selective_report", "predictive_entropy", "mutual_information",
    "uncertainty_score", "decompose_uncertainty", "log_probs",
]
