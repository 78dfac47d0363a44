"""What ``lungcal predict`` reads (:mod:`lungcal.ctapp.data.inputs`), and a sample of bad inputs: each
error names the file, or the datalist row and field (issue 34 item 5), in one line."""
from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import SimpleITK as sitk

from lungcal.candidates.cache import build_bags
from lungcal.ct.io import load_ct
from lungcal.ct.transforms import preprocess_ct
from lungcal.ctapp.data.inputs import KEY_FILE, read_inputs, write_key
from lungcal.ctapp.data.unlabelled import unlabelled_rows
from lungcal.data.folder import find_cts
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import ScannerProfile, fake_identifiers, make_phantom, write_dicom_series, write_nifti
from lungcal.errors import DataError

SHAPE, SPACING = (64, 64, 32), (5.0, 5.0, 5.0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    hu, origin, lungs = make_phantom(np.random.default_rng(4), SHAPE, SPACING, (), ScannerProfile(noise_hu=10))
    case = root / "case"
    write_nifti(hu, origin, SPACING, case / "ct.nii.gz")
    write_nifti(lungs.astype(np.uint8), origin, SPACING, case / "nodule_mask.nii.gz")
    (case / "reader_1.xml").write_text("<x/>")
    dicom = root / "dicom"
    files = write_dicom_series(hu, origin, SPACING, dicom, fake_identifiers(np.random.default_rng(0)))
    return {"root": root, "case": case, "dicom": dicom, "files": files, "hu": hu, "origin": origin}


def test_a_case_folder_gives_rows_and_skipped_entries_and_the_key_lists_both(data, tmp_path):
    found = read_inputs(data["case"])
    assert [r["subject"] for r in found.rows] == ["ct0000"]
    assert found.rows[0]["image"] == str((data["case"] / "ct.nii.gz").absolute())
    assert [n for n, _ in found.skipped] == ["nodule_mask.nii.gz", "reader_1.xml"]
    key = write_key(found.rows, tmp_path, {"ct0000": "refused: too small"}, found.skipped, data["case"])
    assert key == tmp_path / KEY_FILE
    rows = list(csv.DictReader(key.open()))
    assert rows[0] == {"pseudonym": "ct0000", "image": found.rows[0]["image"], "series_uid": "",
                       "status": "refused: too small"}
    assert rows[1]["pseudonym"] == "" and rows[1]["image"] == str((data["case"] / "nodule_mask.nii.gz").absolute())
    assert rows[1]["status"].startswith("skipped: a binary mask")


def _one_line(exc: DataError) -> str:
    text = str(exc)
    assert "\n" not in text and "Fix:" in text, text
    return text


def test_bad_inputs_name_the_file_or_the_row_and_field(data, tmp_path):
    # a corrupt DICOM file in a series folder
    bad = data["root"] / "corrupt"
    write_dicom_series(data["hu"], data["origin"], SPACING, bad, fake_identifiers(np.random.default_rng(0)))
    (bad / "slice_0005.dcm").write_bytes(b"\x00" * 64 + b"not a DICOM file")
    with pytest.raises(DataError) as err:
        load_ct(bad)
    assert _one_line(err.value).startswith(f"{bad / 'slice_0005.dcm'}: not a readable DICOM file")
    # a truncated DICOM file: pixel data cut short
    cut = data["root"] / "truncated"
    write_dicom_series(data["hu"], data["origin"], SPACING, cut, fake_identifiers(np.random.default_rng(0)))
    raw = (cut / "slice_0003.dcm").read_bytes()
    (cut / "slice_0003.dcm").write_bytes(raw[: len(raw) - 3000])
    with pytest.raises(DataError) as err:
        load_ct(cut)
    assert _one_line(err.value).startswith(str(cut / "slice_0003.dcm"))
    # a NIfTI that is a label map, given as the CT
    with pytest.raises(DataError) as err:
        read_inputs(data["case"] / "nodule_mask.nii.gz")
    assert _one_line(err.value).startswith(f"{data['case'] / 'nodule_mask.nii.gz'}, field 'inputs': a binary mask")
    # a 2D NIfTI
    flat = tmp_path / "flat.nii.gz"
    sitk.WriteImage(sitk.GetImageFromArray(data["hu"][:, :, 0].astype(np.int16)), str(flat))
    with pytest.raises(DataError) as err:
        load_ct(flat)
    assert _one_line(err.value).startswith(f"{flat}: expected a 3D scalar CT volume")
    # a datalist row without an image (predict's reader and the training manifest)
    dl = tmp_path / "dl.json"
    dl.write_text(json.dumps({"rows": [{"image": str(data["case"] / "ct.nii.gz")}, {"subject": "S1"}]}))
    with pytest.raises(DataError) as err:
        read_inputs(dl)
    assert f"{dl}, row 1, field 'image'" in _one_line(err.value)
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"version": 1, "source": "x", "rows": [
        {"image": str(data["case"] / "ct.nii.gz"), "label": 0, "subject": "S0", "site": "a", "split": "test"},
        {"label": 1, "subject": "S1", "site": "a", "split": "test"}]}))
    with pytest.raises(DataError) as err:
        load_manifest(full, check_files=False)
    assert "row 1" in _one_line(err.value) and "image" in str(err.value)
    # a missing file: as a path, as a datalist row, in the loader
    with pytest.raises(DataError, match=rf"^{tmp_path / 'gone.nii.gz'}, field 'inputs': not found"):
        read_inputs(tmp_path / "gone.nii.gz")
    dl.write_text(json.dumps([{"image": "gone.nii.gz"}]))
    with pytest.raises(DataError, match=rf"^{dl}, row 0, field 'image': image not found"):
        read_inputs(dl)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'gone.nii.gz'}: image file not found"):
        load_ct(tmp_path / "gone.nii.gz")
    # a folder that is not a CT, through the preprocessing (training's path)
    with pytest.raises(DataError, match=rf"^{data['case']}: no axial CT series found"):
        preprocess_ct(data["case"])
    # the bag builder names the row and the field, not the path
    with pytest.raises(DataError) as err:
        build_bags([{"image": str(flat), "subject": "S9"}], {"spacing": [5.0, 5.0, 5.0]}, tmp_path / "bags",
                   num_workers=0, progress=False)
    assert _one_line(err.value).startswith("row 0, field 'image': could not build the bag of subject S9")


