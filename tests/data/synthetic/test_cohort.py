"""lungcal.data.synthetic.cohort: outputs, planted identifiers, determinism, presets, Bayes AUC."""
from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pydicom
import pytest
from sklearn.metrics import roc_auc_score

from lungcal.ct.io import load_ct
from lungcal.data.manifest import load_manifest
from lungcal.data.splits import apply_splits
from lungcal.data.synthetic import (
    COHORT_PRESETS,
    DEMO_DEFAULTS,
    STUDY_DEFAULTS,
    ScannerProfile,
    cohort_bayes_auc,
    cohort_datalist_path,
    ensure_cohort,
    ensure_demo_cohort,
    ensure_study_cohort,
    make_cohort,
)
from lungcal.errors import ConfigError

SMALL = dict(shape=(64, 64, 40), spacing=(5.0, 5.0, 6.0))
TINY = dict(shape=(48, 48, 32), spacing=(6.0, 6.0, 8.0), num_workers=1)


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    out = tmp_path_factory.mktemp("cohort")
    path = make_cohort(out, n_subjects=10, prevalence=0.5, seed=3, num_workers=1, progress=False,
                       scanner=ScannerProfile(site="siteA", noise_hu=30), **SMALL)
    return out, path


def test_outputs_and_rows(cohort):
    out, path = cohort
    rows = load_manifest(path)
    assert len(rows) == 10
    assert {r["site"] for r in rows} == {"siteA"}
    assert {r["split"] for r in rows} <= {"train", "val", "test"}
    for r in rows:
        assert r["subject"].startswith("S") and r["ct"].startswith(r["subject"])
    img = load_ct(rows[0]["image"])  # the datalist points at DICOM series folders
    assert img.shape == (1, 64, 64, 40)
    np.testing.assert_allclose(np.asarray(img.pixdim)[:3], SMALL["spacing"])
    nii = load_ct(out / "nifti" / f"{rows[0]['ct']}.nii.gz")
    np.testing.assert_array_equal(nii.numpy(), img.numpy())
    np.testing.assert_allclose(nii.affine.numpy(), img.affine.numpy(), atol=1e-4)
    # CT label = has a malignant nodule, consistent between datalist and annotations
    with open(out / "annotations.csv") as fh:
        ann = list(csv.DictReader(fh))
    assert {"seriesuid", "coordX", "coordY", "coordZ", "diameter_mm", "malignant", "ct", "subject"} <= set(ann[0])
    malignant_cts = {a["ct"] for a in ann if a["malignant"] == "1"}
    assert malignant_cts == {r["ct"] for r in rows if r["label"] == 1}
    assert all(4.0 <= float(a["diameter_mm"]) <= 30.0 for a in ann)


def test_nodule_is_in_the_image_at_its_world_position(cohort):
    out, path = cohort
    rows = {r["ct"]: r for r in load_manifest(path)}
    with open(out / "annotations.csv") as fh:
        ann = max(csv.DictReader(fh), key=lambda a: float(a["diameter_mm"]))
    img = load_ct(rows[ann["ct"]]["image"])
    ras = np.array([float(ann["rasX"]), float(ann["rasY"]), float(ann["rasZ"])])
    lps = np.array([float(ann["coordX"]), float(ann["coordY"]), float(ann["coordZ"])])
    np.testing.assert_allclose(ras[:2], -lps[:2])
    vox = np.round(np.linalg.solve(img.affine.numpy(), np.append(ras, 1))[:3]).astype(int)
    assert float(img[0][tuple(vox)]) > -300  # soft tissue / ground glass / calcium, not lung (-860)


def test_dicom_geometry_and_planted_identifiers(cohort):
    out, path = cohort
    planted = json.loads((out / "planted_identifiers.json").read_text())["cts"]
    assert len(planted) == 10
    rows = load_manifest(path)
    files = sorted(Path(rows[0]["image"]).iterdir())
    ds = pydicom.dcmread(files[1])
    assert ds.Modality == "CT" and float(ds.RescaleIntercept) == -1024 and float(ds.SliceThickness) == 6.0
    assert [float(v) for v in ds.PixelSpacing] == [5.0, 5.0]
    ids = next(p for p in planted if p["SeriesInstanceUID"] == ds.SeriesInstanceUID)
    assert str(ds.PatientName) == ids["PatientName"] and ds.PatientID == ids["PatientID"]
    assert ds.AccessionNumber == ids["AccessionNumber"] and ds.PatientBirthDate == ids["PatientBirthDate"]
    # no identifier reaches the datalist or any file/folder name
    text = (out / "datalist.json").read_text()
    names = " ".join(str(p.relative_to(out)) for p in out.rglob("*"))
    for p in planted:
        for key in ("PatientName", "PatientID", "AccessionNumber", "StudyInstanceUID", "SeriesInstanceUID"):
            assert p[key] not in text and p[key] not in names
    assert "planted_identifiers" not in text


