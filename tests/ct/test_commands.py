"""``lungcal qc``: a datalist or one CT, the printed reports, qc.csv without paths, exit codes."""
from __future__ import annotations

import csv

import numpy as np
import pydicom
import pytest

from lungcal.cli import main
from lungcal.ct.commands import parse_settings
from lungcal.ct.qc import CHECKS
from lungcal.data.manifest import save_manifest
from lungcal.data.synthetic import ScannerProfile, fake_identifiers, make_phantom, write_dicom_series, write_nifti
from lungcal.errors import ConfigError

SHAPE, SPACING = (128, 128, 96), (2.5, 2.5, 2.5)


@pytest.fixture(scope="module")
def cts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qc_cli") / "patient_0042"  # a folder name a path could leak
    root.mkdir()
    hu, origin, _ = make_phantom(np.random.default_rng(3), SHAPE, SPACING, (), ScannerProfile(noise_hu=15))
    write_nifti(hu, origin, SPACING, root / "good.nii.gz")
    thick = np.rint(hu.reshape(SHAPE[0], SHAPE[1], SHAPE[2] // 2, 2).mean(-1)).astype(np.int16)
    write_nifti(thick, origin, (2.5, 2.5, 5.0), root / "thick.nii.gz")
    return root


def test_one_good_ct_exits_0(cts, capsys):
    assert main(["qc", str(cts / "good.nii.gz")]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "1 CT(s): 1 pass, 0 warn, 0 fail" in out
    assert all(name in out for name in CHECKS)


def test_a_datalist_with_a_failing_and_an_unreadable_ct_exits_2(cts, tmp_path, capsys):
    rows = [{"image": str(cts / n), "label": 0, "subject": f"S{i:016x}", "site": "a", "split": "test"}
            for i, n in enumerate(["good.nii.gz", "thick.nii.gz", "missing.nii.gz"])]
    dl = save_manifest(rows, tmp_path / "dl.json", source="test")
    out_csv = tmp_path / "qc.csv"
    assert main(["qc", str(dl), "--csv", str(out_csv)]) == 2
    out = capsys.readouterr().out
    assert "3 CT(s): 1 pass, 0 warn, 2 fail" in out
    assert "slice_thickness  failed 1" in out and "unreadable       failed 1" in out
    table = list(csv.DictReader(out_csv.open()))
    assert set(table[0]) == {"pseudonym", "check", "verdict", "value"}
    assert len(table) == 2 * len(CHECKS) + 1
    assert {r["pseudonym"] for r in table} == {r["subject"] for r in rows}
    assert [r["verdict"] for r in table if r["check"] == "slice_thickness"] == ["pass", "fail"]
    assert "patient_0042" not in out_csv.read_text()  # pseudonyms, checks and values only
    # a looser threshold makes the thick CT pass
    assert main(["qc", str(cts / "thick.nii.gz"), "--set", "max_slice_thickness_mm=5",
                 "--set", "warn_slice_thickness_mm=5"]) == 0


def test_settings_are_typed_and_checked():
    assert parse_settings(["max_slice_thickness_mm=2", "min_slices=8", "derived=fail"]) == \
        {"max_slice_thickness_mm": 2.0, "min_slices": 8, "derived": "fail"}
    with pytest.raises(ConfigError, match="bad --set"):
        parse_settings(["thickness=2"])
    with pytest.raises(ConfigError, match="needs a float"):
        parse_settings(["max_slice_thickness_mm=thin"])
    assert main(["qc", "x.nii.gz", "--set", "nope=1"]) == 2  # one line on stderr, exit 2


def test_a_folder_of_case_folders_is_read_whatever_format_each_case_holds(cts, tmp_path, capsys):
    """As a new user points at a cohort: one case folder holds a NIfTI CT beside its reader-count mask and
    annotation files, another a DICOM series (a PACS re-export, ORIGINAL\\SECONDARY) beside a CSV, a third
    only annotations. Both CTs are checked; every other entry is named as skipped, with why."""
    root = tmp_path / "cohort"
    hu, origin, lungs = make_phantom(np.random.default_rng(3), SHAPE, SPACING, (), ScannerProfile(noise_hu=15))
    write_nifti(hu, origin, SPACING, root / "case_a" / "ct.nii.gz")
    readers = lungs.astype(np.int16)
    readers[60:64, 60:64, 40:44] = 4  # voxels every reader marked
    write_nifti(readers, origin, SPACING, root / "case_a" / "nodule_mask_nreaders.nii.gz")
    (root / "case_a" / "annotation.xml").write_text("<LidcReadMessage/>")
    ids = fake_identifiers(np.random.default_rng(5))
    paths = write_dicom_series(hu, origin, SPACING, root / "case_b" / "dicom", ids)
    for p in paths:
        ds = pydicom.dcmread(p)
        ds.ImageType = ["ORIGINAL", "SECONDARY", "AXIAL"]
        ds.save_as(p)
    (root / "case_b" / "lesions.csv").write_text("x,y,z\n")
    (root / "case_c").mkdir()
    (root / "case_c" / "boxes.xml").write_text("<annotation/>")
    assert main(["qc", str(root)]) == 0
    out = capsys.readouterr().out
    assert "2 CT(s): 2 pass, 0 warn, 0 fail; 3 other file(s) skipped" in out, out
    assert out.count("ct0000 ") == 1 and f"ct0000 {root / 'case_a' / 'ct.nii.gz'}: PASS" in out
    assert f"ct0001 {root / 'case_b'}: PASS" in out and "re-exported" in out
    assert "skipped case_a/annotation.xml: not a CT image (.xml)" in out
    assert "skipped case_a/nodule_mask_nreaders.nii.gz: a label map (values 0, 1, 4)" in out
    assert "skipped case_c/: no CT in it (holds 1 .xml)" in out
