"""lungcal.ct.acquisition: slice, pixel, air, noise and edge width of a CT, against phantoms of known scanner
settings and on the real scans of ../shared/data/ct.

Tolerances (phantoms at the demo's 320 mm field of view, 1.25 mm pixels): the noise within 12% of the
scanner's ``noise_hu``; the edge width within 0.15 mm of the blur the phantom applied (the sampled
Gaussian's own sigma: a 0.5 mm kernel on 1.25 mm pixels blurs by 0.36 mm); the air within 3 HU of
-1000 + ``hu_offset``. Measured: noise 2-10% high, edge 0.00-0.11 mm off.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from lungcal.candidates import cache as bag_cache
from lungcal.ct.acquisition import ACQUISITION_FIELDS, AcquisitionStats, acquisition_stats, sample_slices
from lungcal.ct.io import load_ct
from lungcal.data.synthetic import ScannerProfile, make_phantom

PX = 1.25
SHAPE, SPACING = (256, 256, 4), (PX, PX, 2.5)  # the demo's 320 mm field of view


def applied_blur_mm(sigma_mm: float, px: float = PX, truncate: float = 3.0) -> float:
    """The sigma (mm) of the sampled Gaussian ``scipy.ndimage.gaussian_filter`` applies for ``sigma_mm``."""
    s = sigma_mm / px
    k = np.arange(-int(truncate * s + 0.5), int(truncate * s + 0.5) + 1)
    w = np.exp(-0.5 * k ** 2 / s ** 2)
    return float(np.sqrt((w * k * k).sum() / w.sum()) * px)


def _stats(noise_hu, kernel_mm, hu_offset=0.0, seed=3):
    hu, _, _ = make_phantom(np.random.default_rng(seed), SHAPE, SPACING,
                            scanner=ScannerProfile(noise_hu=noise_hu, kernel_sigma_mm=kernel_mm, hu_offset=hu_offset))
    return acquisition_stats(hu, SPACING)


@pytest.fixture(scope="module")
def measured():
    """(noise_hu, kernel_mm) -> stats: noise and kernel ranked both ways, and two off the diagonal."""
    return {k: _stats(*k) for k in ((10.0, 2.0), (20.0, 1.0), (40.0, 0.5), (10.0, 0.5), (40.0, 2.0))}


def test_noise_and_edge_width_are_close_to_the_scanners_and_rank_it(measured):
    for (noise, kernel), st in measured.items():
        assert st.noise_hu == pytest.approx(noise, rel=0.12), (noise, kernel, st)
        assert abs(st.edge_sigma_mm - applied_blur_mm(kernel)) <= 0.15, (noise, kernel, st)
        assert st.air_hu == pytest.approx(-1000, abs=3)
        assert st.n_tissue > 1000 and st.n_edge > 100 and st.n_air > 1000 and st.slices == 4
    diagonal = [measured[k] for k in ((10.0, 2.0), (20.0, 1.0), (40.0, 0.5))]
    assert [s.noise_hu for s in diagonal] == sorted(s.noise_hu for s in diagonal)  # noisier ...
    assert [s.edge_sigma_mm for s in diagonal] == sorted((s.edge_sigma_mm for s in diagonal), reverse=True)  # sharper
    # each number follows its own setting: the noise does not move the edge width, nor the kernel the noise
    assert abs(measured[10.0, 0.5].edge_sigma_mm - measured[40.0, 0.5].edge_sigma_mm) < 0.1
    assert abs(measured[10.0, 2.0].noise_hu - measured[10.0, 0.5].noise_hu) < 1.5


def test_air_follows_a_calibration_offset_and_geometry_comes_from_spacing_and_tag():
    st = _stats(20.0, 1.0, hu_offset=30.0)
    assert st.air_hu == pytest.approx(-970, abs=3)
    assert (st.slice_thickness_mm, st.slice_spacing_mm, st.pixel_mm) == (2.5, 2.5, PX)
    hu, _, _ = make_phantom(np.random.default_rng(3), SHAPE, SPACING)
    tagged = acquisition_stats(hu, SPACING, info={"slice_thickness_mm": 3.0})  # the DICOM tag wins
    assert (tagged.slice_thickness_mm, tagged.slice_spacing_mm) == (3.0, 2.5)
    assert tuple(st.values()) == ACQUISITION_FIELDS


def test_what_cannot_be_measured_is_nan_and_survives_json():
    tissue = np.full((64, 64, 6), 40.0, np.float32)  # no air, no edge
    st = acquisition_stats(tissue, (2.0, 2.0, 2.0))
    assert math.isnan(st.air_hu) and math.isnan(st.edge_sigma_mm) and st.noise_hu == pytest.approx(0, abs=0.5)
    d = st.as_dict()
    assert d["air_hu"] is None and d["edge_sigma_mm"] is None
    back = AcquisitionStats.from_dict(d)
    assert math.isnan(back.air_hu) and back.noise_hu == st.noise_hu and back.slices == st.slices
    with pytest.raises(ValueError, match="spacing"):
        acquisition_stats(tissue)


def test_sample_slices_is_evenly_spaced_and_slices_first():
    arr = np.arange(4 * 5 * 30, dtype=np.int16).reshape(4, 5, 30)
    sub = sample_slices(arr, 4)
    assert sub.shape == (4, 4, 5) and sub.dtype == np.float32
    np.testing.assert_array_equal(sub[-1], arr[:, :, 29])
    np.testing.assert_array_equal(sub[0], arr[:, :, 0])
    assert sample_slices(arr[:, :, :3], 8).shape == (3, 4, 5)


# --- real scans (../shared/data/ct, PROVENANCE.md) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def ct_dir(shared_dir):
    d = shared_dir / "data" / "ct"
    if not (d / "LIDC-IDRI-0001" / "ct.nii.gz").is_file() or not (d / "LungPETCTDx-A0002_8mm" / "dicom").is_dir():
        pytest.skip(f"the real CT scans are not in {d}")
    return d


def test_real_scans_read_plausible_acquisitions(ct_dir):
    lidc = acquisition_stats(load_ct(ct_dir / "LIDC-IDRI-0001" / "ct.nii.gz"))  # padding -2048/-3024 left out
    thick = acquisition_stats(load_ct(ct_dir / "LungPETCTDx-A0002_8mm" / "dicom"))
    print(f"\nLIDC-IDRI-0001: {lidc}\nLungPETCTDx-A0002_8mm: {thick}")
    assert lidc.slice_thickness_mm == 2.5 and lidc.pixel_mm == pytest.approx(0.703, abs=1e-3)
    assert thick.slice_thickness_mm == 8.0 and thick.pixel_mm == pytest.approx(0.646, abs=1e-3)
    for st in (lidc, thick):
        assert -1020 <= st.air_hu <= -980
        assert 5 <= st.noise_hu <= 60 and 0.2 <= st.edge_sigma_mm <= 2.5
        assert st.n_air > 10_000 and st.n_tissue > 10_000 and st.n_edge > 1000
    assert thick.noise_hu < lidc.noise_hu  # 8 mm slices average the noise of ~3 slices of 2.5 mm


def test_measuring_acquisitions_leaves_the_bag_cache_key_alone():
    # the series checks measure, the bags do not change: the module stays out of the bags' code fingerprint
    assert "acquisition.py" in bag_cache._NOT_SHAPING
