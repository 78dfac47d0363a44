"""The post-hoc step of a stage-1 bundle: calibrators fitted on validation logits, each in a linked run.

Bundle key ``post_hoc`` (default ``["ts"]``): for each name of
:data:`lungcal.calibration.scaling.CALIBRATORS` a calibrator is fitted on the *validation* logits
of the trained network, applied to the test logits and logged as a child run of the stage-1 run
(``lungcal.stage2 = <name>``, ``lungcal.calibrator = <name>``, ``lungcal.parent_run``), with the
test report, plots, predictions and the calibrator's JSON state. Temperature scaling also logs the
``temperature`` metric, which inference and ``lungcal recalibrate`` read back
(:func:`lungcal.tracking.linked_temperature`).

The prevalence the calibrated probabilities are calibrated to (that of the split the calibrator
was fitted on) is logged as the metric ``source_prior`` of each post-hoc run, and the stage-1 run
gets ``val/prevalence`` (and ``train/prevalence`` when the caller passes the training labels):
``lungcal recalibrate --prevalence`` adjusts the shipped probabilities *from* it. A fit that is
"no signal" (:func:`lungcal.calibration.scaling.fit_warnings`: a parameter on its bound, a fit
that did not converge, a validation AUC at chance) gets the tag ``lungcal.fit_warning``. Each
post-hoc run also stores ``val/referral_threshold_cov90``, the referral rule inference applies
(:class:`lungcal.engine.evaluate.cases.ReferralRule`).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lungcal.calibration.scaling import calibrated_probs, fit_warnings, make_calibrator, no_signal, probabilities
from lungcal.engine.evaluate.cases import REFERRAL_METRIC, ReferralRule, referral_threshold
from lungcal.engine.evaluate.pictures import log_split_pictures
from lungcal.engine.evaluate.reports import evaluate_probs, log_split
from lungcal.paths import atomic_write_text
from lungcal.tracking import (
    CT_EXPERIMENT,
    REFERENCE_CALIBRATOR,
    TAG_CALIBRATOR,
    TAG_FIT_WARNING,
    RunTracker,
    add_run_metrics,
)

__all__ = ["PostHocResult", "run_post_hoc", "prevalence"]


def prevalence(labels) -> float:
    """The fraction of positive (class 1) cases."""
    return float(np.mean(np.asarray(labels) == 1))


class PostHocResult(dict):
    """``{"name", "run_id", "test" (report), "temperature" (ts only), "warnings", "probs" (test, calibrated)}``."""


def run_post_hoc(names: Sequence[str], *, stage1_run_id: str, run_name: str, tags: Callable[[str], Mapping[str, str]],
                 params: Mapping[str, Any], val_logits: torch.Tensor, val_labels: torch.Tensor,
                 test_logits: torch.Tensor, test: Mapping[str, Any], test_attention: torch.Tensor, n_bins: int,
                 n_bootstrap: int, seed: int, tracking_uri: str, workdir: Path, title: str,
                 experiment: str = CT_EXPERIMENT, train_labels=None,
                 test_pictures: str = "none") -> list[PostHocResult]:
    """Fit each calibrator of ``names`` on validation, evaluate on test, log a linked run per calibrator.

    ``test_pictures`` (:data:`lungcal.engine.evaluate.pictures.PICTURE_MODES`): the reference calibrator's
    run (``ts`` when listed, else the first, as :func:`~lungcal.engine.evaluate.calibrators.reference_calibrator`
    prefers it; the one inference applies) gets the per-CT pictures of the test split at its
    calibrated probabilities and referral rule, and their gallery (:func:`log_split_pictures`).
    """
    results = []
    source_prior = prevalence(val_labels)
    priors = {"val/prevalence": source_prior}
    if train_labels is not None:
        priors["train/prevalence"] = prevalence(train_labels)
    add_run_metrics(tracking_uri, stage1_run_id, priors)
    reference = REFERENCE_CALIBRATOR if REFERENCE_CALIBRATOR in names else (names[0] if names else None)
    for name in names:
        calibrator = make_calibrator(name).fit(val_logits, val_labels)
        warnings = no_signal(fit_warnings(calibrator, val_logits, val_labels))
        temperature = float(calibrator.temperature) if name == "ts" else None
        if temperature is not None:  # softmax(z / T) in float64, as the reference temperature is applied later
            probs = probabilities(test_logits, temperature)
        else:
            probs = np.asarray(calibrator.predict_proba(test_logits.numpy()), dtype=np.float64)
        report = evaluate_probs(probs, test["labels"], n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
        with RunTracker(experiment, f"{run_name}+{name}", tracking_uri=tracking_uri,
                        tags={**tags(name), TAG_CALIBRATOR: name}, parent_run_id=stage1_run_id) as tracker:
            tracker.log_params({**params, "stage2": name, "fit_split": "val"})
            threshold = referral_threshold(calibrated_probs(calibrator, val_logits.numpy()))
            tracker.log_metrics({"source_prior": source_prior,  # the referral rule inference applies
                                 REFERRAL_METRIC: threshold})
            if warnings:
                tracker.set_tags({TAG_FIT_WARNING: "; ".join(warnings)})
            info = {"calibrator": name, "fit_split": "val", "stage1_run": stage1_run_id, "source_prior": source_prior,
                    "warnings": warnings}
            if temperature is not None:
                tracker.log_metrics({"temperature": temperature})
                info["temperature"] = temperature
            tracker.log_dict(info, "config/resolved.json")
            log_split(tracker, "test", probs, test["labels"], report, n_bins=n_bins, subjects=test["subjects"],
                      attention=test_attention, candidates=test["candidates"], workdir=workdir / name,
                      title=f"{title}+{name.upper()}")
            if name == reference:
                log_split_pictures(tracker, test, probs, test_attention, rule=ReferralRule.from_threshold(threshold),
                                   calibrator=name, folder=workdir / name / "cases", mode=test_pictures)
            state = atomic_write_text(workdir / name / f"{name}.json", calibrator.to_json())
            tracker.log_artifact(state, "calibrator")
            if temperature is not None:
                ts_path = atomic_write_text(workdir / "temperature.json",
                                            json.dumps({"temperature": temperature, "stage1_run": stage1_run_id}))
                tracker.log_artifact(ts_path, "calibrator")
            results.append(PostHocResult(name=name, run_id=tracker.run_id, test=report, temperature=temperature,
                                         warnings=warnings, probs=probs))
    return results
