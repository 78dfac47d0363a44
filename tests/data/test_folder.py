"""``find_cts``: a folder as a user has it (the CT, its nodule mask, annotation XML and CSVs, a DICOM
folder beside an XML folder) gives its CTs, and every other entry by name with why it is skipped."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.data.folder import find_cts, image_kind
from lungcal.data.synthetic import ScannerProfile, fake_identifiers, make_phantom, write_dicom_series, write_nifti
from lungcal.errors import DataError

SHAPE, SPACING = (64, 64, 32), (5.0, 5.0, 5.0)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A case folder: ct.nii.gz, a binary nodule mask, a reader-count label map, a probability map, XML,
    CSV, a DICOM series sub-folder and a sub-folder of XML boxes."""
    root = tmp_path_factory.mktemp("folder") / "LIDC-like-case"
    hu, origin, lungs = make_phantom(np.random.default_rng(2), SHAPE, SPACING, (), ScannerProfile(noise_hu=10))
    write_nifti(hu, origin, SPACING, root / "ct.nii.gz")
    write_nifti(lungs.astype(np.uint8), origin, SPACING, root / "nodule_mask.nii.gz")
    labels = np.zeros(SHAPE, np.int16)
    labels[20:30, 20:30, 10:20] = np.arange(1, 5).repeat(3)[:10][None, None, :10]
    write_nifti(labels, origin, SPACING, root / "nodule_mask_nreaders.nii.gz")
    write_nifti(np.clip((hu + 1000) / 1400.0, 0, 1).astype(np.float32), origin, SPACING, root / "normalised.nii.gz")
    (root / "annotation.xml").write_text("<LidcReadMessage/>")
    (root / "nodules.csv").write_text("x,y,z\n1,2,3\n")
    (root / ".DS_Store").write_text("hidden")
    write_dicom_series(hu, origin, SPACING, root / "dicom", fake_identifiers(np.random.default_rng(1)))
    (root / "annotation_xml").mkdir()
    (root / "annotation_xml" / "box.xml").write_text("<annotation/>")
    return root


def test_a_case_folder_gives_its_cts_and_names_every_skipped_entry(case):
    found = find_cts(case)
    assert [p.name for p in found.cts] == ["ct.nii.gz", "dicom"]  # sorted; hidden entries ignored
    skipped = dict(found.skipped)
    assert set(skipped) == {"annotation.xml", "annotation_xml/", "nodule_mask.nii.gz", "nodule_mask_nreaders.nii.gz",
                            "nodules.csv", "normalised.nii.gz"}
    assert skipped["nodule_mask.nii.gz"].startswith("a binary mask (values 0, 1), not a CT image")
    assert skipped["nodule_mask_nreaders.nii.gz"].startswith("a label map (values 0, 1, 2, 3, 4), not a CT image")
    assert "not Hounsfield units" in skipped["normalised.nii.gz"]
    assert skipped["annotation.xml"] == "not a CT image (.xml)" and skipped["nodules.csv"] == "not a CT image (.csv)"
    assert skipped["annotation_xml/"] == "no CT in it (holds 1 .xml)"
    assert found.skipped_lines()[0] == "skipped annotation.xml: not a CT image (.xml)"


def test_a_dicom_folder_is_one_ct_and_its_other_files_are_listed(case, tmp_path):
    assert find_cts(case / "dicom").cts == [(case / "dicom").absolute()]
    (case / "dicom" / "README.txt").write_text("exported by ...")
    try:
        assert find_cts(case / "dicom").skipped == [("README.txt", "not a DICOM file")]
    finally:
        (case / "dicom" / "README.txt").unlink()


def test_a_file_that_is_not_a_ct_is_refused_naming_it(case):
    assert image_kind(case / "ct.nii.gz") is None
    assert find_cts(case / "ct.nii.gz").cts == [(case / "ct.nii.gz").absolute()]
    with pytest.raises(DataError, match=r"nodule_mask_nreaders.nii.gz: a label map \(values 0, 1, 2, 3, 4\)"):
        find_cts(case / "nodule_mask_nreaders.nii.gz")
    with pytest.raises(DataError, match=r"annotation.xml: not a CT image \(.xml\)"):
        find_cts(case / "annotation.xml")
    with pytest.raises(DataError, match=r"missing.nii.gz: not found"):
        find_cts(case / "missing.nii.gz")


def test_a_folder_without_a_ct_lists_what_it_holds(case):
    with pytest.raises(DataError) as err:
        find_cts(case / "annotation_xml", field="inputs")
    text = str(err.value)
    assert text.startswith(f"{case / 'annotation_xml'}, field 'inputs': the folder holds no CT; found box.xml: "
                           "not a CT image (.xml)")
    assert "Fix:" in text and "\n" not in text
