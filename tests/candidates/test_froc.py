"""cpm / froc_curve on hand-computed cases, and against monai.metrics.froc."""
from __future__ import annotations

import numpy as np
import pytest
from monai.metrics import compute_froc_curve_data, compute_froc_score

from lungcal.candidates.froc import LUNA16_FP_RATES, cpm, froc_curve, match_candidates

E3 = np.zeros((0, 3))
E = np.zeros(0)


def test_match_counts_multiple_hits_once_with_the_best_score_and_not_as_fp():
    gt = np.array([[0.0, 0, 0], [50, 0, 0]])
    diam = np.array([10.0, 4.0])
    pred = np.array([[1.0, 1, 1], [-3, 0, 0], [50, 2.5, 0], [20, 20, 20]])
    score = np.array([0.3, 0.9, 0.8, 0.5])
    nod, fp = match_candidates(pred, score, gt, diam)
    # nodule 0 hit by candidates 0 and 1 -> best 0.9; nodule 1 (radius 2) missed at 2.5 mm
    np.testing.assert_array_equal(nod, [0.9, -np.inf])
    np.testing.assert_array_equal(np.sort(fp), [0.5, 0.8])


def test_hand_computed_cpm():
    # 2 scans, 4 nodules. Scan A: nodules a1 (score 0.9), a2 (0.4); FPs 0.8, 0.3.
    # Scan B: nodule b1 (0.7), b2 missed; FP 0.6.
    gt = [np.array([[0.0, 0, 0], [100, 0, 0]]), np.array([[0.0, 0, 0], [100, 100, 100]])]
    diam = [np.array([10.0, 10]), np.array([10.0, 10])]
    pred = [np.array([[0.0, 0, 0], [100, 1, 0], [50, 50, 50], [60, 60, 60]]),
            np.array([[1.0, 0, 0], [-50, 0, 0]])]
    score = [np.array([0.9, 0.4, 0.8, 0.3]), np.array([0.7, 0.6])]
    fps, sens, thr = froc_curve(pred, score, gt, diam)
    # thresholds: inf, .9, .8, .7, .6, .4, .3 ; FP totals 0,0,1,1,2,2,3 ; TP 0,1,1,2,2,3,3
    np.testing.assert_allclose(thr, [np.inf, 0.9, 0.8, 0.7, 0.6, 0.4, 0.3])
    np.testing.assert_allclose(fps, np.array([0, 0, 1, 1, 2, 2, 3]) / 2)
    np.testing.assert_allclose(sens, np.array([0, 1, 1, 2, 2, 3, 3]) / 4)
    value, at = cpm(pred, score, gt, diam, return_sensitivities=True)
    # at FP rates 1/8, 1/4: between (0, .25) and (.5, .25) -> .25; at .5 -> .5 (max at equal fps)
    # at 1 -> .75 ; at 1.5 (max fps) and beyond -> .75
    np.testing.assert_allclose(at, [0.25, 0.25, 0.5, 0.75, 0.75, 0.75, 0.75])
    assert value == pytest.approx(np.mean([0.25, 0.25, 0.5, 0.75, 0.75, 0.75, 0.75]))


def test_perfect_detector_and_scans_without_nodules():
    gt = [np.array([[0.0, 0, 0]]), E3, np.array([[5.0, 5, 5], [40, 40, 40]])]
    diam = [np.array([6.0]), E, np.array([6.0, 8.0])]
    pred = [np.array([[0.0, 0, 1], [30, 30, 30]]), np.array([[9.0, 9, 9]]), np.array([[5.0, 5, 5], [40, 41, 40]])]
    score = [np.array([0.99, 0.1]), np.array([0.2]), np.array([0.95, 0.97])]
    assert cpm(pred, score, gt, diam) == pytest.approx(1.0)
    # no candidates at all anywhere -> 0
    assert cpm([E3] * 3, [E] * 3, gt, diam) == 0.0
    with pytest.raises(ValueError):
        cpm([E3], [E], [E3], [E])


def test_agrees_with_monai_froc():
    rng = np.random.default_rng(3)
    n_scans = 12
    pred, score, gt, diam = [], [], [], []
    for _ in range(n_scans):
        m = rng.integers(0, 3)
        g = rng.uniform(0, 200, (m, 3))
        d = rng.uniform(4, 20, m)
        n = rng.integers(0, 15)
        p = rng.uniform(0, 200, (n, 3))
        hit = rng.random(m) < 0.7
        p = np.concatenate([p, g[hit] + rng.normal(0, 1, (hit.sum(), 3))])
        pred.append(p)
        score.append(rng.random(len(p)))
        gt.append(g)
        diam.append(d)
    nod, fps = zip(*[match_candidates(*a) for a in zip(pred, score, gt, diam)])
    nod = np.concatenate(nod)
    fps = np.concatenate(fps)
    tp = nod[np.isfinite(nod)]
    # monai drops the lowest threshold (a CAMELYON quirk); a sentinel FP below every score
    # restores it without changing any count
    m_fps, m_sens = compute_froc_curve_data(np.append(fps, -1.0), tp, len(nod), n_scans)
    ref = compute_froc_score(m_fps, m_sens, eval_thresholds=LUNA16_FP_RATES)
    assert cpm(pred, score, gt, diam) == pytest.approx(ref, abs=1e-12)
