"""The calibrator a run stores and inference applies: a fitted calibrator, a prior adjustment, or both.

Every post-hoc run (stage-1 bundle, :mod:`lungcal.engine.posthoc`) and every site recalibration
(``lungcal recalibrate``, :mod:`lungcal.engine.recalibrate`) stores the calibrator it fitted as the
artifact ``calibrator/<name>.json`` and the tag ``lungcal.calibrator = <name>``. For the
calibrators of :data:`lungcal.calibration.scaling.CALIBRATORS` the file is the calibrator's own
plain JSON (``cal.to_json()``). A *prior adjustment* (``name = "prior"``: the site's known or
EM-estimated prevalence, :mod:`lungcal.calibration.prior`) is stored as::

    {"name": "prior", "base": <the shipped calibrator's JSON state, or null>,
     "source_prior": s, "target_prior": t, "estimated_by": "given" | "em"}

and applied as ``adjust_to_prior(base.predict_proba(z), s, t)``. :func:`load_calibrator` reads
either; :func:`calibrated_probs` applies one to ``(N, 2)`` logits.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from lungcal.calibration.prior import adjust_to_prior
from lungcal.calibration.scaling import TemperatureScaler, calibrator_from_json
from lungcal.engine.evaluate import probabilities
from lungcal.errors import DataError
from lungcal.tracking import linked_calibrator, linked_temperature

__all__ = ["PRIOR", "calibrated_probs", "load_calibrator", "temperature_calibrator", "site_calibrator",
           "reference_calibrator", "PriorAdjusted"]

#: the registry-like name of a stored prior adjustment
PRIOR = "prior"


def calibrated_probs(calibrator, logits) -> np.ndarray:
    """``(N, C)`` float64 probabilities of ``calibrator`` (``None`` = plain softmax) on ``logits``."""
    z = np.asarray(logits, dtype=np.float64)
    if calibrator is None:
        return probabilities(z)
    if getattr(calibrator, "name", "") == "ts":  # softmax(z / T) in float64, as the stage-1 run reports it
        return probabilities(z, calibrator.temperature)
    return np.asarray(calibrator.predict_proba(z), dtype=np.float64)


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


class PriorAdjusted:
    """The shipped calibrator followed by Bayes re-weighting from ``source_prior`` to ``target_prior``.

    Args:
        base: the fitted calibrator the model is shipped with (``None``: plain softmax).
        source_prior: prevalence the base probabilities are calibrated to.
        target_prior: the site's prevalence (given, or estimated by EM on its unlabelled CTs).
        estimated_by: ``"given"`` or ``"em"`` (recorded only).
    """

    name = PRIOR

    def __init__(self, base, source_prior: float, target_prior: float, estimated_by: str = "given") -> None:
        self.base = base
        self.source_prior, self.target_prior = float(source_prior), float(target_prior)
        self.estimated_by = str(estimated_by)
        adjust_to_prior(np.array([0.5]), self.source_prior, self.target_prior)  # ConfigError outside (0, 1)

    def predict_proba(self, logits) -> np.ndarray:
        """``(N, 2)`` adjusted probabilities."""
        return adjust_to_prior(calibrated_probs(self.base, logits), self.source_prior, self.target_prior)

    def state_dict(self) -> dict[str, Any]:
        return {"name": PRIOR, "base": None if self.base is None else self.base.state_dict(),
                "source_prior": self.source_prior, "target_prior": self.target_prior,
                "estimated_by": self.estimated_by}

    def to_json(self) -> str:
        return json.dumps(self.state_dict(), allow_nan=False, sort_keys=True)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PriorAdjusted:
        base = state.get("base")
        try:
            return cls(None if base is None else calibrator_from_json(json.dumps(base)), state["source_prior"],
                       state["target_prior"], state.get("estimated_by", "given"))
        except KeyError as e:
            raise DataError(f"stored prior adjustment lacks {e.args[0]!r}", field="calibrator",
                            fix="refit it: rerun `lungcal recalibrate --prevalence P`") from e

    def __repr__(self) -> str:
        return (f"PriorAdjusted({self.base!r}, source={self.source_prior:.4f}, target={self.target_prior:.4f}, "
                f"{self.estimated_by})")
