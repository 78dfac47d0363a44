"""LoGBlobDetector: planted blobs, world coordinates, NMS, empty inputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from lungcal.candidates import detector as detector_module
from lungcal.candidates.detector import (
    Candidates,
    Detector,
    LoGBlobDetector,
    _block_mean,
    _laplacian,
    _neighbourhood,
    _not_below,
    voxel_to_world,
    world_to_voxel,
)


def _phantom(shape, spacing, blobs, noise=0.02, seed=0, background=0.15):
    """Volume in [0, 1]: dark parenchyma + noise + bright soft spheres (centre vox, radius mm)."""
    rng = np.random.default_rng(seed)
    vol = np.full(shape, background, np.float32) + rng.normal(0, noise, shape).astype(np.float32)
    g = np.indices(shape).astype(np.float32)
    for (cx, cy, cz), r in blobs:
        d = np.sqrt(((g[0] - cx) * spacing[0]) ** 2 + ((g[1] - cy) * spacing[1]) ** 2
                    + ((g[2] - cz) * spacing[2]) ** 2)
        vol += 0.6 / (1 + np.exp(np.clip((d - r) / 0.6, -50, 50)))
    return np.clip(vol, 0, 1)


BLOBS = [((20, 24, 14), 6.0), ((44, 40, 26), 3.5), ((30, 46, 10), 9.0)]
SPACING = (2.0, 1.8, 2.5)
SHAPE = (64, 64, 36)


def _mask():
    m = np.zeros(SHAPE, bool)
    m[4:60, 4:60, 3:33] = True
    return m


def test_protocol_and_planted_blobs_found_first():
    det = LoGBlobDetector(top_k=10)
    assert isinstance(det, Detector)
    vol = _phantom(SHAPE, SPACING, BLOBS)
    c = det.detect(torch.from_numpy(vol)[None], torch.from_numpy(_mask())[None], SPACING, np.diag([*SPACING, 1.0]))
    assert isinstance(c, Candidates) and 3 <= len(c) <= 10
    assert np.all(np.diff(c.score) <= 0)
    top3 = c.voxel[:3]
    for centre, r in BLOBS:
        d_mm = np.sqrt((((top3 - np.asarray(centre)) * SPACING) ** 2).sum(1))
        j = int(np.argmin(d_mm))
        assert d_mm[j] <= 2.6, (centre, top3)
        assert c.radius_mm[j] == pytest.approx(r, rel=0.45)
    # the largest blob gets the largest radius estimate among the three
    d_big = np.sqrt((((top3 - np.asarray(BLOBS[2][0])) * SPACING) ** 2).sum(1))
    assert c.radius_mm[np.argmin(d_big)] == c.radius_mm[:3].max()


def test_world_coordinates_follow_a_rotated_affine():
    vol = _phantom(SHAPE, SPACING, BLOBS)
    theta = np.deg2rad(30)
    rot = np.array([[np.cos(theta), -np.sin(theta), 0], [np.sin(theta), np.cos(theta), 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = rot @ np.diag(SPACING) @ np.diag([-1, -1, 1])  # LPS-like flip, then rotation
    affine[:3, 3] = [120.0, -35.5, -400.25]
    c = LoGBlobDetector(top_k=5).detect(vol, _mask(), SPACING, affine)
    expect = np.stack([rot @ (np.diag(SPACING) @ np.diag([-1, -1, 1]) @ v) + affine[:3, 3] for v in c.voxel])
    np.testing.assert_allclose(c.world, expect, atol=1e-9)
    np.testing.assert_allclose(world_to_voxel(c.world, affine), c.voxel, atol=1e-9)
    np.testing.assert_allclose(voxel_to_world(c.voxel, affine), c.world)


def test_nms_merges_a_blob_into_one_candidate_and_respects_min_distance():
    vol = _phantom(SHAPE, SPACING, [((32, 32, 18), 10.0)], noise=0.0)
    c = LoGBlobDetector(top_k=10, threshold=0.05).detect(vol, np.ones(SHAPE, bool), SPACING, np.eye(4))
    assert len(c) >= 1
    # no two candidates closer than min_distance (or their radii sum)
    pos = c.voxel * np.asarray(SPACING)
    d = np.sqrt(((pos[:, None] - pos[None]) ** 2).sum(-1))
    reach = np.maximum(5.0, c.radius_mm[:, None] + c.radius_mm[None])
    off = ~np.eye(len(c), dtype=bool)
    assert np.all(d[off] >= reach[off] - 1e-9)
    near = np.sqrt((((c.voxel - [32, 32, 18]) * SPACING) ** 2).sum(1)) < 10
    assert near.sum() == 1


def test_top_k_and_threshold():
    vol = _phantom(SHAPE, SPACING, BLOBS)
    assert len(LoGBlobDetector(top_k=2).detect(vol, _mask(), SPACING, np.eye(4))) == 2
    assert len(LoGBlobDetector(top_k=0).detect(vol, _mask(), SPACING, np.eye(4))) == 0
    hi = LoGBlobDetector(top_k=50, threshold=10.0).detect(vol, _mask(), SPACING, np.eye(4))
    assert len(hi) == 0 and hi.voxel.shape == (0, 3) and hi.world.shape == (0, 3)


def test_empty_mask_and_flat_volume_give_no_candidates():
    vol = _phantom(SHAPE, SPACING, BLOBS)
    c = LoGBlobDetector().detect(vol, np.zeros(SHAPE, bool), SPACING, np.eye(4))
    assert len(c) == 0 and c.radius_mm.shape == (0,) and c.score.shape == (0,)
    flat = np.full(SHAPE, 0.1, np.float32)
    assert len(LoGBlobDetector().detect(flat, _mask(), SPACING, np.eye(4))) == 0


def test_blobs_outside_the_lung_are_ignored_but_juxtapleural_kept():
    # blob A well outside the mask, blob B just across the mask border (juxtapleural)
    vol = _phantom(SHAPE, SPACING, [((10, 32, 18), 5.0), ((40, 32, 18), 5.0)], noise=0.0)
    mask = np.zeros(SHAPE, bool)
    mask[22:60, 4:60, 3:33] = True
    mask[37:44, 28:37, 14:23] = False  # the nodule is cut out of a threshold-based lung mask
    c = LoGBlobDetector(top_k=5, mask_closing_mm=10.0).detect(vol, mask, SPACING, np.eye(4))
    assert len(c) >= 1
    d_a = np.sqrt((((c.voxel - [10, 32, 18]) * SPACING) ** 2).sum(1))
    d_b = np.sqrt((((c.voxel - [40, 32, 18]) * SPACING) ** 2).sum(1))
    assert d_b.min() <= 2.6
    assert d_a.min() > 8.0


def test_border_mm_keeps_mask_border_voxels_out():
    # a bright rib-like spot on the outermost layer of the lung mask is ignored with border_mm > 0
    vol = _phantom(SHAPE, SPACING, [((5, 32, 18), 3.0), ((32, 32, 18), 4.0)], noise=0.0)
    mask = np.zeros(SHAPE, bool)
    mask[5:60, 4:60, 3:33] = True
    c = LoGBlobDetector(top_k=5, border_mm=3.0).detect(vol, mask, SPACING, np.eye(4))
    assert np.sqrt((((c.voxel - [5, 32, 18]) * SPACING) ** 2).sum(1)).min() > 5.0
    assert np.sqrt((((c.voxel[0] - [32, 32, 18]) * SPACING) ** 2).sum()) <= 2.6
    c0 = LoGBlobDetector(top_k=5).detect(vol, mask, SPACING, np.eye(4))  # default border_mm = 0
    assert np.sqrt((((c0.voxel - [5, 32, 18]) * SPACING) ** 2).sum(1)).min() <= 2.6


def test_shape_filter_ranks_a_nodule_above_a_vessel():
    vol = np.full(SHAPE, 0.15, np.float32)
    g = np.indices(SHAPE).astype(np.float32)
    d_tube = np.sqrt(((g[0] - 20) * SPACING[0]) ** 2 + ((g[2] - 18) * SPACING[2]) ** 2)
    vol += 0.6 / (1 + np.exp(np.clip((d_tube - 3.0) / 0.6, -50, 50)))  # vessel along y
    d_ball = np.sqrt(((g[0] - 44) * SPACING[0]) ** 2 + ((g[1] - 30) * SPACING[1]) ** 2
                     + ((g[2] - 18) * SPACING[2]) ** 2)
    vol += 0.6 / (1 + np.exp(np.clip((d_ball - 3.0) / 0.6, -50, 50)))
    mask = np.ones(SHAPE, bool)
    c = LoGBlobDetector(top_k=5).detect(vol, mask, SPACING, np.eye(4))
    assert np.sqrt((((c.voxel[0] - [44, 30, 18]) * SPACING) ** 2).sum()) <= 2.6
    tube_scores = c.score[np.abs(c.voxel[:, 0] - 20) <= 2]
    assert tube_scores.size == 0 or tube_scores.max() < 0.5 * c.score[0]


def test_bad_inputs():
    with pytest.raises(ValueError):
        LoGBlobDetector().detect(np.zeros((8, 8, 8)), np.zeros((8, 8, 9)), (1, 1, 1), np.eye(4))
    with pytest.raises(ValueError):
        LoGBlobDetector(radii_mm=())
    with pytest.raises(ValueError):
        Candidates(np.zeros((2, 3)), np.zeros((2, 3)), np.ones(2), np.array([0.1, 0.5]))


@pytest.mark.parametrize("diameter", [40.0, 50.0])
def test_masses_up_to_50_mm_are_found_at_their_size(diameter):
    spacing, shape = (2.5, 2.5, 2.5), (64, 64, 48)
    centre = (32, 30, 24)
    vol = _phantom(shape, spacing, [(centre, diameter / 2)] + [((10, 10, 8), 3.0)])
    mask = np.ones(shape, bool)
    c = LoGBlobDetector(top_k=5).detect(vol, mask, spacing, np.diag([*spacing, 1.0]))
    d_mm = np.sqrt((((c.voxel - np.asarray(centre)) * spacing) ** 2).sum(1))
    assert d_mm[0] <= 5.0, (c.voxel, c.radius_mm)  # the mass is the top candidate ...
    assert c.radius_mm[0] == pytest.approx(diameter / 2, rel=0.3)  # ... at its own scale
    # with the former largest scale (14 mm) the estimate is capped far below the mass' size
    old = LoGBlobDetector(top_k=5, radii_mm=(2.5, 3.5, 5.0, 7.0, 10.0, 14.0)).detect(vol, mask, spacing, np.eye(4))
    assert old.radius_mm.max() <= 14.0 + 1e-9


def test_scales_narrower_than_half_a_voxel_are_skipped():
    det = LoGBlobDetector()
    assert min(det.radii_mm) == 1.5 and max(det.radii_mm) == 25.0  # nodules of 3 mm to masses of 50 mm
    fine, coarse = det.sigmas_mm((1.0, 1.0, 1.0)), det.sigmas_mm((2.5, 2.5, 2.5))
    np.testing.assert_allclose(fine, np.sort(det.radii_mm) / np.sqrt(3))
    np.testing.assert_allclose(coarse, fine[1:])  # 1.5 mm / sqrt(3) = 0.35 voxel at 2.5 mm
    assert len(LoGBlobDetector(radii_mm=(0.5,)).sigmas_mm((3.0, 3.0, 3.0))) == 1  # the largest always stays


def test_laplacian_and_neighbourhood_checks_equal_their_padded_and_filtered_forms():
    rng = np.random.default_rng(1)
    g = rng.random((7, 5, 6), dtype=np.float32)
    sp = np.array([0.7, 1.0, 2.5])
    gp = np.pad(g, 1, mode="edge")
    ref = np.zeros_like(g)
    for axis in range(3):
        lo, hi = [slice(1, -1)] * 3, [slice(1, -1)] * 3
        lo[axis], hi[axis] = slice(0, -2), slice(2, None)
        ref += (gp[tuple(lo)] + gp[tuple(hi)] - 2 * gp[1:-1, 1:-1, 1:-1]) / np.float32(sp[axis] ** 2)
    assert np.array_equal(_laplacian(g, sp), ref)  # bit-identical, without the padded copy
    assert np.array_equal(_laplacian(g, sp, slab=2), ref)  # in slabs of 2 planes with their halo

    idx = np.argwhere(np.ones(g.shape, bool))
    one = np.ones(3, np.int64)
    got = _not_below(g, one, _neighbourhood(idx, one, g.shape), g[tuple(idx.T)])
    assert np.array_equal(got, (ndimage.maximum_filter(g, size=3, mode="nearest") == g)[tuple(idx.T)])

    step = np.array([2, 3, 1])
    want = np.pad(g, [(0, 1), (0, 1), (0, 0)], mode="edge").reshape(4, 2, 2, 3, 6, 1).mean(axis=(1, 3, 5))
    np.testing.assert_allclose(_block_mean(g, step), want, rtol=1e-6)


def test_the_pyramid_and_the_coarse_mask_leave_2_5_mm_alone_and_find_masses_at_1_mm():
    det = LoGBlobDetector()
    assert (det.grid_steps((2.5, 2.5, 2.5)) == 1).all()  # the demo's grid: bit-identical to no pyramid
    assert det.grid_steps((1.0, 1.0, 1.0))[:, 0].tolist() == [1, 1, 1, 1, 1, 1, 2, 3, 4]
    demo = (2.5, 2.5, 2.5)
    args = (_phantom(SHAPE, demo, BLOBS), _mask(), demo, np.diag([*demo, 1.0]))
    a = LoGBlobDetector().detect(*args)
    b = LoGBlobDetector(pyramid_sigma_vox=0, mask_voxel_mm=0).detect(*args)
    assert np.array_equal(a.voxel, b.voxel) and np.array_equal(a.score, b.score)

    # 1 mm: a 40 mm mass (its scales run on 2-4 mm blocks) and a 6 mm nodule (full grid)
    spacing, shape = (1.0, 1.0, 1.0), (96, 96, 80)
    blobs = [((48, 46, 40), 20.0), ((12, 14, 12), 3.0)]
    vol, mask = _phantom(shape, spacing, blobs), np.ones(shape, bool)
    fast = LoGBlobDetector(top_k=5).detect(vol, mask, spacing, np.eye(4))
    full = LoGBlobDetector(top_k=5, pyramid_sigma_vox=0, mask_voxel_mm=0).detect(vol, mask, spacing, np.eye(4))
    for c in (fast, full):
        for centre, r in blobs:
            d = np.sqrt(((c.voxel - np.asarray(centre)) ** 2).sum(1))
            j = int(np.argmin(d))
            assert d[j] <= 2.0, (centre, c.voxel)  # at most half a 4-voxel block off
            assert c.radius_mm[j] == pytest.approx(r, rel=0.3)


def test_the_local_maximum_prefilter_of_large_grids_keeps_exactly_the_same_candidates(monkeypatch):
    """On a grid above LOCAL_MAX_PREFILTER_VOXELS only 3x3x3 maxima are indexed (the peak memory of the
    1 mm preset); the neighbourhood checks keep exactly those anyway, so the candidates are identical."""
    vol = _phantom(SHAPE, SPACING, BLOBS, noise=0.05)  # noisy: many points above threshold that are no peaks
    args = (torch.from_numpy(vol)[None], torch.from_numpy(_mask())[None], SPACING, np.diag([*SPACING, 1.0]))
    det = LoGBlobDetector(top_k=40)
    plain = det.detect(*args)
    monkeypatch.setattr(detector_module, "LOCAL_MAX_PREFILTER_VOXELS", 0)  # every scale filtered
    filtered = det.detect(*args)
    assert len(plain) > 10
    for name in ("voxel", "world", "score", "radius_mm"):
        np.testing.assert_array_equal(getattr(filtered, name), getattr(plain, name), err_msg=name)


@pytest.mark.parametrize("slab", [1, 2, 5, 16, 64])
def test_the_local_maxima_found_in_slabs_are_those_of_the_whole_volume(monkeypatch, slab):
    """``_points_above`` on a large grid filters slab by slab (a few planes of scratch, not a volume):
    the points must be exactly those of one maximum filter over the whole volume, in the same order."""
    monkeypatch.setattr(detector_module, "LOCAL_MAX_PREFILTER_VOXELS", 0)
    resp = ndimage.gaussian_filter(np.random.default_rng(3).normal(size=(37, 20, 15)), 1.0).astype(np.float32)
    resp[5:8] = resp[5]  # plateaus across slab borders: ties count as maxima
    want = np.argwhere((resp > 0.02) & (resp >= ndimage.maximum_filter(resp, size=3, mode="nearest")))
    got = detector_module._points_above(resp, 0.02, slab=slab)
    assert len(want) > 20
    np.testing.assert_array_equal(got, want)
