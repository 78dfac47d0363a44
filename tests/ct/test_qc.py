"""lungcal.ct.qc: each synthetic unsuitable series trips its own check and no other; the report API,
the thresholds as config, the extrapolation against exact volumes, QCd inside a Compose."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from monai.data import MetaTensor

from lungcal.ct.io import load_ct
from lungcal.ct.qc import CHECKS, QCConfig, QCd, QCReport, beyond_edge, check_series
from lungcal.data.synthetic import ScannerProfile, fake_identifiers, make_phantom, write_dicom_series
from lungcal.errors import ConfigError, DataError

SHAPE, SPACING = (128, 128, 96), (2.5, 2.5, 2.5)  # the synthetic cohort's grid


@pytest.fixture(scope="module")
def phantom():
    hu, origin, truth = make_phantom(np.random.default_rng(0), SHAPE, SPACING, (), ScannerProfile(noise_hu=15))
    return hu, origin, truth


def _not_passed(report: QCReport) -> dict[str, str]:
    return {c.name: c.verdict for c in report.checks if c.verdict != "pass"}


def test_the_phantom_passes_every_check(phantom):
    hu, _, truth = phantom
    report = check_series(hu, spacing=SPACING)
    assert [c.name for c in report.checks] == list(CHECKS)
    assert _not_passed(report) == {}, report.format()
    assert report.lung_volume_ml == pytest.approx(truth.sum() * np.prod(SPACING) / 1000, rel=0.1)


def _apex_cut(hu, truth):
    return hu[:, :, : -SHAPE[2] // 6], SPACING  # the top 40 mm (the apices) are not in the scan


def _thick(hu, truth):
    return hu.reshape(SHAPE[0], SHAPE[1], SHAPE[2] // 2, 2).mean(axis=-1), (2.5, 2.5, 5.0)  # 5 mm slabs


def _fov_crop(truth, voxels=6):
    xs = np.flatnonzero(truth.any(axis=(1, 2)))
    return np.s_[xs[0] + voxels: xs[-1] + 1 - voxels]


def _small_fov(hu, truth):
    return hu[_fov_crop(truth)], SPACING  # 15 mm of each lung's outer wall outside the image


def _scout(hu, truth):
    return hu.mean(axis=1, keepdims=True), SPACING  # an AP projection: one "slice" thick


@pytest.mark.parametrize("make, expected", [
    (_apex_cut, {"lung_coverage": {"fail"}}),
    (_thick, {"slice_thickness": {"fail"}}),
    (_small_fov, {"field_of_view": {"warn", "fail"}}),
    (_scout, {"geometry": {"fail"}}),
], ids=["apex_cut", "5mm_slices", "small_fov", "scout_2d"])
def test_each_unsuitable_series_trips_its_own_check_and_no_other(phantom, make, expected):
    hu, _, truth = phantom
    arr, spacing = make(hu, truth)
    report = check_series(np.ascontiguousarray(arr), spacing=spacing)
    bad = {n: v for n, v in _not_passed(report).items() if v != "skip"}
    assert set(bad) == set(expected), report.format()
    for name, allowed in expected.items():
        assert bad[name] in allowed
    if make is _scout:  # nothing else can be measured on a projection
        assert {c.name for c in report.checks if c.verdict == "skip"} == set(CHECKS[2:])
    if make is _small_fov:  # the lungs cut by the field of view are still found
        assert report.lung_volume_ml > 0.8 * truth[_fov_crop(truth)].sum() * np.prod(SPACING) / 1000


def test_a_field_of_view_leaving_out_a_fifth_of_the_lungs_fails(phantom):
    hu, _, truth = phantom
    report = check_series(np.ascontiguousarray(hu[_fov_crop(truth, 16)]), spacing=SPACING)
    assert report["field_of_view"].verdict == "fail"
    assert "outside the image" in report["field_of_view"].reason


@pytest.mark.parametrize("info, verdict, words", [
    ({"format": "dicom", "modality": "CT", "image_type": ["ORIGINAL", "PRIMARY", "LOCALIZER"]}, "fail", "localizer"),
    ({"format": "dicom", "modality": "CT", "image_type": ["DERIVED", "SECONDARY", "AXIAL"]}, "warn", "derived"),
    ({"format": "dicom", "modality": "CT", "image_type": ["DERIVED", "PRIMARY", "AXIAL"]}, "warn", "derived"),
    ({"format": "dicom", "modality": "CT", "image_type": ["ORIGINAL", "SECONDARY", "AXIAL"]}, "pass", "re-exported"),
    ({"format": "dicom", "modality": "CT", "image_type": ["DERIVED", "SECONDARY", "AXIAL", "MIP"]}, "fail",
     "maximum-intensity projection"),
    ({"format": "dicom", "modality": "PT", "image_type": ["ORIGINAL", "PRIMARY"]}, "fail", "modality is PT"),
    ({"format": "dicom", "modality": "CT", "image_type": ["ORIGINAL", "PRIMARY", "AXIAL"]}, "pass", "original"),
])
def test_series_type_reads_the_dicom_tags(phantom, info, verdict, words):
    hu, _, _ = phantom
    report = check_series(hu, spacing=SPACING, info={**info, "slice_thickness_mm": 2.5})
    assert report["series_type"].verdict == verdict and words in report["series_type"].reason
    assert set(_not_passed(report)) <= {"series_type"}


def test_derived_images_can_be_refused_and_reformats_are_not_axial(phantom):
    hu, _, _ = phantom
    info = {"format": "dicom", "modality": "CT", "image_type": ["DERIVED", "SECONDARY"]}
    assert check_series(hu, spacing=SPACING, info=info, derived="fail")["series_type"].verdict == "fail"
    # derived judges ImageType value 1 only: a re-export of the original slices passes even with derived="fail"
    reexport = {**info, "image_type": ["ORIGINAL", "SECONDARY", "AXIAL"]}
    assert check_series(hu, spacing=SPACING, info=reexport, derived="fail")["series_type"].verdict == "pass"
    coronal = check_series(hu, spacing=(0.7, 2.5, 0.7))["series_type"]  # thick along y: coronal slices
    assert coronal.verdict == "fail" and "coronal" in coronal.value
    sagittal = check_series(hu, spacing=(2.0, 0.7, 0.7))["series_type"]  # square pixels in y-z: sagittal
    assert sagittal.verdict == "fail" and "sagittal" in sagittal.value


@pytest.mark.parametrize("spacing", [(0.78, 0.78, 0.625), (0.7, 0.7, 0.5), (2.5, 2.5, 2.0), (0.7, 0.75, 2.5)])
def test_thin_slices_under_larger_pixels_are_still_axial(phantom, spacing):
    """A screening protocol's 0.625 mm slices under 0.78 mm pixels (a 400 mm field of view) are thinner than the
    pixels: the square in-plane pixels, not the thickest axis, say which plane the slices are in."""
    hu, _, _ = phantom
    assert check_series(hu, spacing=spacing)["series_type"].verdict == "pass"


@pytest.mark.parametrize("extra, verdict", [({"n_gaps": 1}, "fail"), ({"resampled": True}, "warn"),
                                            ({"n_duplicates": 2}, "warn"), ({}, "pass")])
def test_slice_positions_from_the_reader(phantom, extra, verdict):
    hu, _, _ = phantom
    info = {"format": "dicom", "modality": "CT", "image_type": ["ORIGINAL", "PRIMARY", "AXIAL"],
            "step_min_mm": 2.5, "step_median_mm": 2.5, "step_max_mm": 5.0 if extra.get("n_gaps") else 2.5, **extra}
    assert check_series(hu, spacing=SPACING, info=info)["slice_positions"].verdict == verdict


def test_hu_air_catches_an_unapplied_rescale(phantom):
    hu, _, _ = phantom
    raw = check_series(hu.astype(np.float32) + 1024, spacing=SPACING)  # stored values, intercept not applied
    assert raw["hu_air"].verdict == "fail" and "rescale" in raw["hu_air"].reason
    shifted = check_series(hu.astype(np.float32) + 150, spacing=SPACING)  # a badly calibrated scanner
    assert shifted["hu_air"].verdict == "warn"


def test_no_lungs_fails_the_volume_and_skips_the_extent_checks():
    hu, _, _ = make_phantom(np.random.default_rng(1), SHAPE, SPACING, lungs=False)
    report = check_series(hu, spacing=SPACING)
    assert report["lung_volume"].verdict == "fail" and "no lungs" in report["lung_volume"].reason
    assert report["lung_coverage"].verdict == report["field_of_view"].verdict == "skip"


def test_report_refusal_rows_and_text(phantom, tmp_path):
    hu, _, truth = phantom
    arr, spacing = _thick(hu, truth)
    report = check_series(arr, spacing=spacing, name=str(tmp_path / "patient_123" / "ct.nii.gz"))
    assert [c.name for c in report.failed] == ["slice_thickness"] and report.verdict == "fail" and not report.ok
    with pytest.raises(DataError) as err:
        report.raise_if_failed("S0a1b2c3")
    text = str(err.value)
    assert "S0a1b2c3" in text and "slice_thickness" in text and "5.00 mm" in text and "Fix:" in text
    assert err.value.field == "qc.slice_thickness" and "\n" not in text
    rows = report.as_rows("S0a1b2c3")
    assert [r["check"] for r in rows] == list(CHECKS)
    assert all(set(r) == {"pseudonym", "check", "verdict", "value"} for r in rows)
    assert "patient_123" not in repr(rows)  # no paths in the qc.csv rows
    assert len(report.format().splitlines()) == len(CHECKS) + 2  # a title, the checks, the acquisition
    assert report.format().splitlines()[-1].split()[0] == "acquisition"
    check_series(hu, spacing=SPACING).raise_if_failed("x")  # a passing series raises nothing


def test_thresholds_are_plain_kwargs(phantom):
    hu, _, truth = phantom
    arr, spacing = _thick(hu, truth)
    cfg = QCConfig(max_slice_thickness_mm=6.0, warn_slice_thickness_mm=4.0)
    assert check_series(arr, spacing=spacing, config=cfg)["slice_thickness"].verdict == "warn"
    loose = {"max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0}
    assert check_series(arr, spacing=spacing, config=loose)["slice_thickness"].verdict == "pass"
    with pytest.raises(ConfigError, match="unknown qc setting"):
        QCConfig.from_any({"max_thickness": 3})
    with pytest.raises(ConfigError, match="must not exceed"):
        QCConfig(warn_slice_thickness_mm=4.0, max_slice_thickness_mm=3.0)


def test_beyond_edge_is_exact_for_a_linear_taper():
    # a lung whose cross-section shrinks linearly to zero (a paraboloid apex): A(z) = c (h - z)
    c, h, step = 40.0, 60.0, 2.5
    z = np.arange(0, 41, step)  # the scan stops at z = 40, 20 mm below the tip
    area = c * (h - z)
    exact = c * (h - z[-1]) ** 2 / 2
    assert beyond_edge(area, step) == pytest.approx(exact, rel=1e-9)
    assert beyond_edge(np.r_[area, 0.0], step) == 0.0  # the lung ends inside the scan
    flat = np.full(10, 500.0)  # a lung that does not taper: cut in the middle
    assert beyond_edge(flat, step, max_mm=100.0) == pytest.approx(500.0 * 100.0)


def test_check_series_reads_a_dicom_folder(phantom, tmp_path):
    hu, origin, truth = phantom
    arr, spacing = _thick(hu, truth)
    write_dicom_series(np.rint(arr).astype(np.int16), origin, spacing, tmp_path / "ct",
                       fake_identifiers(np.random.default_rng(0)))
    report = check_series(tmp_path / "ct")
    assert report["series_type"].value.startswith("CT ORIGINAL/PRIMARY/AXIAL")
    assert report["slice_thickness"].value.startswith("5.00 mm (tag 5.00")
    assert report.name == str(tmp_path / "ct") and set(_not_passed(report)) == {"slice_thickness"}


def test_qcd_raises_or_records_and_logs_no_paths(phantom, tmp_path, caplog):
    hu, origin, truth = phantom
    arr, spacing = _thick(hu, truth)
    write_dicom_series(np.rint(arr).astype(np.int16), origin, spacing, tmp_path / "p1",
                       fake_identifiers(np.random.default_rng(0)))
    img = load_ct(tmp_path / "p1")
    with pytest.raises(DataError, match="slice_thickness") as err:
        QCd("image")({"image": img})
    assert str(tmp_path / "p1") in str(err.value)  # the refusal names the file for the user
    with caplog.at_level(logging.WARNING, logger="lungcal.ct.qc"):
        d = QCd("image", policy="record")({"image": img, "subject": "S1234"})
    assert d["qc"].failed[0].name == "slice_thickness"
    assert isinstance(d["lung_mask"], MetaTensor) and d["lung_mask"].dtype == torch.uint8
    assert d["lung_mask"].shape == img.shape
    assert "S1234" in caplog.text and str(tmp_path) not in caplog.text
    with pytest.raises(ConfigError, match="policy"):
        QCd("image", policy="skip")
