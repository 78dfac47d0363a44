"""The scanner-kernel augmentation: the draw is seeded and bounded, and the softening is a Gaussian in mm
(scipy.ndimage as the oracle, anisotropic grids included)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from lungcal.ct.kernel import check_max_sigma, draw_kernel_sigma, soften


def test_max_sigma_is_three_widths_or_none_when_off():
    assert check_max_sigma(None) is None
    assert check_max_sigma(0.0) is None and check_max_sigma([0, 0, 0]) is None
    assert check_max_sigma(1.5) == [1.5, 1.5, 1.5]
    assert check_max_sigma([1.5, 1.5, 2.0]) == [1.5, 1.5, 2.0]
    for bad in ([-1.0], [1.0, 2.0], [np.nan], "x"):
        with pytest.raises(ValueError):
            check_max_sigma(bad)


def test_the_draw_is_seeded_one_fraction_for_all_axes_and_covers_zero_to_the_maximum():
    mx = [1.5, 1.5, 2.0]
    assert np.array_equal(draw_kernel_sigma(mx, 7), draw_kernel_sigma(mx, 7))
    draws = np.stack([draw_kernel_sigma(mx, s) for s in range(2000)])
    frac = draws / np.asarray(mx)
    assert np.allclose(frac, frac[:, :1])  # the axes soften together
    assert frac.min() >= 0 and frac.max() <= 1
    assert abs(frac.mean() - 0.5) < 0.03 and frac.min() < 0.01 and frac.max() > 0.99  # uniform on [0, 1]


def test_soften_is_a_gaussian_in_mm_on_an_anisotropic_grid():
    rng = np.random.default_rng(0)
    vol = rng.random((20, 18, 12)).astype(np.float32)
    got = soften(vol, [1.2, 1.2, 2.0], [0.8, 0.8, 2.5])
    want = ndimage.gaussian_filter(vol.astype(np.float64), sigma=[1.5, 1.5, 0.8], mode="nearest", truncate=3.0)
    assert got.dtype == np.float32 and got.shape == vol.shape
    assert np.allclose(got, want, atol=1e-5)
    same = soften(vol, [0, 0, 0], [1, 1, 1])
    assert np.array_equal(same, vol) and same is not vol


def test_a_point_spreads_with_the_variance_of_the_requested_width():
    vol = np.zeros((41, 41, 41), np.float32)
    vol[20, 20, 20] = 1.0
    out = soften(vol, [2.0, 2.0, 3.0], [1.0, 1.0, 1.5])  # mm -> voxels: 2, 2, 2
    x = np.arange(41) - 20
    for axis in range(3):
        prof = out.sum(axis=tuple(a for a in range(3) if a != axis))
        assert np.sum(prof * x**2) / prof.sum() == pytest.approx(4.0, rel=0.02)