def test_deterministic_by_seed(cohort, tmp_path):
    out, path = cohort
    again = make_cohort(tmp_path, n_subjects=10, prevalence=0.5, seed=3, num_workers=2, progress=False,
                        scanner=ScannerProfile(site="siteA", noise_hu=30), formats=("dicom",), **SMALL)
    a, b = json.loads(path.read_text()), json.loads(again.read_text())
    assert a["rows"] == b["rows"]
    assert (out / "annotations.csv").read_text() == (tmp_path / "annotations.csv").read_text()
    assert (out / "truth.csv").read_text() == (tmp_path / "truth.csv").read_text()
    r = a["rows"][4]
    np.testing.assert_array_equal(load_ct(out / r["image"]).numpy(), load_ct(tmp_path / r["image"]).numpy())
    other = make_cohort(tmp_path / "s4", n_subjects=3, prevalence=0.5, seed=4, num_workers=1, progress=False,
                        formats=("nifti",), **SMALL)
    assert json.loads(other.read_text())["rows"][0]["subject"] not in {x["subject"] for x in a["rows"]}


def test_bayes_auc_per_split_matches_sklearn(cohort):
    out, path = cohort
    with open(out / "truth.csv") as fh:
        truth = {t["ct"]: t for t in csv.DictReader(fh)}
    rows = load_manifest(path)
    auc = cohort_bayes_auc(path)
    assert auc == cohort_bayes_auc(out)
    for name in ("all", "train", "val", "test"):
        sel = [r for r in rows if name in ("all", r["split"])]
        labels = [int(truth[r["ct"]]["label"]) for r in sel]
        if len(set(labels)) < 2:
            assert auc[name] is None
            continue
        expected = roc_auc_score(labels, [float(truth[r["ct"]]["bayes_p"]) for r in sel])
        assert auc[name] == pytest.approx(expected, abs=1e-12)
        assert json.loads((out / "cohort.json").read_text())["bayes_auc"][name] == pytest.approx(expected, abs=1e-4)


def test_ensure_demo_cohort_generates_once(tmp_path):
    p = ensure_demo_cohort(tmp_path, progress=False, n_subjects=3, **TINY)
    # the folder name of an overridden demo: its overrides, then the demo's nodule model
    assert p.parent.name == ("synthetic_n_subjects-3_num_workers-1_shape-48x48x32_spacing-6.0x6.0x8.0"
                             "_types-screening_masses-0.15")
    mtime = p.stat().st_mtime_ns
    assert ensure_demo_cohort(tmp_path, progress=False, n_subjects=3, **TINY) == p
    assert ensure_cohort("demo", tmp_path, progress=False, n_subjects=3, **TINY) == p
    assert p.stat().st_mtime_ns == mtime
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]  # no temp folder left
    assert len(load_manifest(p)) == 3


def test_presets():
    assert COHORT_PRESETS["demo"] is DEMO_DEFAULTS and COHORT_PRESETS["study"] is STUDY_DEFAULTS
    assert DEMO_DEFAULTS == {"n_subjects": 1000, "prevalence": 0.4, "seed": 0, "shape": (128, 128, 96),
                             "spacing": (2.5, 2.5, 2.5), "formats": ("nii", "dicom"),
                             "dicom_splits": ("test",), "nodule_types": "screening",
                             "masses": 0.15}  # the demo never changes silently


