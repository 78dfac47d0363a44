"""Instance truth: candidates matched to the phantom's nodules (LUNA16 rule) and instance-level reports."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.candidates.cache import compute_bag
from lungcal.ctapp.evaluate.instance_truth import candidate_truth, instance_report, read_nodule_truth
from lungcal.data.manifest import load_manifest
from lungcal.errors import DataError


@pytest.fixture(scope="module")
def truth(tiny_cohort):
    return read_nodule_truth(tiny_cohort.parent / "annotations.csv", key="ct")


def test_join_labels_each_candidate_by_the_nodule_it_hits(truth):
    keys = sorted(truth)[:6]
    cands, masks, expected = [], [], []
    rng = np.random.default_rng(0)
    for key in keys:
        centres, diam, malignant = truth[key]
        # one candidate inside each nodule (a third of its radius off centre), then one far outside the body
        off = rng.normal(size=centres.shape)
        off *= (diam / 6.0)[:, None] / np.linalg.norm(off, axis=1, keepdims=True)
        world = np.vstack([centres + off, [[500.0, 500.0, 500.0]]])
        cands.append({"world": world})
        masks.append(len(world))
        expected.append(np.r_[malignant.astype(int), 0])
    k = max(masks) + 1
    mask = np.array([[j < n for j in range(k)] for n in masks])
    labels, nodule = candidate_truth(cands, keys, truth, mask)
    for i, n in enumerate(masks):
        np.testing.assert_array_equal(labels[i, :n], expected[i])
        np.testing.assert_array_equal(nodule[i, :n], np.r_[np.arange(n - 1), -1])
        assert (labels[i, n:] == 0).all() and (nodule[i, n:] == -1).all()
    assert labels.sum() == sum(int(truth[key][2].sum()) for key in keys) > 0
    # a CT absent from the truth (no nodules): every candidate is a false positive
    labels, nodule = candidate_truth([{"world": np.zeros((2, 3))}], ["nobody"], truth, np.array([[True, True]]))
    assert labels.sum() == 0 and (nodule == -1).all()
    with pytest.raises(DataError, match="valid slots"):
        candidate_truth([{"world": np.zeros((1, 3))}], ["nobody"], truth, np.array([[True, True]]))


def test_detector_candidates_are_labelled_by_the_nodule_they_hit(tiny_cohort, truth):
    """Real bags of the tiny cohort: a candidate is labelled 1 exactly when it lies in a malignant nodule."""
    rows = [r for r in load_manifest(tiny_cohort) if r["ct"] in truth][:3]
    n_malignant_hits = 0
    for r in rows:
        entry = compute_bag(r["image"], {"spacing": [5.0, 5.0, 5.0], "hu_window": [-1000, 400], "k": 8,
                                         "patch_size": 8})
        labels, nodule = candidate_truth([{"world": entry["world"]}], [r["ct"]], truth, entry["mask"][None])
        centres, diam, malignant = truth[r["ct"]]
        for j, w in enumerate(entry["world"]):
            dist = np.linalg.norm(centres - w, axis=1)
            inside = dist <= diam / 2
            assert labels[0, j] == int((inside & malignant).any())
            assert nodule[0, j] == (int(np.argmin(np.where(inside, dist, np.inf))) if inside.any() else -1)
        n_malignant_hits += int(labels.sum())
    assert n_malignant_hits >= 1  # the third of these CTs has its 12 mm cancer among the candidates


def test_instance_report_views():
    mask = np.array([[True, True, True, False], [True, True, False, False]])
    labels = np.array([[1, 1, 0, 0], [0, 0, 0, 0]])
    nodule = np.array([[0, 0, -1, -1], [1, -1, -1, -1]])
    probs = np.array([[0.3, 0.4, 0.1, 0.0], [0.2, 0.05, 0.0, 0.0]])
    rc = instance_report(probs, labels, mask, n_bootstrap=0)
    assert rc["n"] == 5 and rc["n_positive"] == 2 and rc["auc"] == pytest.approx(1.0)
    rn = instance_report(probs, labels, mask, view="nodules", nodule_of=nodule, n_bootstrap=0)
    # two detected nodules: (0.3 + 0.4 -> 0.7, malignant) and (0.2, benign)
    assert rn["n"] == 2 and rn["n_positive"] == 1
    assert rn["ece"] == pytest.approx((abs(0.7 - 1) + abs(0.2 - 0)) / 2)
    rmax = instance_report(probs, labels, mask, view="nodules", nodule_of=nodule, combine="max", n_bootstrap=0)
    assert rmax["ece"] == pytest.approx((abs(0.4 - 1) + 0.2) / 2)
    with pytest.raises(ValueError, match="nodule_of"):
        instance_report(probs, labels, mask, view="nodules")
