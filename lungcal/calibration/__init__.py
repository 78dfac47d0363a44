"""Shared calibration toolkit: metrics, losses, mixup, post-hoc scaling, plots, ignite handlers.

Imports only numpy/scipy/torch (matplotlib in :mod:`.plots`, ignite in :mod:`.handlers`, both
loaded lazily) and the stdlib-only :mod:`lungcal.errors`. See docs/architecture.md.
"""
from .losses import (
    FocalLoss,
    FocalLossAdaptiveGamma,
    LabelAwareSmoothingLoss,
    las_epsilons,
    soft_cross_entropy,
)
from .metrics import (
    REPORT_METRICS,
    accuracy,
    adaptive_ece,
    auroc,
    brier_score,
    calibration_report,
    classwise_ece,
    ece,
    mce,
    nll,
    reliability_bins,
)
from .mixup import mixup, mixup_bags
from .scaling import (
    HistogramBinning,
    IsotonicCalibrator,
    MatrixScaler,
    TemperatureScaler,
    VectorScaler,
)

__all__ = [
    "REPORT_METRICS", "accuracy", "adaptive_ece", "auroc", "brier_score", "calibration_report",
    "classwise_ece", "ece", "mce", "nll", "reliability_bins",
    "FocalLoss", "FocalLossAdaptiveGamma", "LabelAwareSmoothingLoss", "las_epsilons",
    "soft_cross_entropy", "mixup", "mixup_bags",
    "TemperatureScaler", "VectorScaler", "MatrixScaler", "HistogramBinning", "IsotonicCalibrator",
]