def test_a_folder_of_case_folders_gives_predict_and_site_check_the_cts_qc_checks(data, tmp_path):
    """A cohort folder of case folders, one holding a NIfTI CT beside its mask and XML, one a DICOM export, one
    only annotations: predict, site-check (unlabelled rows) and qc (find_cts) see the same CTs in the same
    order, and the key names each skipped entry by its path inside the cohort."""
    cohort = tmp_path / "cohort"
    shutil.copytree(data["case"], cohort / "LIDC-like")
    shutil.copytree(data["dicom"], cohort / "PACS-export" / "dicom")
    (cohort / "annotations").mkdir()
    (cohort / "annotations" / "boxes.xml").write_text("<annotation/>")
    want = [str((cohort / "LIDC-like" / "ct.nii.gz").absolute()), str((cohort / "PACS-export").absolute())]
    found = read_inputs(cohort)
    assert [r["image"] for r in found.rows] == want == [str(p) for p in find_cts(cohort).cts]
    assert [r["subject"] for r in found.rows] == ["ct0000", "ct0001"]
    assert [r["image"] for r in unlabelled_rows(cohort)] == want
    assert dict(found.skipped) == {
        "LIDC-like/nodule_mask.nii.gz": "a binary mask (values 0, 1), not a CT image: a CT holds air at about -1000 HU",
        "LIDC-like/reader_1.xml": "not a CT image (.xml)", "annotations/": "no CT in it (holds 1 .xml)"}
    key = list(csv.DictReader(write_key(found.rows, tmp_path, None, found.skipped, cohort).open()))
    assert key[2]["image"] == str((cohort / "LIDC-like" / "nodule_mask.nii.gz").absolute())
    np.testing.assert_array_equal(load_ct(found.rows[0]["image"]).numpy(), load_ct(found.rows[1]["image"]).numpy())
