"""The calibrator a run stores and inference applies: a fitted calibrator, a prior adjustment, or both.

Every post-hoc run (stage-1 bundle, :mod:`lungcal.engine.train.posthoc`) and every site recalibration
(``lungcal recalibrate``, :mod:`lungcal.engine.site.recalibrate`) stores the calibrator it fitted as the
artifact ``calibrator/<name>.json`` and the tag ``lungcal.calibrator = <name>``. For the
calibrators of :data:`lungcal.calibration.scaling.CALIBRATORS` the file is the calibrator's own
plain JSON (``cal.to_json()``). A *prior adjustment* (``name = "prior"``: the site's known or
EM-estimated prevalence, :mod:`lungcal.calibration.prior`) is stored as::

    {"name": "prior", "base": <the shipped calibrator's JSON state, or null>,
     "source_prior": s, "target_prior": t, "estimated_by": "given" | "em"}

and applied as ``adjust_to_prior(base.predict_proba(z), s, t)``. :func:`load_calibrator` reads
either; :func:`lungcal.calibration.scaling.calibrated_probs` applies one to ``(N, 2)`` logits, and
:class:`lungcal.calibration.prior.PriorAdjusted` is the prior adjustment.
"""
from __future__ import annotations

import json
import math

from lungcal.calibration.guarantee import MissedCancerGuarantee
from lungcal.calibration.prior import PRIOR, PriorAdjusted
from lungcal.calibration.scaling import TemperatureScaler, calibrator_from_json
from lungcal.errors import DataError
from lungcal.tracking import linked_calibrator, linked_temperature
from lungcal.tracking.lookup import linked_guarantee

__all__ = ["load_calibrator", "temperature_calibrator", "site_calibrator", "site_guarantee", "reference_calibrator"]


def load_calibrator(text: str):
    """A fitted calibrator (or :class:`PriorAdjusted`) from the JSON text a run stored."""
    try:
        state = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"stored calibrator JSON does not parse ({e.msg})", field="calibrator",
                        fix="refit it: rerun `lungcal recalibrate` or the stage-1 bundle") from e
    if isinstance(state, dict) and state.get("name") == PRIOR:
        return PriorAdjusted.from_state(state)
    return calibrator_from_json(text)


def temperature_calibrator(temperature: float) -> TemperatureScaler:
    """A fitted :class:`TemperatureScaler` of a binary model with temperature ``temperature``."""
    return TemperatureScaler().load_state_dict({"name": "ts", "log_temperature": math.log(float(temperature)),
                                                "n_classes": 2})


def site_calibrator(tracking_uri: str, run, site: str):
    """The calibrator ``lungcal recalibrate`` stored for ``site`` (any kind), or ``None``.

    Falls back to the temperature of a site TS run recorded before calibrators were stored as JSON.
    """
    found = linked_calibrator(tracking_uri, run, site=site, load=load_calibrator)
    if found is not None:
        return found[1]
    temp = linked_temperature(tracking_uri, run, site=site)
    return temperature_calibrator(temp) if temp is not None else None


def reference_calibrator(tracking_uri: str, run):
    """The stage-1 run's reference calibrator (its post-hoc runs; ``ts`` preferred), or ``None``.

    A reference TS run without a stored calibrator (older runs) gives its ``temperature``.
    """
    found = linked_calibrator(tracking_uri, run, load=load_calibrator)
    if found is not None:
        return found[1]
    temp = linked_temperature(tracking_uri, run)
    return temperature_calibrator(temp) if temp is not None else None


def site_guarantee(tracking_uri: str, run, site: str) -> MissedCancerGuarantee | None:
    """The decision threshold ``lungcal recalibrate --miss-rate`` stored for ``site``, with its guarantee, or ``None``.

    It comes from the same run as :func:`site_calibrator`'s calibrator (the site's newest recalibration),
    so it is a threshold on the probabilities that calibrator gives; a run recalibrated without
    ``--miss-rate`` stores none.
    """
    state = linked_guarantee(tracking_uri, run, site)
    return None if state is None else MissedCancerGuarantee.from_dict(state)
