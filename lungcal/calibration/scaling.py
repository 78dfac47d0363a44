"""The old home of the post-hoc calibrators: a thin re-export module, kept so old import paths work.

Stored runs, checkpoints and bundles name ``_target_`` paths such as
``lungcal.calibration.scaling.TemperatureScaler``, and user code imports from here; every name this
module held still resolves here, to the same object. The code lives in:

* :mod:`lungcal.calibration.calibrators`: the public base :class:`Calibrator`, one module per
  calibrator (:mod:`~lungcal.calibration.calibrators.temperature`, ``platt``, ``affine``,
  ``histogram``, ``isotonic``), the registry (:data:`CALIBRATORS`, :func:`make_calibrator`,
  :func:`calibrator_from_json`), :func:`probabilities` and :func:`calibrated_probs`;
* :mod:`lungcal.calibration.selection`: :func:`select_calibrator` (cross-validated NLL);
* :mod:`lungcal.calibration.diagnostics`: :func:`fit_warnings`, :func:`no_signal`.

New code imports from those modules (or from :mod:`lungcal.calibration`).
"""
from lungcal.calibration.calibrators.affine import MatrixScaler, VectorScaler
from lungcal.calibration.calibrators.base import Calibrator, calibrated_probs, probabilities
from lungcal.calibration.calibrators.histogram import HistogramBinning
from lungcal.calibration.calibrators.isotonic import IsotonicCalibrator
from lungcal.calibration.calibrators.platt import PlattScaler
from lungcal.calibration.calibrators.registry import CALIBRATORS, calibrator_from_json, make_calibrator
from lungcal.calibration.calibrators.temperature import TemperatureScaler, _ts_objective
from lungcal.calibration.diagnostics import CHANCE_P, FEW_EVENTS, fit_warnings, no_signal
from lungcal.calibration.selection import _fold_ids, select_calibrator

#: the base's old, private name
_Calibrator = Calibrator

__all__ = [
    "CALIBRATORS",
    "make_calibrator",
    "calibrator_from_json",
    "select_calibrator",
    "fit_warnings",
    "no_signal",
    "probabilities",
    "calibrated_probs",
    "TemperatureScaler",
    "PlattScaler",
    "VectorScaler",
    "MatrixScaler",
    "HistogramBinning",
    "IsotonicCalibrator",
    "Calibrator",
    "FEW_EVENTS",
    "CHANCE_P",
    "_ts_objective",
    "_fold_ids",
]
