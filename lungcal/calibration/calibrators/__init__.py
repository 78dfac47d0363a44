"""Post-hoc calibrators fitted on held-out **logits** (never on test data), one module each.

All share one interface, the public base :class:`~.base.Calibrator`::

    cal = make_calibrator("platt").fit(val_logits, val_labels)   # returns self
    cal.transform(test_logits)        # calibrated logits (log-probabilities for the binning ones)
    cal.predict_proba(test_logits)    # calibrated probabilities
    cal.fit_info                      # {"converged", "at_bound", "n", "n_events", ...}
    text = cal.to_json(); same = calibrator_from_json(text)   # plain JSON, no pickle

Inputs are ``(N, C)`` logits, or ``(N,)`` logits of a binary model (read as ``[0, z]``), as
numpy arrays or torch tensors; outputs keep the input's type (numpy in -> numpy out, tensor in ->
tensor out) and its shape: ``(N, C)`` in -> ``(N, C)`` out, ``(N,)`` in -> ``(N,)`` out (the
calibrated binary logit from ``transform``, p(y=1) from ``predict_proba``). Probabilities given
where logits are expected are refused with :class:`lungcal.errors.DataError` (temperature
scaling of probabilities is a silent, classic bug): rows in [0, 1] that sum to 1 always, and, for
the calibrators that are not invariant to a per-row shift of the logits (vector, matrix) or for
``(N,)`` input, any input with every value in [0, 1]. Labels of one class only are refused.

* :mod:`.base`: :class:`Calibrator`, :func:`probabilities`, :func:`calibrated_probs`.
* :mod:`.temperature`: :class:`TemperatureScaler` (``"ts"``): ``z / T``; never changes the argmax.
* :mod:`.platt`: :class:`PlattScaler` (``"platt"``): ``sigmoid(a (z1 - z0) + b)``, binary only.
* :mod:`.affine`: :class:`VectorScaler` (``"vector"``): ``z * w + b``; :class:`MatrixScaler`: ``W z + b``.
* :mod:`.histogram`: :class:`HistogramBinning` (``"histogram"``); :mod:`.isotonic`:
  :class:`IsotonicCalibrator` (``"isotonic"``).
* :mod:`.registry`: :data:`CALIBRATORS` (names -> classes), :func:`make_calibrator`,
  :func:`calibrator_from_json`.

The prior adjustment :class:`lungcal.calibration.prior.PriorAdjusted` (``"prior"``) subclasses
:class:`Calibrator` too; it lives with the prevalence functions it applies. Choosing a calibrator by
cross-validated NLL is :mod:`lungcal.calibration.selection`; saying when a fit is "no signal",
:mod:`lungcal.calibration.diagnostics`. :mod:`lungcal.calibration.scaling` re-exports all of these
under their old path.

Every ``state_dict()`` is plain JSON data (lists, floats, ints, str, bool, None for nan) with a
``"name"`` key, so a stored calibrator survives library upgrades.
"""
from lungcal.calibration.calibrators.affine import MatrixScaler, VectorScaler
from lungcal.calibration.calibrators.base import Calibrator, calibrated_probs, probabilities
from lungcal.calibration.calibrators.histogram import HistogramBinning
from lungcal.calibration.calibrators.isotonic import IsotonicCalibrator
from lungcal.calibration.calibrators.platt import PlattScaler
from lungcal.calibration.calibrators.registry import CALIBRATORS, calibrator_from_json, make_calibrator
from lungcal.calibration.calibrators.temperature import TemperatureScaler

__all__ = [
    "Calibrator", "probabilities", "calibrated_probs",
    "TemperatureScaler", "PlattScaler", "VectorScaler", "MatrixScaler", "HistogramBinning", "IsotonicCalibrator",
    "CALIBRATORS", "make_calibrator", "calibrator_from_json",
]
