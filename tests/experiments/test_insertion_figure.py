"""experiments/insertion_figure.py's measurements on a sphere of known blur and noise: the 10-90 % edge width of a
Gaussian-blurred edge is 2.56 sigma, the noise is the noise put in, the centre reads the sphere's HU."""
from __future__ import annotations

import numpy as np
from scipy import ndimage

from lungcal.data.synthetic.insertion import Background
from tests.experiments.conftest import load_script


def _sphere(sigma_mm: float = 1.0, noise_hu: float = 20.0, radius_mm: float = 8.0, spacing: float = 0.5):
    shape = (96, 96, 64)
    g = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1)
    centre_vox = (np.array(shape) - 1) / 2
    inside = np.linalg.norm((g - centre_vox) * spacing, axis=-1) <= radius_mm
    obj = np.where(inside, 40.0, -850.0)
    hu = ndimage.gaussian_filter(obj, sigma_mm / spacing) + np.random.default_rng(0).normal(0, noise_hu, shape)
    affine = np.diag([spacing, spacing, spacing, 1.0])
    bg = Background("sphere", hu.astype(np.float32), affine, np.ones(shape, bool), np.full(3, sigma_mm))
    return bg, centre_vox * spacing


def test_edge_width_noise_and_centre_on_a_known_sphere():
    fig = load_script("insertion_figure")
    bg, centre = _sphere(sigma_mm=1.0, noise_hu=20.0)
    x = fig.Shown("sphere", "sphere", bg, bg.hu, centre, 16.0, 40.0)
    n = fig.measure(x)
    assert 2.45 <= n["edge_mm"] <= 2.85, n["edge_mm"]  # 2.563 x 1 mm, plus the 0.5 mm voxels and the sampling
    assert n["edge_rays"] == fig.N_RAYS  # every ray leaves the sphere into "lung"
    assert abs(n["centre_hu"] - 40) < 5 and abs(n["lung_hu"] + 850) < 5
    assert 17 < n["noise_inside_hu"] < 23 and 17 < n["noise_beside_hu"] < 23 and n["beside_cubes"] >= 8
    sharp, _ = _sphere(sigma_mm=0.6)
    assert fig.measure(fig.Shown("sharp", "sphere", sharp, sharp.hu, centre, 16.0, 40.0))["edge_mm"] < \
        n["edge_mm"] - 0.6  # 1.54 mm against 2.56 mm
