"""How a CT run logs a calibrated test split in a post-hoc child run (the runs themselves:
:func:`lungcal.workflow.post_hoc_runs`).

Each post-hoc run of a stage-1 CT run, or of an ensemble's parent run, holds the calibrated test split as
the stage-1 run holds its own (report, reliability and risk-coverage plots, the predictions CSV with each
CT's most attended candidate); the reference calibrator's run (``ts`` when listed, else the first: the one
inference applies) also draws the per-CT pictures at its calibrated probabilities and referral rule, and
their gallery (:func:`lungcal.ctapp.evaluate.pictures.log_split_pictures`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lungcal.ctapp.evaluate.cases import ReferralRule
from lungcal.ctapp.evaluate.pictures import log_split_pictures
from lungcal.ctapp.evaluate.reports import log_split
from lungcal.tracking import RunTracker
from lungcal.workflow import SplitScores

__all__ = ["log_calibrated_test"]


def log_calibrated_test(tracker: RunTracker, name: str, probs: np.ndarray, report: dict[str, Any],
                        scores: SplitScores, *, n_bins: int, title: str, reference: bool, threshold: float | None,
                        pictures: str) -> None:
    """Log the test split at calibrator ``name``'s probabilities; pictures when it is the ``reference`` one.

    ``scores.extra`` holds the split (``test``: labels, subjects, candidates), its ``attention`` and the
    run's ``workdir``; ``pictures`` is a :data:`lungcal.ctapp.evaluate.pictures.PICTURE_MODES` value.
    """
    test, attention = scores.extra["test"], scores.extra["attention"]
    workdir = scores.extra["workdir"] / name
    log_split(tracker, "test", probs, test["labels"], report, n_bins=n_bins, subjects=test["subjects"],
              attention=attention, candidates=test["candidates"], workdir=workdir, title=f"{title}+{name.upper()}")
    if reference:
        log_split_pictures(tracker, test, probs, attention, rule=ReferralRule.from_threshold(threshold),
                           calibrator=name, folder=workdir / "cases", mode=pictures)
