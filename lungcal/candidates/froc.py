"""FROC analysis and the LUNA16 competition performance metric (CPM).

The CPM (Setio et al. 2017, LUNA16) is the mean sensitivity at 1/8, 1/4, 1/2, 1, 2, 4 and 8
false positives per scan. Matching follows the LUNA16 evaluation script:

- a candidate *hits* a nodule when its centre lies within the nodule's radius (diameter / 2) of
  the annotated centre (Euclidean distance in world mm);
- a nodule counts as detected at threshold ``t`` when any candidate hitting it has score >= t:
  its score is the best score among its hits, and it is counted once;
- candidates that hit a nodule are never false positives, even when several hit the same nodule;
- every candidate that hits no nodule is a false positive; scans without nodules contribute only
  false positives (and count in the number of scans).

The FROC curve has one operating point per distinct score (plus the origin); sensitivities at the
requested FP rates are linearly interpolated on it, as in the LUNA16 script and
``monai.metrics.compute_froc_score``. Beyond the largest FP rate reached, the sensitivity stays at
its maximum (nodules never hit by any candidate are never detected).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["LUNA16_FP_RATES", "candidate_hits", "assign_candidates", "match_candidates", "froc_curve", "cpm"]

LUNA16_FP_RATES: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def _arr(x, shape_tail: tuple[int, ...]) -> np.ndarray:
    a = np.asarray(x if x is not None else np.zeros((0, *shape_tail)), np.float64)
    return a.reshape(-1, *shape_tail)


def candidate_hits(pred_world, gt_world, gt_diameter_mm) -> np.ndarray:
    """``(N, M)`` bool: candidate ``i`` hits nodule ``j`` (centre within the nodule's radius, world mm)."""
    pw, gw, gd = _arr(pred_world, (3,)), _arr(gt_world, (3,)), _arr(gt_diameter_mm, ())
    if len(gw) != len(gd):
        raise ValueError(f"{len(gw)} nodule centres but {len(gd)} diameters")
    dist = np.sqrt(((pw[:, None, :] - gw[None, :, :]) ** 2).sum(-1))  # (N, M)
    return dist <= (gd / 2.0)[None, :]


def assign_candidates(pred_world, gt_world, gt_diameter_mm) -> np.ndarray:
    """``(N,)`` index of the nodule each candidate hits (:func:`candidate_hits`; the nearest centre
    when it hits several), ``-1`` for a false positive."""
    pw, gw = _arr(pred_world, (3,)), _arr(gt_world, (3,))
    hits = candidate_hits(pw, gw, gt_diameter_mm)
    dist = np.sqrt(((pw[:, None, :] - gw[None, :, :]) ** 2).sum(-1))
    nearest = np.where(hits, dist, np.inf).argmin(axis=1) if hits.shape[1] else np.zeros(len(pw), int)
    return np.where(hits.any(axis=1), nearest, -1)


def match_candidates(pred_world, pred_score, gt_world, gt_diameter_mm):
    """Match one scan's candidates to its nodules.

    Args:
        pred_world: ``(N, 3)`` candidate centres in world mm.
        pred_score: ``(N,)`` candidate scores.
        gt_world: ``(M, 3)`` nodule centres in the same world frame.
        gt_diameter_mm: ``(M,)`` nodule diameters in mm.

    Returns:
        ``(nodule_score, fp_scores)``: ``(M,)`` best score of the candidates hitting each nodule
        (``-inf`` when none does) and the scores of the false-positive candidates.
    """
    pw, ps = _arr(pred_world, (3,)), _arr(pred_score, ())
    if len(pw) != len(ps):
        raise ValueError(f"{len(pw)} candidate centres but {len(ps)} scores")
    hits = candidate_hits(pw, gt_world, gt_diameter_mm)
    nodule_score = np.where(hits, ps[:, None], -np.inf).max(axis=0, initial=-np.inf)
    fp_scores = ps[~hits.any(axis=1)]
    return nodule_score, fp_scores


def froc_curve(pred_world, pred_score, gt_world, gt_diameter_mm):
    """FROC operating points over a set of scans.

    Each argument is a sequence with one entry per scan (an empty ``(0, 3)`` / ``(0,)`` array,
    or ``None``, for a scan without candidates or without nodules).

    Returns:
        ``(fps_per_scan, sensitivity, thresholds)``, each ``(T + 1,)`` with FP rates ascending:
        the origin (threshold ``+inf``) first, then one point per distinct candidate score in
        decreasing order.
    """
    n_scans = len(pred_world)
    if not (len(pred_score) == len(gt_world) == len(gt_diameter_mm) == n_scans):
        raise ValueError("pred_world, pred_score, gt_world and gt_diameter_mm need one entry per scan")
    if n_scans == 0:
        raise ValueError("froc_curve needs at least one scan")
    nod, fps = [], []
    for pw, ps, gw, gd in zip(pred_world, pred_score, gt_world, gt_diameter_mm):
        a, b = match_candidates(pw, ps, gw, gd)
        nod.append(a)
        fps.append(b)
    nodule_score = np.concatenate(nod) if nod else np.zeros(0)
    fp_scores = np.concatenate(fps) if fps else np.zeros(0)
    n_nodules = len(nodule_score)
    thresholds = np.unique(np.concatenate([nodule_score[np.isfinite(nodule_score)], fp_scores]))[::-1]
    # counts at each threshold t: #{score >= t}, via searchsorted on the sorted scores
    fp_sorted = np.sort(fp_scores)
    tp_sorted = np.sort(nodule_score[np.isfinite(nodule_score)])
    n_fp = len(fp_sorted) - np.searchsorted(fp_sorted, thresholds, side="left")
    n_tp = len(tp_sorted) - np.searchsorted(tp_sorted, thresholds, side="left")
    fps_per_scan = np.concatenate([[0.0], n_fp / n_scans])
    sens = np.concatenate([[0.0], n_tp / n_nodules if n_nodules else np.zeros(len(thresholds))])
    return fps_per_scan, sens, np.concatenate([[np.inf], thresholds])


def cpm(pred_world, pred_score, gt_world, gt_diameter_mm, fp_rates: Sequence[float] = LUNA16_FP_RATES,
        return_sensitivities: bool = False):
    """LUNA16 competition performance metric: mean sensitivity at the given FP-per-scan rates.

    Arguments are per-scan sequences as in :func:`froc_curve`. With ``return_sensitivities`` the
    result is ``(cpm, sensitivities at fp_rates)``.

    Raises:
        ValueError: when the scans hold no nodule at all (sensitivity is undefined).
    """
    n_nodules = sum(len(_arr(g, ())) for g in gt_diameter_mm)
    if n_nodules == 0:
        raise ValueError("cpm is undefined without any annotated nodule")
    fps, sens, _ = froc_curve(pred_world, pred_score, gt_world, gt_diameter_mm)
    at = np.interp(np.asarray(fp_rates, np.float64), fps, sens)
    score = float(at.mean())
    return (score, at) if return_sensitivities else score
