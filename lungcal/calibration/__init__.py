"""Shared calibration toolkit: metrics, losses, mixup, post-hoc scaling, plots, ignite handlers.

Imports only numpy/scipy/torch (matplotlib in :mod:`.plots`, ignite in :mod:`.handlers`, both
loaded lazily) and the stdlib-only :mod:`lungcal.errors`. See docs/architecture.md.
"""
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

__all__ = [
    "REPORT_METRICS", "accuracy", "adaptive_ece", "auroc", "brier_score", "calibration_report",
    "classwise_ece", "ece", "mce", "nll", "reliability_bins",
]
