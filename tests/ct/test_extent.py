"""A volume too small for the lung mask or the detector is refused in one line, naming the file, its size
and the minimum (issue 34 item 5): one slice (at 1 mm it used to crash inside ``LungMaskd``), a few
slices, a small matrix; the smallest accepted volume still preprocesses, and the masker and the
detector no longer crash on a one-voxel axis."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.candidates.cache import build_bags
from lungcal.candidates.detector import LoGBlobDetector
from lungcal.cli import main
from lungcal.ct.extent import MIN_EXTENT_MM, MIN_VOXELS, extent_problem, require_extent
from lungcal.ct.masking import LungMasker
from lungcal.ct.transforms import lung_mask, preprocess_ct
from lungcal.data.synthetic import ScannerProfile, make_phantom, write_nifti
from lungcal.errors import DataError

#: the smallest phantom grid the tests accept: 240 x 240 x 120 mm at 5 mm
SMALL, SMALL_SPACING = (48, 48, 24), (5.0, 5.0, 5.0)


def _chest(shape, spacing, seed=0) -> np.ndarray:
    hu, _, _ = make_phantom(np.random.default_rng(seed), shape, spacing, (), ScannerProfile(noise_hu=10))
    return hu


@pytest.fixture(scope="module")
def volumes(tmp_path_factory):
    """NIfTI volumes cut from a chest phantom: too thin, too narrow, and the smallest accepted one."""
    root = tmp_path_factory.mktemp("extent")
    big = _chest((128, 128, 96), (2.5, 2.5, 2.5), seed=3)
    mid = big[:, :, 40:]  # the slices below are cut from the middle of the lungs
    out = {}
    for name, vol, sp in [("one_slice_1mm", mid[:, :, :1], (2.5, 2.5, 1.0)),
                          ("one_slice", mid[:, :, :1], (2.5, 2.5, 2.5)),
                          ("three_slices", mid[:, :, :3], (2.5, 2.5, 2.5)),
                          ("one_slice_10mm", mid[:, :, :1], (2.5, 2.5, 10.0)),
                          ("matrix_8x8", big[60:68, 60:68, :], (2.5, 2.5, 2.5))]:
        out[name] = root / f"{name}.nii.gz"
        write_nifti(np.ascontiguousarray(vol), (0.0, 0.0, 0.0), sp, out[name])
    out["small"] = root / "small.nii.gz"
    write_nifti(_chest(SMALL, SMALL_SPACING), (0.0, 0.0, 0.0), SMALL_SPACING, out["small"])
    return out


def test_the_limits_and_their_reasons():
    assert MIN_VOXELS == 3
    # the largest lesion the built-in detector probes must fit in every axis
    assert MIN_EXTENT_MM >= 2 * max(LoGBlobDetector().radii_mm)
    assert extent_problem((512, 512, 133), (0.7, 0.7, 2.5)) is None
    assert extent_problem((20, 20, 3), (2.5, 2.5, 17.0)) is None  # 50 mm and 3 voxels on every axis
    why = extent_problem((512, 512, 1), (0.7, 0.7, 2.5))
    assert why is not None and "512x512x1 voxels of 0.70x0.70x2.50 mm" in why
    assert "z (slices): 1 voxel, 2.5 mm" in why and "at least 3 voxels and 50 mm" in why
    assert "x (left-right)" in extent_problem((2, 400, 100), (30.0, 0.7, 2.5))  # 60 mm but 2 voxels
    with pytest.raises(DataError, match=r"^/some/ct.nii.gz: the volume is too small .*Fix: export the whole"):
        require_extent((8, 8, 40), (2.5, 2.5, 2.5), file="/some/ct.nii.gz")


@pytest.mark.parametrize("name, axis", [("one_slice_1mm", "z (slices): 1 voxel, 1.0 mm"),
                                        ("one_slice", "z (slices): 1 voxel, 2.5 mm"),
                                        ("three_slices", "z (slices): 3 voxels, 7.5 mm"),
                                        ("one_slice_10mm", "z (slices): 1 voxel, 10.0 mm"),
                                        ("matrix_8x8", "x (left-right): 8 voxels, 20.0 mm")])
def test_too_small_volumes_are_refused_naming_the_file_the_size_and_the_minimum(volumes, name, axis):
    with pytest.raises(DataError) as err:
        preprocess_ct(volumes[name], spacing=(2.5, 2.5, 2.5))
    text = str(err.value)
    assert text.startswith(str(volumes[name])) and "\n" not in text
    assert axis in text and "every axis needs at least 3 voxels and 50 mm" in text
    # the same refusal with the series checks in the chain (they run after the loader)
    with pytest.raises(DataError, match="too small for the lung mask"):
        preprocess_ct(volumes[name], spacing=(2.5, 2.5, 2.5), qc=True, qc_policy="record")


def test_the_smallest_accepted_volume_still_preprocesses(volumes):
    out = preprocess_ct(volumes["small"], spacing=SMALL_SPACING)
    assert out["image"].shape[0] == 1 and min(out["image"].shape[1:]) >= MIN_VOXELS
    assert float(out["lung_mask"].sum()) * np.prod(SMALL_SPACING) / 1000 > 150  # mL of lung


def test_masker_and_detector_do_not_crash_on_one_voxel_axes():
    """A single thin slice once emptied the masker's ~3 mm grid (numpy: can't extend empty axis)."""
    hu = _chest((128, 128, 96), (2.5, 2.5, 2.5))[:, :, 48:49]
    assert LungMasker()(hu, (2.5, 2.5, 1.0)).shape == hu.shape
    for shape in [(1, 1, 1), (8, 8, 1), (40, 40, 1)]:
        vol = np.full(shape, 0.1, np.float32)
        cands = LoGBlobDetector().detect(vol[None], np.ones((1, *shape), bool), (1.0, 1.0, 1.0), np.eye(4))
        assert len(cands) >= 0
    with pytest.raises(DataError, match="too small"):
        lung_mask(hu, (2.5, 2.5, 1.0), file="thin.nii.gz")


def test_the_bag_builder_names_the_row_and_says_why(volumes, tmp_path):
    rows = [{"image": str(volumes["small"]), "subject": "S0"}, {"image": str(volumes["one_slice"]), "subject": "S1"}]
    with pytest.raises(DataError) as err:
        build_bags(rows, {"spacing": [5.0, 5.0, 5.0], "patch_size": 8}, tmp_path, num_workers=0, progress=False)
    text = str(err.value)
    assert "row 1, field 'image'" in text and "subject S1" in text and "too small for the lung mask" in text
    assert str(volumes["one_slice"]) not in text  # the bag builder masks paths (they may hold identifiers)


def test_qc_command_refuses_a_single_slice_in_one_line_per_check(volumes, capsys):
    assert main(["qc", str(volumes["one_slice"])]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    geometry = [line for line in captured.out.splitlines() if line.strip().startswith("geometry ")]
    assert "fail" in geometry[0] and "1 voxel(s) along one axis" in geometry[0]
    assert "geometry         failed 1" in captured.out and "1 CT(s): 0 pass, 0 warn, 1 fail" in captured.out
