"""Instance-level calibration of a MIL model against the nodule truth of a synthetic cohort (issue 18 item 3).

A synthetic CT's ``annotations.csv`` (:mod:`lungcal.data.synthetic.cohort`) knows every nodule and
whether it is the cancer. :func:`candidate_truth` matches the candidates of each bag (the cached
``world`` centres, mm, aligned with the bag slots) to those nodules with the LUNA16 rule of the
FROC code (:func:`lungcal.candidates.froc.assign_candidates`: centre within the nodule's radius,
the nearest nodule when several) and labels each candidate malignant (1) or not (0: a benign
nodule or no nodule). :func:`instance_report` then scores per-candidate probabilities (e.g.
:func:`lungcal.mil.tempering.instance_probabilities`) against those labels with the calibration
report of :mod:`lungcal.calibration.metrics` (ECE, AUC, ... with bootstrap CIs), in one of two views:

- ``"candidates"``: every valid candidate slot; false positives count as not malignant;
- ``"nodules"``: every nodule hit by at least one candidate of its bag (the detected nodules), its
  probability the sum of its candidates' (``combine="sum"``: the log-sum-exp posteriors of distinct
  candidates are exclusive events) or their maximum (``combine="max"``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lungcal.calibration.metrics import calibration_report
from lungcal.candidates.evaluate import read_nodule_truth
from lungcal.candidates.froc import assign_candidates
from lungcal.errors import DataError

__all__ = ["read_nodule_truth", "candidate_truth", "instance_report"]

VIEWS = ("candidates", "nodules")


def candidate_truth(candidates: Sequence[Mapping[str, Any]], keys: Sequence[str],
                    truth: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                    mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Label every bag slot against the nodule truth.

    Args:
        candidates: per CT, ``{"world": (n, 3) mm}`` aligned with the first ``n`` bag slots.
        keys: per CT, its key in ``truth`` (the synthetic cohort's ``subject`` or ``ct``).
        truth: :func:`read_nodule_truth` output; a CT without nodules may be absent.
        mask: ``(B, K)`` valid slots.

    Returns:
        ``(labels (B, K) int, nodule (B, K) int)``: 1 where the candidate hits a malignant nodule,
        0 elsewhere (also at padding slots); the index of the nodule it hits in that CT's truth
        rows, ``-1`` for false positives and padding.
    """
    mask = np.asarray(mask, bool)
    if len(candidates) != mask.shape[0] or len(keys) != mask.shape[0]:
        raise ValueError(f"{len(candidates)} candidate sets and {len(keys)} keys for {mask.shape[0]} bags")
    labels = np.zeros(mask.shape, np.int64)
    nodule = np.full(mask.shape, -1, np.int64)
    empty = (np.zeros((0, 3)), np.zeros(0), np.zeros(0, bool))
    for i, (cands, key) in enumerate(zip(candidates, keys)):
        world = np.asarray(cands["world"], np.float64).reshape(-1, 3)
        n = min(len(world), mask.shape[1])
        if int(mask[i].sum()) != n:
            raise DataError(f"bag {i} has {int(mask[i].sum())} valid slots but {len(world)} candidate centres",
                            field="candidates", fix="rebuild the bag cache (lungcal build-bags)")
        centres, diameters, malignant = truth.get(str(key), empty)
        idx = assign_candidates(world[:n], centres, diameters)
        nodule[i, :n] = idx
        labels[i, :n] = np.where(idx >= 0, malignant[np.clip(idx, 0, None)] if len(malignant) else False, False)
    return labels, nodule


def instance_report(probs: np.ndarray, labels: np.ndarray, mask: np.ndarray, *, view: str = "candidates",
                    nodule_of: np.ndarray | None = None, combine: str = "sum", n_bins: int = 10,
                    n_bootstrap: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Calibration report of per-instance probabilities ``(B, K)`` against instance labels ``(B, K)``.

    ``view="candidates"`` scores the valid slots of ``mask``; ``view="nodules"`` the detected nodules
    (``nodule_of`` from :func:`candidate_truth`), combining the candidates of one nodule by ``combine``.
    Returns :func:`lungcal.calibration.metrics.calibration_report` (positive-class ECE, since an
    instance probability is p(malignant)) plus ``n_positive``.
    """
    probs, labels, mask = np.asarray(probs, np.float64), np.asarray(labels), np.asarray(mask, bool)
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    if view == "candidates":
        p, y = probs[mask], labels[mask]
    else:
        if nodule_of is None:
            raise ValueError("view='nodules' needs nodule_of (from candidate_truth)")
        if combine not in ("sum", "max"):
            raise ValueError(f"combine must be 'sum' or 'max', got {combine!r}")
        p_list, y_list = [], []
        for i in range(probs.shape[0]):
            for j in np.unique(nodule_of[i][mask[i] & (nodule_of[i] >= 0)]):
                sel = mask[i] & (nodule_of[i] == j)
                p_list.append(probs[i, sel].sum() if combine == "sum" else probs[i, sel].max())
                y_list.append(int(labels[i, sel].max()))
        p, y = np.minimum(np.asarray(p_list, np.float64), 1.0), np.asarray(y_list, np.int64)
    if len(y) == 0:
        raise DataError("no instances to score", field="candidates", fix="check the bags and the annotations")
    report = calibration_report(np.clip(p, 0.0, 1.0), y, n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed,
                                mode="positive_class")
    report["n_positive"] = int(y.sum())
    return report
