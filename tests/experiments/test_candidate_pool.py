"""experiments/candidate_pool.py: the offline suppression with the shipped rule rebuilds the detector's own
candidates; the rules differ where a weaker peak touches a better one; the interleave follows the rule."""
from __future__ import annotations

import numpy as np
from scipy import ndimage

from lungcal.candidates.detector import Candidates, LoGBlobDetector
from lungcal.candidates.lesions import LesionDetector, interleave
from tests.experiments.conftest import load_script

SP = np.array([2.5, 2.5, 2.5])
AFF = np.diag([2.5, 2.5, 2.5, 1.0])


def _lung_with_blobs() -> tuple[np.ndarray, np.ndarray]:
    """A noisy lung with a large bright blob and a small one touching it, and a faint blob apart."""
    rng = np.random.default_rng(1)
    hu = np.full((48, 48, 40), -850.0) + rng.normal(0, 20, (48, 48, 40))
    z, y, x = np.ogrid[:48, :48, :40]
    hu[(z - 20) ** 2 + (y - 20) ** 2 + (x - 20) ** 2 <= 25] = 40.0   # 5 voxels radius
    hu[(z - 20) ** 2 + (y - 27) ** 2 + (x - 20) ** 2 <= 4] = 40.0    # touching it
    hu[(z - 34) ** 2 + (y - 34) ** 2 + (x - 12) ** 2 <= 9] = -600.0  # ground glass
    mask = np.zeros(hu.shape, bool)
    mask[4:44, 4:44, 3:37] = True
    return ((hu + 1000) / 1400).astype(np.float32), mask


def test_the_shipped_rule_offline_is_the_detectors_own_suppression():
    cp = load_script("candidate_pool")
    img, mask = _lung_with_blobs()
    raw = cp.raw_peaks(img, mask, AFF)
    chans = LesionDetector()._channels()
    shipped = LoGBlobDetector(**{**{k: getattr(chans["S"], k) for k in ("radii_mm", "pyramid_sigma_vox")},
                                 "top_k": 3000}).detect(img, mask, SP, AFF)
    offline = cp.suppress(raw["S"], SP, cp.reach_fn("overlap", 5.0), 3000)
    assert len(raw["S"]) > len(offline) > 0  # the suppression dropped something
    np.testing.assert_array_equal(offline.voxel, shipped.voxel)
    np.testing.assert_allclose(offline.score, shipped.score)
    merged = cp.interleave_by({"S": offline.top(16), "G": cp.suppress(raw["G"], SP, cp.reach_fn("overlap", 5.0), 16)},
                              "SSSG", SP, 16, cp.reach_fn("overlap", 5.0))
    ref = interleave({"S": offline.top(16), "G": cp.suppress(raw["G"], SP, cp.reach_fn("overlap", 5.0), 16)},
                     "SSSG", SP, 16, 5.0)
    np.testing.assert_array_equal(merged.voxel, ref.voxel)


def test_the_rules_keep_more_as_they_loosen():
    cp = load_script("candidate_pool")
    # three peaks on a line, best first: 0 at 0 mm (r 10), 1 at 8 mm (r 3: inside 0's sphere), 2 at 14 mm (r 5:
    # its sphere overlaps 0's, its centre is outside it, and it is 6 mm from 1)
    c = Candidates(np.array([[0, 0, 0], [0, 0, 8], [0, 0, 14]]), np.array([[0.0, 0, 0], [0, 0, 8], [0, 0, 14]]),
                   np.array([10.0, 3.0, 5.0]), np.array([3.0, 2.0, 1.0]))
    kept = {rule: len(cp.suppress(c, np.ones(3), cp.reach_fn(rule, 5.0), 10)) for rule in cp.RULES}
    assert kept == {"overlap": 1, "centre": 2, "min": 3}


def test_on_rank_finds_a_peak_within_the_radius_or_5_mm():
    cp = load_script("candidate_pool")
    c = Candidates(np.zeros((3, 3), int), np.array([[30.0, 0, 0], [0, 0, 4.0], [0, 0, 0.5]]), np.ones(3), np.ones(3))
    ranks = cp.on_rank(np.array([[0.0, 0, 0], [100.0, 0, 0]]), np.array([2.0, 2.0]), c)
    assert ranks.tolist() == [2, 0]


def test_facing_z_tells_a_floor_from_a_wall():
    """``pleura_z``: 1 where the lung's surface faces up or down (a floor), 0 where it faces sideways (a wall),
    NaN deep inside, where the smoothed mask is flat."""
    cp = load_script("candidate_pool")
    lung = np.zeros((40, 40, 40), bool)
    lung[:, :, 20:] = True  # the lung above z 20: its floor faces down
    grad = np.gradient(ndimage.gaussian_filter(lung.astype(np.float32), 6.0 / SP), *SP)
    assert cp._facing_z(grad, (20, 20, 20)) > 0.95
    wall = np.moveaxis(lung, 2, 0)  # the same surface facing along x
    grad = np.gradient(ndimage.gaussian_filter(wall.astype(np.float32), 6.0 / SP), *SP)
    assert cp._facing_z(grad, (20, 20, 20)) < 0.05
    assert np.isnan(cp._facing_z(grad, (39, 20, 20)))
