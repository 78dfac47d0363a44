"""lungcal.data.synthetic.phantom: anatomy in HU, nodule placement, scanner effects, determinism."""
from __future__ import annotations

import numpy as np

from lungcal.data.synthetic import ScannerProfile, make_phantom, place_nodules, sample_anatomy

SHAPE, SPACING = (64, 64, 40), (5.0, 5.0, 6.0)


def test_phantom_tissues_and_determinism():
    hu, origin, lung = make_phantom(np.random.default_rng(4), SHAPE, SPACING)
    assert hu.dtype == np.int16 and hu.shape == SHAPE
    np.testing.assert_allclose(origin, -(np.asarray(SHAPE) - 1) / 2 * np.asarray(SPACING))
    assert 0.05 < lung.mean() < 0.5
    assert -950 < np.median(hu[lung]) < -750  # parenchyma about -860 HU
    assert np.median(hu[0]) < -900  # air outside the body at the field-of-view edge
    assert hu.max() > 400  # bone (ribs, vertebrae)
    again, _, _ = make_phantom(np.random.default_rng(4), SHAPE, SPACING)
    np.testing.assert_array_equal(hu, again)
    other, _, _ = make_phantom(np.random.default_rng(5), SHAPE, SPACING)
    assert not np.array_equal(hu, other)


def test_scanner_offset_and_noise():
    quiet = ScannerProfile(noise_hu=0.0, kernel_sigma_mm=0.0)
    a, _, _ = make_phantom(np.random.default_rng(1), SHAPE, SPACING, scanner=quiet, lungs=False)
    b, _, _ = make_phantom(np.random.default_rng(1), SHAPE, SPACING, lungs=False,
                           scanner=ScannerProfile(noise_hu=0.0, kernel_sigma_mm=0.0, hu_offset=25.0))
    inside = (a > -1000) & (a < 3000) & (b < 3071)  # away from the clipping limits
    shift = b[inside].astype(int) - a[inside]
    assert np.abs(shift - 25).max() <= 1 and abs(shift.mean() - 25) < 0.01  # +-1 only where rint meets .5
    c, _, _ = make_phantom(np.random.default_rng(1), SHAPE, SPACING, lungs=False,
                           scanner=ScannerProfile(noise_hu=40.0, kernel_sigma_mm=0.0))
    assert 30 < np.std(c.astype(float) - a) < 50


def test_nodules_are_placed_in_the_lungs_and_rendered():
    rng = np.random.default_rng(2)
    anat = sample_anatomy(rng, SHAPE, SPACING)
    _, origin, lung = make_phantom(np.random.default_rng(9), SHAPE, SPACING, anat=anat)
    feats = [(20.0, 0, 0, True), (8.0, 2, 2, False)]  # a smooth solid 20 mm, a spiculated calcified 8 mm
    nodules = place_nodules(rng, lung, SPACING, origin, feats)
    assert [n.margin for n in nodules] == ["smooth", "spiculated"]
    assert [n.attenuation for n in nodules] == ["solid", "calcified"]
    hu, _, _ = make_phantom(np.random.default_rng(9), SHAPE, SPACING, nodules=nodules, anat=anat)
    for n in nodules:
        vox = tuple(np.round((np.asarray(n.center_lps) - origin) / SPACING).astype(int))
        assert lung[vox]
        assert hu[vox] > -300  # soft tissue or calcium where the lung was
