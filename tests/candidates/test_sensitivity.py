"""Is a lesion in the bag? ``holds_centre`` against the patches ``extract_patches`` really cuts,
``lesion_ranks`` for a mass and a nodule, ``wilson_interval`` against published values."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.candidates.bags import extract_patches
from lungcal.candidates.sensitivity import holds_centre, lesion_ranks, wilson_interval


def test_the_patch_faces_are_those_extract_patches_cuts():
    """An even patch of P voxels around centre voxel c spans c - P//2 .. c + P//2 - 1: its faces lie half
    a voxel beyond, where holds_centre puts them."""
    vol = np.broadcast_to(np.arange(40, dtype=np.float32)[:, None, None], (40, 40, 40))
    patch = extract_patches(vol, np.array([[20, 20, 20]]), 16)[0]
    assert patch[0, 0, 0] == 12 and patch[-1, 0, 0] == 27  # 20 - 8 .. 20 + 7
    c = np.array([[20, 20, 20]])
    # lesion centres 2 voxels (5 mm at 2.5 mm) inside the low and the high x face: 11.5 + 2, 27.5 - 2
    assert holds_centre(np.array([[13.5, 20, 20], [25.5, 20, 20]]), c, 16, (2.5, 2.5, 2.5)).all()


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_the_5_mm_margin_is_inclusive_at_its_boundary(axis):
    c = np.array([[30, 30, 30]])
    sp = (2.5, 2.5, 2.5)
    lo_face, hi_face = 30 - 8 - 0.5, 30 - 8 - 0.5 + 16
    for pos, inside in [(lo_face + 2.0, True), (lo_face + 2.0 - 1e-6, False),
                        (hi_face - 2.0, True), (hi_face - 2.0 + 1e-6, False), (30.0, True)]:
        les = np.full((1, 3), 30.0)
        les[0, axis] = pos
        assert bool(holds_centre(les, c, 16, sp)[0, 0]) is inside, (axis, pos)
    # a wider margin needs the centre deeper: at 5 mm + a hair it no longer holds
    les = np.full((1, 3), 30.0)
    les[0, axis] = lo_face + 2.0
    assert not holds_centre(les, c, 16, sp, margin_mm=5.01)[0, 0]


def test_the_margin_is_in_mm_per_axis_on_anisotropic_voxels():
    """0.7 x 0.7 x 2.5 mm voxels, P = 32: 5 mm is 7.14 voxels in-plane but 2 voxels along z."""
    c = np.array([[50, 50, 50]])
    sp = (0.7, 0.7, 2.5)
    hi_face = 50 - 16 - 0.5 + 32  # 65.5
    assert holds_centre(np.array([[50, 50, hi_face - 2.0]]), c, 32, sp)[0, 0]  # 5.0 mm from the z face
    assert not holds_centre(np.array([[50, 50, hi_face - 1.9]]), c, 32, sp)[0, 0]  # 4.75 mm
    assert holds_centre(np.array([[hi_face - 7.2, 50, 50]]), c, 32, sp)[0, 0]  # 5.04 mm from the x face
    assert not holds_centre(np.array([[hi_face - 7.1, 50, 50]]), c, 32, sp)[0, 0]  # 4.97 mm
    # the same 2 voxels along x would be only 1.4 mm: not held
    assert not holds_centre(np.array([[hi_face - 2.0, 50, 50]]), c, 32, sp)[0, 0]
    # (L, N): every lesion against every candidate
    out = holds_centre(np.array([[50, 50, 50], [0, 0, 0]]), np.array([[50, 50, 50], [1, 1, 1], [90, 90, 90]]), 32, sp)
    assert out.shape == (2, 3) and out.tolist() == [[True, False, False], [False, True, False]]


def _grid(spacing=2.5, origin=(-100.0, -120.0, -300.0), flip=False):
    a = np.diag([spacing, spacing, spacing, 1.0])
    if flip:  # an LPS-like grid: x and y run the other way
        a[0, 0] = a[1, 1] = -spacing
    a[:3, 3] = origin
    return a


@pytest.mark.parametrize("flip", [False, True])
def test_lesion_ranks_a_mass_is_reached_by_a_candidate_on_it_a_nodule_only_by_a_patch_round_it(flip):
    affine = _grid(flip=flip)
    lesion_vox = np.array([40.0, 40.0, 40.0])

    def world(v):
        return np.asarray(v, float) @ affine[:3, :3].T + affine[:3, 3]

    cand_vox = np.array([[5, 5, 5],      # far from everything
                         [48, 40, 40],   # 20 mm off: on a 25 mm mass, but the lesion sits on its patch's face
                         [41, 40, 40]])  # 2.5 mm off: its patch holds the centre 17.5 mm inside
    cand_world = world(cand_vox)
    centre = world(lesion_vox)[None]
    mass = lesion_ranks(centre, np.array([25.0]), np.array([True]), cand_vox, cand_world, affine, 16)
    nodule = lesion_ranks(centre, np.array([25.0]), np.array([False]), cand_vox, cand_world, affine, 16)
    small = lesion_ranks(centre, np.array([4.0]), np.array([True]), cand_vox, cand_world, affine, 16)
    assert mass.tolist() == [2] and nodule.tolist() == [3] and small.tolist() == [3]
    # a lesion no candidate reaches has rank 0; no candidates at all: every rank 0
    far = world([200.0, 200.0, 200.0])[None]
    assert lesion_ranks(np.vstack([centre, far]), np.array([25.0, 25.0]), np.array([True, True]), cand_vox,
                        cand_world, affine, 16).tolist() == [2, 0]
    assert lesion_ranks(centre, np.array([25.0]), np.array([True]), np.zeros((0, 3), int), np.zeros((0, 3)),
                        affine, 16).tolist() == [0]


@pytest.mark.parametrize("k, n, low, high", [  # Newcombe (1998), Stat Med 17:857, Table I, method 3 (score)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_interval_matches_newcombes_published_values(k, n, low, high):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=5e-5) and hi == pytest.approx(high, abs=5e-5)


def test_wilson_interval_closed_form_and_edges():
    k, n, z = 27, 30, 1.959963984540054
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert wilson_interval(k, n) == pytest.approx((mid - half, mid + half), abs=1e-9)
    assert wilson_interval(30, 30)[1] == pytest.approx(1.0)
    assert all(np.isnan(wilson_interval(0, 0)))
    lo90, hi90 = wilson_interval(k, n, level=0.90)
    assert mid - half < lo90 < hi90 < mid + half