def test_folder_names_follow_the_nodule_model(tmp_path):
    """A cohort of the classic nodule model keeps the name it had before the demo drew every type (so a
    folder made then is that cohort); the demo of every type lives elsewhere and never reuses it."""
    assert cohort_datalist_path("demo", tmp_path).parent.name == "synthetic_demo_1000_types-screening_masses-0.15"
    classic = cohort_datalist_path("demo", tmp_path, nodule_types="classic", masses=0.0)
    assert classic.parent.name == "synthetic_demo_1000"
    mix = cohort_datalist_path("demo", tmp_path, scanner_mix="four_vendors")
    assert mix.parent.name == "synthetic_scanner_mix-four_vendors_types-screening_masses-0.15"
    assert cohort_datalist_path("demo", tmp_path, scanner_mix="four_vendors", nodule_types="classic",
                                masses=0.0).parent.name == "synthetic_scanner_mix-four_vendors"
    assert cohort_datalist_path("demo", tmp_path, masses=0.3).parent.name == \
        "synthetic_demo_1000_types-screening_masses-0.3"
    assert cohort_datalist_path("study", tmp_path).parent.name == "synthetic_study_3500"
    assert STUDY_DEFAULTS["prevalence"] == 0.11 and STUDY_DEFAULTS["seed"] != DEMO_DEFAULTS["seed"]
    # the study's split fractions give about 1000 / 1000 / 1500 CTs at its prevalence
    rng = np.random.default_rng(0)
    rows = [{"image": "x", "subject": f"s{i}", "label": int(rng.random() < 0.11), "split": ""}
            for i in range(STUDY_DEFAULTS["n_subjects"])]
    counts = Counter(r["split"] for r in apply_splits(rows, STUDY_DEFAULTS["splits"], seed=STUDY_DEFAULTS["seed"]))
    assert abs(counts["train"] - 1000) <= 2 and abs(counts["val"] - 1000) <= 2 and abs(counts["test"] - 1500) <= 2


def test_ensure_study_cohort(tmp_path):
    p = ensure_study_cohort(tmp_path, progress=False, n_subjects=7, **TINY)
    assert p.parent.name.startswith("synthetic_study_n_subjects-7")
    params = json.loads((p.parent / "cohort.json").read_text())
    assert params["prevalence"] == 0.11 and params["seed"] == STUDY_DEFAULTS["seed"]
    np.testing.assert_allclose(params["splits"], [1000 / 3500, 1000 / 3500, 1500 / 3500])
    assert ensure_cohort("study", tmp_path, progress=False, n_subjects=7, **TINY) == p


def test_dicom_splits_write_those_cts_as_dicom_and_the_rest_as_plain_nifti_of_the_same_volumes(tmp_path):
    small = dict(n_subjects=10, prevalence=0.5, seed=2, shape=(48, 48, 32), spacing=(6.0, 6.0, 8.0), num_workers=2,
                 progress=False)
    mixed = make_cohort(tmp_path / "mixed", formats=("nii", "dicom"), dicom_splits=("test",), **small)
    plain = make_cohort(tmp_path / "plain", formats=("nii",), **small)
    rows, ref = load_manifest(mixed), {r["subject"]: r for r in load_manifest(plain)}
    assert {r["split"] for r in rows} == {"train", "val", "test"}
    for r in rows:
        image = mixed.parent / r["image"]
        if r["split"] == "test":
            assert image.is_dir() and len(list(image.glob("*.dcm"))) == 32, r  # a DICOM series, no NIfTI left
            assert not (mixed.parent / "nifti" / f"{r['ct']}.nii").exists()
        else:
            assert r["image"].endswith(".nii") and image.is_file()
        a, b = load_ct(image), load_ct(plain.parent / ref[r["subject"]]["image"])
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # the same CT, whatever the format
        np.testing.assert_allclose(a.affine.numpy(), b.affine.numpy(), atol=1e-4)
        assert r["split"] == ref[r["subject"]]["split"] and r["label"] == ref[r["subject"]]["label"]
    assert json.loads((mixed.parent / "cohort.json").read_text())["dicom_splits"] == ["test"]
    with pytest.raises(ConfigError, match="dicom_splits needs 'dicom'"):
        make_cohort(tmp_path / "x", formats=("nii",), dicom_splits=("test",), **small)
    with pytest.raises(ConfigError, match="dicom_splits must name splits"):
        make_cohort(tmp_path / "x", formats=("nii", "dicom"), dicom_splits=("holdout",), **small)


def test_bad_parameters():
    with pytest.raises(ConfigError, match="formats"):
        make_cohort("/tmp/unused", 2, formats=("png",))
    with pytest.raises(ConfigError, match="prevalence"):
        make_cohort("/tmp/unused", 2, prevalence=1.5)
    with pytest.raises(ConfigError, match="image_format"):
        make_cohort("/tmp/unused", 2, formats=("nifti",), image_format="dicom")
    with pytest.raises(ConfigError, match="preset") as err:
        ensure_cohort("nlst")
    assert "study" in err.value.fix
