"""lungcal.ct.masking: the body-first lung mask on phantoms (cut fields of view, padding, lesions on
the pleura, masses against the chest wall and the mediastinum) and its helpers against
scipy/scikit-image. The masses on real CTs: test_masking_masses.py."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage as ndi
from skimage.measure import label as sk_label

from lungcal.ct.masking import (
    LINES,
    LungMasker,
    _closing_2d,
    fill_holes_2d,
    largest_component,
    line_closing,
    upsample_nearest,
)
from lungcal.data.synthetic import Nodule, ScannerProfile, make_phantom

SHAPE, SPACING = (128, 128, 96), (2.5, 2.5, 2.5)


@pytest.fixture(scope="module")
def phantom():
    hu, origin, truth = make_phantom(np.random.default_rng(5), SHAPE, SPACING, (), ScannerProfile(noise_hu=15))
    return hu, origin, truth


def _dice(a, b):
    return 2 * (a & b).sum() / (a.sum() + b.sum())


def test_mask_matches_the_phantom_and_the_lesion_closing_only_adds(phantom):
    hu, _, truth = phantom
    plain = LungMasker(lesion_closing_mm=0)(hu, SPACING)
    full = LungMasker()(hu, SPACING)
    assert _dice(plain, truth) > 0.9
    assert not (plain & ~full).any()  # the closing never removes lung
    assert (full & ~plain).sum() < 0.01 * truth.sum()  # and adds little to smooth lungs


def test_lungs_cut_by_the_field_of_view_survive(phantom):
    hu, _, truth = phantom
    xs = np.flatnonzero(truth.any(axis=(1, 2)))
    cut = 6  # voxels (15 mm) of each lung fall outside the image
    sl = np.s_[xs[0] + cut: xs[-1] + 1 - cut]
    small, t = np.ascontiguousarray(hu[sl]), truth[sl]
    # the case of the issue: every air component touching the image edge is the lungs
    labels, _ = ndi.label(small < -400)
    on_edge = np.unique(np.concatenate([labels[0].ravel(), labels[-1].ravel()]))
    assert np.isin(labels[t], on_edge[on_edge > 0]).mean() > 0.9
    m = LungMasker()(small, SPACING)
    assert _dice(m, t) > 0.9, _dice(m, t)
    # the air in front of and behind the body (still in the image) stays out
    assert not m[:, :3].any() and not m[:, -3:].any()


def test_padding_outside_the_reconstruction_circle_is_neither_air_nor_body(phantom):
    hu, _, truth = phantom
    x, y = np.ogrid[: SHAPE[0], : SHAPE[1]]
    outside = (x - SHAPE[0] / 2) ** 2 + (y - SHAPE[1] / 2) ** 2 > (0.49 * SHAPE[0]) ** 2
    padded = hu.copy()
    padded[outside] = -2048
    np.testing.assert_array_equal(LungMasker()(padded, SPACING), LungMasker()(hu, SPACING))


def test_a_lesion_on_the_pleura_is_taken_back():
    _, origin, truth = make_phantom(np.random.default_rng(5), SHAPE, SPACING, (), ScannerProfile(noise_hu=15))
    k, d = SHAPE[2] // 2, 20.0
    depth = ndi.distance_transform_edt(truth[:, :, k], sampling=SPACING[:2])
    pts = np.argwhere(np.abs(depth - (d / 2 - 1.0)) < 1.0)  # the nodule pokes 1 mm into the chest wall
    p = pts[np.argmax(pts[:, 0])]
    centre = origin + np.array([p[0], p[1], k]) * SPACING
    hu, origin, _ = make_phantom(np.random.default_rng(5), SHAPE, SPACING,
                                 [Nodule(tuple(centre), d, True, "smooth", "solid")], ScannerProfile(noise_hu=15))
    grid = np.indices(SHAPE).reshape(3, -1).T * np.asarray(SPACING) + origin
    nodule = (np.linalg.norm(grid - centre, axis=1) < d / 2).reshape(SHAPE)
    plain = LungMasker(lesion_closing_mm=0)(hu, SPACING)
    full = LungMasker()(hu, SPACING)
    assert plain[nodule].mean() < 0.1  # a threshold mask leaves it out ...
    assert full[nodule].mean() > 0.4, full[nodule].mean()  # ... the rolling ball takes most of it back
    assert (full & ~plain).sum() < 0.02 * plain.sum()


@pytest.mark.parametrize("side", ["lateral", "medial"])
def test_a_mass_against_the_chest_wall_or_the_mediastinum_is_taken_back(side):
    """A 5 cm mass, its centre 0.7 r inside the pleura (as the lesion bed plants them): the rolling ball
    of step 4 takes back its rim only, step 5 (the lung around it) most of it."""
    _, origin, truth = make_phantom(np.random.default_rng(5), SHAPE, SPACING, (), ScannerProfile(noise_hu=15))
    k, d = SHAPE[2] // 2, 50.0
    depth = ndi.distance_transform_edt(truth[:, :, k], sampling=SPACING[:2])
    pts = np.argwhere(np.abs(depth - 0.7 * d / 2) < 1.0)
    xs = np.flatnonzero(truth[:, :, k].any(axis=1))
    one_lung = pts[pts[:, 0] > (xs[0] + xs[-1]) / 2]
    p = one_lung[np.argmax(one_lung[:, 0]) if side == "lateral" else np.argmin(one_lung[:, 0])]
    centre = origin + np.array([p[0], p[1], k]) * SPACING
    hu, origin, _ = make_phantom(np.random.default_rng(5), SHAPE, SPACING,
                                 [Nodule(tuple(centre), d, True, "smooth", "solid")], ScannerProfile(noise_hu=15))
    grid = np.indices(SHAPE).reshape(3, -1).T * np.asarray(SPACING) + origin
    mass = (np.linalg.norm(grid - centre, axis=1) < d / 2).reshape(SHAPE)
    # step 5 alone: both without the rolling ball of the coronal and sagittal slices, which takes back
    # part of such a mass too (the shipped masker holds at least what step 5 holds)
    before = LungMasker(mass_chord_mm=0, lesion_closing_sideways_mm=0)(hu, SPACING)
    after = LungMasker(lesion_closing_sideways_mm=0)(hu, SPACING)
    assert not (after & ~LungMasker()(hu, SPACING)).any()
    assert before[mass].mean() < 0.25
    assert after[mass].mean() > 0.75, after[mass].mean()
    assert not (before & ~after).any()  # step 5 only adds
    near = (np.linalg.norm(grid - centre, axis=1) < d / 2 + 5.0).reshape(SHAPE)  # its blurred edge
    # beside it, at most a rim of the chest wall or the mediastinum it touches (6.6 mL medially)
    assert (after & ~before & ~near).sum() < 0.15 * mass.sum(), (after & ~before & ~near).sum()


def test_no_mass_no_change(phantom):
    """Without a mass, step 5 finds no core on the phantom: the mask is the same with it off."""
    hu, _, _ = phantom
    np.testing.assert_array_equal(LungMasker()(hu, SPACING), LungMasker(mass_chord_mm=0)(hu, SPACING))


def test_the_closing_never_bridges_the_mediastinum(phantom):
    hu, _, truth = phantom
    m = LungMasker(lesion_closing_mm=80.0)(hu, SPACING)  # a ball far wider than the gap between the lungs
    k = SHAPE[2] // 2
    cols = np.flatnonzero(truth[:, :, k].any(axis=1))
    gap = [x for x in range(cols[0], cols[-1]) if not truth[x, :, k].any()]
    assert gap, "the phantom's lungs should be apart at mid height"
    assert not m[gap[len(gap) // 2], :, k].any()


def test_no_lungs_gives_an_empty_mask():
    hu, _, _ = make_phantom(np.random.default_rng(1), (64, 64, 40), (4.0, 4.0, 5.0), lungs=False)
    assert LungMasker()(hu, (4.0, 4.0, 5.0)).sum() < 50


def test_helpers_against_scipy_and_skimage():
    rng = np.random.default_rng(0)
    m = ndi.binary_opening(rng.random((30, 28, 6)) > 0.45)
    per_slice = np.stack([ndi.binary_fill_holes(m[:, :, k]) for k in range(m.shape[2])], axis=2)
    np.testing.assert_array_equal(fill_holes_2d(m), per_slice)
    lab = sk_label(m, connectivity=1)
    sizes = np.bincount(lab.ravel())
    sizes[0] = 0
    np.testing.assert_array_equal(largest_component(m), lab == np.argmax(sizes))
    assert not largest_component(np.zeros((3, 3, 3), bool)).any()
    up = upsample_nearest(np.arange(8).reshape(2, 2, 2) > 3, (2, 3, 1), (4, 5, 2))
    assert up.shape == (4, 5, 2) and up[3, 4, 1] and not up[0, 0, 0]


@pytest.mark.parametrize("direction", [*LINES, (-1, 1, 0), (0, -1, -1)])
def test_line_closing_is_scipys_closing_with_the_whole_line(direction):
    """The sheared van Herk filters against ndi.binary_closing with the line as its structure (outside
    the array is background: the oracle runs on a copy padded by more than the line)."""
    rng = np.random.default_rng(1)
    m = ndi.binary_opening(rng.random((26, 30, 18)) > 0.6)
    d = np.asarray(direction)
    for n in (1, 2, 3, 8, 13, 31):
        h = n // 2
        se = np.zeros(tuple(2 * h * np.abs(d) + 1), bool)
        for t in range(-h, h + 1):
            se[tuple(h * np.abs(d) + t * d)] = True
        pad = 2 * h + 1
        want = ndi.binary_closing(np.pad(m, pad), structure=se)[pad:-pad, pad:-pad, pad:-pad]
        np.testing.assert_array_equal(line_closing(m, n, direction), want, err_msg=f"n={n}")
    assert len(LINES) == 13 and len({tuple(-np.asarray(v)) for v in LINES} & set(LINES)) == 0


@pytest.mark.parametrize("spacing", [(2.5, 2.5, 2.5), (0.7, 0.9, 1.25)])
def test_per_slice_closing_is_the_3d_transform_confined_to_each_slice(spacing):
    """``_closing_2d`` (two 2D transforms a slice) gives the one-volume form bit for bit: two 3D Euclidean
    distance transforms whose z sampling is too large for any distance to leave its slice, including a slice
    without lung and one the growth fills whole."""
    rng = np.random.default_rng(4)
    mask = ndi.binary_opening(rng.random((40, 36, 9)) < 0.55, iterations=1)
    mask[:, :, 0] = False  # no lung
    mask[:, :, 1] = True  # the growth fills it whole
    mask[5:30, 4:30, 2] = True
    mask[14:18, 12:20, 2] = False  # a notch the closing fills
    radius = 6.0
    samp = (spacing[0], spacing[1], 1e7)
    grown = ndi.distance_transform_edt(~mask, sampling=samp) <= radius
    want = ndi.distance_transform_edt(grown, sampling=samp) > radius
    got = _closing_2d(mask, radius, np.asarray(spacing))
    assert got.dtype == bool and got.shape == mask.shape
    np.testing.assert_array_equal(got, want)
    assert not got[:, :, 0].any() and got[:, :, 1].all() and got[14:18, 12:20, 2].all()


@pytest.mark.parametrize("seed", range(6))
def test_per_slice_closing_on_the_lungs_box_is_the_whole_slices(seed):
    """``_closing_2d`` transforms each slice on its lung's box padded past the radius: small lungs far from
    the slice's edges, lungs against one edge and lungs that span it give the one-volume form bit for bit."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(v) for v in rng.integers(12, 48, 3))
    mask = ndi.binary_opening(rng.random(shape) < rng.uniform(0.05, 0.6), iterations=int(rng.integers(0, 2)))
    z = shape[2] // 2
    mask[:, :, z] = False
    mask[shape[0] // 2: shape[0] // 2 + 4, shape[1] // 2: shape[1] // 2 + 5, z] = True  # a small lung, far in
    mask[shape[0] // 2 + 1, shape[1] // 2 + 2, z] = False  # its notch
    mask[:, :, 0] = False
    mask[:3, -4:, 0] = True  # a corner's lung: the box clipped on two sides
    spacing = rng.uniform(0.6, 3.0, 3)
    radius = float(rng.uniform(2.0, 15.0))
    samp = (spacing[0], spacing[1], 1e7)
    grown = ndi.distance_transform_edt(~mask, sampling=samp) <= radius
    want = ndi.distance_transform_edt(grown, sampling=samp) > radius
    np.testing.assert_array_equal(_closing_2d(mask, radius, spacing), want)
