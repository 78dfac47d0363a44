"""lungcal.ct.transforms: HU window, lung mask, crop geometry, preprocess_ct on phantoms."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import Compose, Spacingd

from lungcal.ct.io import load_ct
from lungcal.ct.masking import LungMasker
from lungcal.ct.transforms import (
    DEFAULT_HU_WINDOW,
    HUWindowd,
    LungMaskd,
    SeparableSpacingd,
    build_preprocess,
    hu_window,
    lung_bbox,
    lung_mask,
    preprocess_ct,
)
from lungcal.data.synthetic import Nodule, ScannerProfile, fake_identifiers, make_phantom, write_dicom_series
from lungcal.errors import ConfigError, DataError

SHAPE, SPACING = (96, 96, 64), (3.2, 3.2, 3.6)


@pytest.fixture(scope="module")
def phantom():
    rng = np.random.default_rng(11)
    nod = Nodule((70.0, 10.0, 10.0), 14.0, True, "lobulated", "solid")
    hu, origin, mask = make_phantom(rng, SHAPE, SPACING, [nod], ScannerProfile(noise_hu=15))
    return hu, origin, mask


@pytest.fixture(scope="module")
def phantom_dicom(phantom, tmp_path_factory):
    hu, origin, _ = phantom
    folder = tmp_path_factory.mktemp("ph") / "ct"
    write_dicom_series(hu, origin, SPACING, folder, fake_identifiers(np.random.default_rng(0)))
    return folder


def test_hu_window_maps_and_clips():
    x = torch.tensor([-2000.0, -1200.0, -300.0, 600.0, 3000.0])
    np.testing.assert_allclose(hu_window(x).numpy(), [0, 0, 0.5, 1, 1], atol=1e-6)
    assert DEFAULT_HU_WINDOW == (-1200.0, 600.0)
    d = HUWindowd("image", window=(-1000, 0))({"image": torch.tensor([-500.0])})
    np.testing.assert_allclose(d["image"].numpy(), [0.5])
    with pytest.raises(ValueError):
        hu_window(x, (10, 0))


def test_lung_mask_recovers_the_phantom_lungs(phantom):
    hu, _, truth = phantom
    m = lung_mask(hu, SPACING)
    dice = 2 * (m & truth).sum() / (m.sum() + truth.sum())
    assert dice > 0.9, dice
    # the planted nodule (inside the lung) is part of the mask: holes are filled
    origin = -(np.array(SHAPE) - 1) / 2 * np.array(SPACING)
    c = np.round((np.array([70.0, 10.0, 10.0]) - origin) / SPACING).astype(int)
    assert m[tuple(c)]
    # the air outside the body (touching the in-plane border) is never lung
    assert not m[0].any() and not m[-1].any() and not m[:, 0].any() and not m[:, -1].any()
    # the trachea (midline, above the carina) is cut off at the bronchi and dropped
    c = SHAPE[0] // 2
    assert not m[c - 1: c + 2, :, -10:].any()
    assert (m & ~truth).sum() < 0.01 * truth.sum()
    assert lung_mask(hu, SPACING, airway_cut_mm=0)[c - 1: c + 2, :, -10:].any()  # joined without the cut


def test_no_lungs_raises(tmp_path):
    hu, origin, mask = make_phantom(np.random.default_rng(1), (64, 64, 40), (4.0, 4.0, 5.0), lungs=False)
    assert not mask.any()
    with pytest.raises(DataError, match="no lungs found"):
        lung_mask(hu, (4.0, 4.0, 5.0))
    write_dicom_series(hu, origin, (4.0, 4.0, 5.0), tmp_path / "abdomen", fake_identifiers(np.random.default_rng(2)))
    with pytest.raises(DataError, match="no lungs found") as err:
        preprocess_ct(tmp_path / "abdomen", spacing=4.0)
    assert "abdomen" in str(err.value)  # names the file


def test_lung_bbox_margin_and_clip():
    m = np.zeros((20, 20, 20), bool)
    m[5:8, 6:9, 0:3] = True
    start, end = lung_bbox(m, (1.0, 2.0, 1.0), margin_mm=2.0)
    assert start == [3, 5, 0] and end == [10, 10, 5]


def test_preprocess_ct_crop_keeps_world_geometry(phantom_dicom):
    raw = load_ct(phantom_dicom)
    out = preprocess_ct(phantom_dicom, spacing=None, margin_mm=8.0)
    img, msk = out["image"], out["lung_mask"]
    assert img.shape == msk.shape and img.shape[1:] != raw.shape[1:]
    assert float(img.min()) >= 0 and float(img.max()) <= 1
    assert set(np.unique(msk.numpy())) <= {0.0, 1.0} and msk.sum() > 0
    # the crop's affine maps its voxel (0,0,0) onto the same world point as the raw voxel it came from
    start = np.round(np.linalg.solve(raw.affine.numpy(), img.affine.numpy()[:, 3])[:3]).astype(int)
    np.testing.assert_allclose(raw.affine.numpy()[:3, :3], img.affine.numpy()[:3, :3])
    expected = hu_window(raw[0, start[0]:start[0] + img.shape[1], start[1]:start[1] + img.shape[2],
                             start[2]:start[2] + img.shape[3]])
    np.testing.assert_allclose(img[0].numpy(), expected.numpy(), atol=1e-6)


def test_preprocess_ct_resamples_to_spacing(phantom_dicom):
    out = preprocess_ct(phantom_dicom, spacing=(4.0, 4.0, 4.0), hu_window=(-1000, 400))
    np.testing.assert_allclose(np.asarray(out["image"].pixdim)[:3], [4.0, 4.0, 4.0], atol=1e-5)
    np.testing.assert_allclose(out["image"].affine.numpy(), out["lung_mask"].affine.numpy())
    assert out["image"].dtype == torch.float32 and out["lung_mask"].dtype == torch.float32
    # lung fraction of the lung box is substantial and the box is smaller than the body
    frac = float(out["lung_mask"].mean())
    assert 0.2 < frac < 0.8


def test_build_preprocess_is_a_monai_compose():
    assert isinstance(build_preprocess((1.5, 1.5, 1.5)), Compose)


class _BoxMasker:
    """A stand-in for a learned segmenter: a fixed box, counting its calls."""

    def __init__(self, box):
        self.box, self.calls = box, 0

    def __call__(self, hu, spacing):
        self.calls += 1
        m = np.zeros(hu.shape, bool)
        m[self.box] = True
        return m


def test_a_plugged_in_masker_replaces_the_built_in_one(phantom_dicom):
    box = np.s_[20:60, 30:70, 10:50]
    masker = _BoxMasker(box)
    out = preprocess_ct(phantom_dicom, spacing=None, margin_mm=0.0, masker=masker)
    assert masker.calls == 1
    raw = load_ct(phantom_dicom)
    assert out["lung_mask"].shape[1:] == (40, 40, 40)  # the crop is the masker's box
    np.testing.assert_allclose(np.linalg.solve(raw.affine.numpy(), out["image"].affine.numpy()[:, 3])[:3], [20, 30, 10],
                               atol=1e-4)
    with pytest.raises(ConfigError, match="together with a masker"):
        build_preprocess(masker=masker, closing_mm=3.0)
    with pytest.raises(ConfigError, match="callable"):
        LungMaskd(masker="lungmask")
    # a masker that finds nothing: the one clear error, naming the file
    with pytest.raises(DataError, match="no lungs found") as err:
        preprocess_ct(phantom_dicom, spacing=None, masker=_BoxMasker(np.s_[0:0]))
    assert str(phantom_dicom) in str(err.value)


def test_build_preprocess_with_qc_masks_once_and_keeps_the_report(phantom_dicom):
    masker = _BoxMasker(np.s_[10:80, 10:80, 5:60])
    out = build_preprocess(spacing=None, masker=masker, qc=True, qc_policy="record")({"image": str(phantom_dicom)})
    assert masker.calls == 1  # QCd computed the mask, LungMaskd reused it
    report = out["qc"]
    assert [c.name for c in report.checks][:2] == ["series_type", "geometry"]
    assert report["slice_thickness"].verdict == "fail"  # this phantom has 3.6 mm slices
    with pytest.raises(DataError, match="slice_thickness"):
        build_preprocess(spacing=None, masker=masker, qc={"max_slice_thickness_mm": 3.0})({"image": str(phantom_dicom)})
    ok = preprocess_ct(phantom_dicom, spacing=None, qc={"max_slice_thickness_mm": 4.0, "warn_slice_thickness_mm": 4.0,
                                                       "max_pixel_mm": 3.5})
    assert ok["qc"].ok, ok["qc"].format()


def test_lung_mask_settings_reach_the_built_in_masker(phantom):
    hu, _, _ = phantom
    a = lung_mask(hu, SPACING, lesion_closing_mm=0.0)
    b = LungMasker(lesion_closing_mm=0.0)(hu, SPACING)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ConfigError, match="bad lung mask setting"):
        lung_mask(hu, SPACING, no_such_setting=1)


# --- resampling in bounded memory -------------------------------------------------------------------------------
def _volume(affine: np.ndarray, shape=(40, 36, 12), seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    hu = torch.as_tensor(rng.normal(-500, 300, (1, *shape)).astype(np.float32))
    mask = torch.as_tensor((rng.random((1, *shape)) > 0.5).astype(np.float32))
    return {"image": MetaTensor(hu, affine=torch.as_tensor(affine)),
            "lung_mask": MetaTensor(mask, affine=torch.as_tensor(affine))}


SPACING_KW = {"mode": ("bilinear", "nearest"), "padding_mode": "border", "dtype": np.float32}


@pytest.mark.parametrize("rotated", [False, True])
def test_separable_spacing_gives_spacingd_geometry_and_values_in_bounded_chunks(rotated):
    """0.7 x 0.7 x 2.5 mm to 1 mm (a 2.5 mm scan at the full-resolution preset), far above max_voxels: the
    same affine and shape as MONAI's Spacingd, values within float rounding, the nearest mask equal."""
    affine = np.diag([0.7, 0.7, 2.5, 1.0])
    affine[:3, 3] = (-14.0, 3.0, -15.0)
    if rotated:  # an oblique scan: Spacingd keeps its directions, so the map is still per axis
        c, s = np.cos(0.3), np.sin(0.3)
        affine[:3, :3] = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]]) @ affine[:3, :3]
    data = _volume(affine)
    want = Spacingd(("image", "lung_mask"), pixdim=(1.0, 1.0, 1.0), **SPACING_KW)(dict(data))
    got = SeparableSpacingd(("image", "lung_mask"), pixdim=(1.0, 1.0, 1.0), max_voxels=500, **SPACING_KW)(dict(data))
    for key in ("image", "lung_mask"):
        assert got[key].shape == want[key].shape
        np.testing.assert_allclose(got[key].affine.numpy(), want[key].affine.numpy(), atol=1e-9)
    np.testing.assert_allclose(got["image"].numpy(), want["image"].numpy(), atol=0.05)  # HU
    if not rotated:
        assert torch.equal(got["lung_mask"].as_tensor(), want["lung_mask"].as_tensor())
    assert torch.equal(data["image"].as_tensor(), _volume(affine)["image"].as_tensor())  # the input is untouched


