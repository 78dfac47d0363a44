"""lungcal.data.synthetic.writers: DICOM series (uncompressed and RLE), NIfTI, planted identifiers."""
from __future__ import annotations

import nibabel as nib
import numpy as np
import pydicom
import pytest
from pydicom.uid import RLELossless

from lungcal.data.synthetic import fake_identifiers, write_dicom_series, write_nifti

SPACING = (0.8, 0.9, 2.0)
ORIGIN = (-10.0, 4.5, -30.0)


def _volume(shape=(24, 20, 6)):
    return np.random.default_rng(0).integers(-1024, 3071, size=shape).astype(np.int16)


def test_fake_identifiers_are_seeded_and_fake():
    a, b = fake_identifiers(np.random.default_rng(1)), fake_identifiers(np.random.default_rng(1))
    assert a == b and a != fake_identifiers(np.random.default_rng(2))
    assert "FAKE" in a["PatientName"] and a["PatientID"].startswith("LCSIM")
    assert len({a["StudyInstanceUID"], a["SeriesInstanceUID"], a["FrameOfReferenceUID"]}) == 3


@pytest.mark.parametrize("syntax", [None, RLELossless])
def test_dicom_series_round_trip_and_determinism(tmp_path, syntax):
    vol = _volume()
    ids = fake_identifiers(np.random.default_rng(3))
    runs = [write_dicom_series(vol, ORIGIN, SPACING, tmp_path / name, ids, np.random.default_rng(4),
                               transfer_syntax=syntax) for name in ("a", "b")]
    assert [p.read_bytes() for p in runs[0]] == [p.read_bytes() for p in runs[1]]  # UIDs come from the rng
    sops = set()
    for k, path in enumerate(runs[0]):
        ds = pydicom.dcmread(path)
        hu = ds.pixel_array.T.astype(int) * int(ds.RescaleSlope) + int(ds.RescaleIntercept)
        np.testing.assert_array_equal(hu, vol[:, :, k])
        np.testing.assert_allclose([float(v) for v in ds.ImagePositionPatient], [*ORIGIN[:2], ORIGIN[2] + k * 2.0],
                                   rtol=1e-6)
        assert int(ds.InstanceNumber) == k + 1
        assert ds.SOPInstanceUID == ds.file_meta.MediaStorageSOPInstanceUID
        assert ds.SeriesInstanceUID == ids["SeriesInstanceUID"] and str(ds.PatientName) == ids["PatientName"]
        sops.add(ds.SOPInstanceUID)
    assert len(sops) == vol.shape[2]


def test_nifti_round_trip_with_nibabel(tmp_path):
    vol = _volume()
    path = tmp_path / "sub" / "ct.nii.gz"
    write_nifti(vol, ORIGIN, SPACING, path)
    img = nib.load(path)
    np.testing.assert_array_equal(np.asarray(img.dataobj), vol)
    # ITK writes LPS; NIfTI's affine is RAS: x and y flip
    np.testing.assert_allclose(img.affine, [[-0.8, 0, 0, 10.0], [0, -0.9, 0, -4.5], [0, 0, 2.0, -30.0], [0, 0, 0, 1]],
                               atol=1e-5)
