"""The calibrators by name: :data:`CALIBRATORS` (the ``--method`` choices), :func:`make_calibrator`
and :func:`calibrator_from_json`, which rebuilds any stored calibrator (a prior adjustment included)."""
from __future__ import annotations

import json
from typing import Literal, overload

from lungcal.calibration.calibrators.affine import VectorScaler
from lungcal.calibration.calibrators.base import Calibrator
from lungcal.calibration.calibrators.histogram import HistogramBinning
from lungcal.calibration.calibrators.isotonic import IsotonicCalibrator
from lungcal.calibration.calibrators.platt import PlattScaler
from lungcal.calibration.calibrators.temperature import TemperatureScaler
from lungcal.errors import ConfigError, DataError

__all__ = ["CALIBRATORS", "make_calibrator", "calibrator_from_json"]

#: Calibrators by name (the ``--method`` choices): name -> class.
CALIBRATORS: dict[str, type[Calibrator]] = {
    "ts": TemperatureScaler,
    "platt": PlattScaler,
    "vector": VectorScaler,
    "isotonic": IsotonicCalibrator,
    "histogram": HistogramBinning,
}


@overload
def make_calibrator(name: Literal["ts"], **kwargs) -> TemperatureScaler: ...
@overload
def make_calibrator(name: str, **kwargs) -> Calibrator: ...
def make_calibrator(name: str, **kwargs) -> Calibrator:
    """A new, unfitted calibrator by registry name (see :data:`CALIBRATORS`), e.g.
    ``make_calibrator("histogram", n_bins=10)``; ConfigError naming the valid names otherwise."""
    if name not in CALIBRATORS:
        raise ConfigError(f"unknown calibrator {name!r}", field="method",
                          fix=f"use one of: {', '.join(CALIBRATORS)}")
    return CALIBRATORS[name](**kwargs)


def calibrator_from_json(text: str, fix: str = "pass the text written by Calibrator.to_json()") -> Calibrator:
    """Rebuild a fitted calibrator from ``cal.to_json()`` (its class comes from the ``"name"`` key).

    Any subclass of :class:`Calibrator` loads: the ones of :data:`CALIBRATORS`, ``"matrix"``
    (:class:`~lungcal.calibration.calibrators.affine.MatrixScaler`) and ``"prior"``
    (:class:`lungcal.calibration.prior.PriorAdjusted`, known once :mod:`lungcal.calibration` is imported,
    which importing this module does).

    Write the text with ``lungcal.paths.atomic_write_text(path, cal.to_json())`` and read it back
    with ``calibrator_from_json(path.read_text())``. ``fix`` is what the error says to do when the text
    does not parse (a caller reading a stored run names how to refit it).
    """
    try:
        state = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"calibrator JSON does not parse ({e.msg} at line {e.lineno})", field="calibrator",
                        fix=fix) from e
    return Calibrator.from_state(state)