def test_separable_spacing_leaves_a_small_output_to_spacingd_bit_for_bit():
    """The default 2.5 mm preset's outputs stay under max_voxels: exactly MONAI's Spacingd, so its bags do not move."""
    affine = np.diag([0.7, 0.7, 2.5, 1.0])
    data = _volume(affine)
    want = Spacingd(("image", "lung_mask"), pixdim=(2.5, 2.5, 2.5), **SPACING_KW)(dict(data))
    got = SeparableSpacingd(("image", "lung_mask"), pixdim=(2.5, 2.5, 2.5), **SPACING_KW)(dict(data))
    for key in ("image", "lung_mask"):
        assert torch.equal(got[key].as_tensor(), want[key].as_tensor())
        assert torch.equal(got[key].affine, want[key].affine)


def test_separable_spacing_passes_an_unchanged_axis_through_and_never_aliases_its_input():
    """A 1 mm scan's slices on the 1 mm grid: that axis is a slice of the input (the interpolation would give
    its values exactly); with every axis unchanged the output is still a new volume (HUWindowd works in place)."""
    affine = np.diag([0.7, 0.7, 1.0, 1.0])
    data = _volume(affine)
    want = Spacingd(("image", "lung_mask"), pixdim=(1.0, 1.0, 1.0), **SPACING_KW)(dict(data))
    got = SeparableSpacingd(("image", "lung_mask"), pixdim=(1.0, 1.0, 1.0), max_voxels=500, **SPACING_KW)(dict(data))
    np.testing.assert_allclose(got["image"].numpy(), want["image"].numpy(), atol=0.05)
    assert torch.equal(got["lung_mask"].as_tensor(), want["lung_mask"].as_tensor())

    same = _volume(np.diag([1.0, 1.0, 1.0, 1.0]))
    out = SeparableSpacingd(("image", "lung_mask"), pixdim=(1.0, 1.0, 1.0), max_voxels=500, **SPACING_KW)(dict(same))
    for key in ("image", "lung_mask"):
        assert torch.equal(out[key].as_tensor(), same[key].as_tensor())
        out[key].as_tensor().fill_(7.0)
        assert not torch.equal(out[key].as_tensor(), same[key].as_tensor())
