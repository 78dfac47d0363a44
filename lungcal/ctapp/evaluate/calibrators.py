"""The calibrator a run stores and inference applies: a fitted calibrator, a prior adjustment, or both.

Every post-hoc run (stage-1 bundle, :mod:`lungcal.ctapp.train.posthoc`) and every site recalibration
(``lungcal recalibrate``, :mod:`lungcal.ctapp.site.recalibrate`) stores the calibrator it fitted as the
artifact ``calibrator/<name>.json`` and the tag ``lungcal.calibrator = <name>``. For the
calibrators of :data:`lungcal.calibration.calibrators.CALIBRATORS` the file is the calibrator's own
plain JSON (``cal.to_json()``). A *prior adjustment* (``name = "prior"``: the site's known or
EM-estimated prevalence, :mod:`lungcal.calibration.prior`) is stored as::

    {"name": "prior", "base": <the shipped calibrator's JSON state, or null>,
     "source_prior": s, "target_prior": t, "estimated_by": "given" | "em"}

and applied as ``adjust_to_prior(base.predict_proba(z), s, t)``. :func:`load_calibrator` reads
either (:meth:`lungcal.calibration.calibrators.Calibrator.from_state` picks the class by name);
:func:`lungcal.calibration.calibrators.calibrated_probs` applies one to ``(N, 2)`` logits, and
:class:`lungcal.calibration.prior.PriorAdjusted` is the prior adjustment.

A prior adjustment is valid only where the images did not change (a pure change of prevalence). A
label-free recalibration (``lungcal recalibrate --prevalence / --unlabelled``) therefore runs ``lungcal
site-check`` first and records its verdict and run on the recalibration run (params
:data:`SITE_CHECK_PARAM`, :data:`SITE_CHECK_RUN_PARAM`; the tag ``lungcal.forced_past_site_check`` when
``--force`` overrode it). Inference cannot run a site check itself (``ctapp/infer`` may not import
``ctapp/site``), so :func:`prior_guard` reads what that run recorded.
"""
from __future__ import annotations

import math

from lungcal.calibration.calibrators import TemperatureScaler, calibrator_from_json
from lungcal.calibration.guarantee import MissedCancerGuarantee
from lungcal.calibration.prior import PriorAdjusted
from lungcal.errors import ConfigError
from lungcal.tracking import TAG_FORCED, linked_calibrator, linked_temperature
from lungcal.tracking.lookup import linked_guarantee

__all__ = ["load_calibrator", "temperature_calibrator", "site_calibrator", "site_guarantee", "reference_calibrator",
           "SITE_CHECK_PARAM", "SITE_CHECK_RUN_PARAM", "UNCHECKED", "prior_guard"]

#: the param of a label-free recalibration run holding its site check's verdict (or :data:`UNCHECKED`)
SITE_CHECK_PARAM = "site_check"
#: the param holding the site check's MLflow run id (``none`` when the check could not run)
SITE_CHECK_RUN_PARAM = "site_check_run"
#: the recorded verdict when the check could not run (too few CTs, no reference) and ``--force`` went on
UNCHECKED = "unchecked"
#: the verdict under which a prior adjustment is not valid (``lungcal.ctapp.site.site_check.SCANNER_SHIFT``;
#: this layer may not import ``site``, a test keeps the two equal)
_SCANNER_SHIFT = "scanner_shift"


def load_calibrator(text: str):
    """A fitted calibrator (a :class:`PriorAdjusted` included) from the JSON text a run stored."""
    return calibrator_from_json(text, fix="refit it: rerun `lungcal recalibrate` or the stage-1 bundle")


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


def prior_guard(calibrator, recal_run, site: str) -> str | None:
    """May a site's stored calibrator be applied, given what its recalibration run recorded?

    Only a prior adjustment (:class:`PriorAdjusted`) is guarded: a calibrator fitted on the site's labels is
    valid under any shift. Returns ``None`` (apply it silently), or a warning line (apply it, and say so on
    every run): the recalibration was forced past a ``scanner_shift`` verdict or past a check that could not
    run, or it predates site checks.

    Raises:
        ConfigError: the run recorded ``scanner_shift`` and was not forced (exit code 2).
    """
    if not isinstance(calibrator, PriorAdjusted):
        return None
    params = {} if recal_run is None else recal_run.data.params
    tags = {} if recal_run is None else recal_run.data.tags
    verdict = params.get(SITE_CHECK_PARAM)
    run_id = None if recal_run is None else recal_run.info.run_id
    check_run = params.get(SITE_CHECK_RUN_PARAM, "none")
    forced = tags.get(TAG_FORCED)
    if verdict is None:
        return (f"WARNING: the prior adjustment stored at site {site} (run {run_id}) predates site checks: it is "
                "valid only if the site's scanners are the model's (run `lungcal site-check` to know)")
    if verdict == _SCANNER_SHIFT and not forced:
        raise ConfigError(f"the prior adjustment stored at site {site} (run {run_id}) is not valid there: its site "
                          f"check (run {check_run}) found {_SCANNER_SHIFT}, and a prior adjustment assumes the "
                          "images did not change", field="--site",
                          fix="recalibrate on the site's labels (`lungcal recalibrate` without --prevalence/"
                              "--unlabelled) and predict with that")
    if forced:
        what = ("its site check could not run" if verdict == UNCHECKED else
                f"its site check (run {check_run}) found {verdict}")
        return (f"WARNING: the prior adjustment stored at site {site} (run {run_id}) was forced: {what}; its "
                "probabilities may be miscalibrated here")
    return None
