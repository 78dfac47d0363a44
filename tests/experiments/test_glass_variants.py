"""experiments/glass_variants.py: the local-contrast channel is the shipped one at 0 mm; the table counts targets;
the shell test; experiments/learned_rerank.py: the radial profile."""
from __future__ import annotations

import numpy as np

from lungcal.candidates.detector import Candidates
from lungcal.candidates.lesions import GlassChannel
from tests.experiments.conftest import load_script


def _lung_with_glass() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    hu = np.full((40, 40, 30), -850.0) + rng.normal(0, 20, (40, 40, 30))
    z, y, x = np.ogrid[:40, :40, :30]
    hu[(z - 20) ** 2 + (y - 18) ** 2 + (x - 15) ** 2 <= 16] = -600.0  # a ground-glass blob, 8 voxels across
    mask = np.zeros(hu.shape, bool)
    mask[4:36, 4:36, 3:27] = True
    return ((hu + 1000) / 1400).astype(np.float32), mask


def test_the_local_contrast_channel_at_0_mm_is_the_shipped_channel_and_finds_the_blob():
    gv = load_script("glass_variants")
    img, mask = _lung_with_glass()
    sp, aff = (2.5, 2.5, 2.5), np.diag([2.5, 2.5, 2.5, 1.0])
    shipped = GlassChannel(top_k=8).detect(img, mask, sp, aff)
    same = gv.LocalContrastGlass(top_k=8).detect(img, mask, sp, aff)
    np.testing.assert_array_equal(same.voxel, shipped.voxel)
    np.testing.assert_allclose(same.score, shipped.score)
    local = gv.LocalContrastGlass(top_k=8, background_mm=12.0).detect(img, mask, sp, aff)
    assert np.abs(local.voxel[0] - [20, 18, 15]).max() <= 1  # the blob is still the best


def test_the_table_counts_only_the_targets_per_place():
    gv = load_script("glass_variants")
    rows = [{"variant": "a", "kind": "part-solid", "place": "pleura", "diameter_mm": 9, "gg_hu": -600, "in_bag": True},
            {"variant": "a", "kind": "part-solid", "place": "free", "diameter_mm": 6, "gg_hu": -600, "in_bag": True},
            {"variant": "a", "kind": "ground-glass", "place": "free", "diameter_mm": 12, "gg_hu": -750,
             "in_bag": False},
            {"variant": "a", "kind": "ground-glass", "place": "free", "diameter_mm": 12, "gg_hu": -650,
             "in_bag": False}]
    lines = gv.table(rows).splitlines()
    assert lines[2] == "| a | ground-glass | 0/1 | 0/1 | 0/0 | 0/0 | 0/0 |"
    assert lines[3] == "| a | part-solid | 1/1 | 0/0 | 1/1 | 0/0 | 0/0 |"


def test_growing_the_dense_voxels_once_is_the_shipped_channel():
    gv = load_script("glass_variants")
    img, mask = _lung_with_glass()
    sp, aff = (2.5, 2.5, 2.5), np.diag([2.5, 2.5, 2.5, 1.0])
    shipped = GlassChannel(top_k=8).detect(img, mask, sp, aff)
    once = gv.LocalContrastGlass(top_k=8, dense_grow=1).detect(img, mask, sp, aff)
    np.testing.assert_array_equal(once.voxel, shipped.voxel)
    twice = gv.LocalContrastGlass(top_k=8, dense_grow=2).detect(img, mask, sp, aff)
    assert np.abs(twice.voxel[0] - [20, 18, 15]).max() <= 1  # no dense voxel near the blob: still found


def test_the_channels_table_reads_larger_bags_and_the_misses_ranks_per_channel():
    gv = load_script("glass_variants")
    row = {"kind": "part-solid", "place": "free", "diameter_mm": 9, "gg_hu": -600}
    rows = [{**row, "rank_solid": 3, "rank_glass": 0, "rank_merged": 2},
            {**row, "rank_solid": 100, "rank_glass": 12, "rank_merged": 40},
            {**row, "rank_solid": 0, "rank_glass": 70, "rank_merged": 0},
            {**row, "diameter_mm": 5, "rank_solid": 0, "rank_glass": 0, "rank_merged": 0}]  # not a target
    line = gv.channels_table(rows).splitlines()[2]
    assert line == "| part-solid | 1/3 | 1/3 | 2/3 | 2/3 | 2 | 100, 0, 1 | 41, 1, 1, 0 |"


def _blob_and_crossing() -> tuple[np.ndarray, np.ndarray]:
    """HU: lung at -850 with a 10 mm ball at (12, 20, 15) and two crossing vessels (3 voxels wide) at (28, 20, 15)."""
    hu = np.full((40, 40, 30), -850.0)
    z, y, x = np.ogrid[:40, :40, :30]
    hu[(z - 12) ** 2 + (y - 20) ** 2 + (x - 15) ** 2 <= 4] = 0.0
    hu[27:30, :, 14:17] = 0.0
    hu[27:30, 19:22, :] = 0.0
    return hu, np.ones(hu.shape, bool)


def test_the_shell_of_a_ball_is_lung_and_a_vessel_crossings_is_not():
    gv = load_script("glass_variants")
    hu, lung = _blob_and_crossing()
    f = gv.shell_bright_fraction(hu, lung, np.array([[12, 20, 15], [28, 20, 15]]), np.array([5.0, 5.0]),
                                 np.array([2.5, 2.5, 2.5]), -850.0)
    assert f[0] == 0.0
    assert f[1] > 0.15  # four branches leave through the shell
    # the shell counts lung voxels only: with no lung around, nothing to say
    assert np.isnan(gv.shell_bright_fraction(hu, np.zeros_like(lung), np.array([[12, 20, 15]]), np.array([5.0]),
                                             np.array([2.5, 2.5, 2.5]), -850.0)[0])


def test_the_learned_stages_profile_sees_the_ball_dense_inside_and_lung_around():
    lr = load_script("learned_rerank")
    hu, lung = _blob_and_crossing()
    c = Candidates(np.array([[12, 20, 15]]), np.zeros((1, 3)), np.array([5.0]), np.array([1.0]))
    f = lr.candidate_features(hu, lung, np.full(hu.shape, 30.0), c, 1, np.array([2.5, 2.5, 2.5]), -850.0)
    assert f.shape == (1, 6 + 5 * (len(lr.SHELLS_MM) + len(lr.SHELLS_R)))
    assert list(f[0, :6]) == [1, 0, 1.0, 5.0, 30.0, 850.0]  # channel, rank, score, radius, depth, centre above lung
    first, fourth = f[0, 6:11], f[0, 21:26]  # shells 0-2.5 mm and 7.5-10 mm: mean, quartiles, lung share
    assert first[0] == 850.0 and fourth[0] == 0.0 and fourth[4] == 1.0
