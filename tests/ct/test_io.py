"""lungcal.ct.io: DICOM series (real-world surprises), NIfTI, MHD."""
from __future__ import annotations

import shutil

import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from monai.transforms import LoadImage
from pydicom.data import get_testdata_file
from pydicom.dataset import FileMetaDataset
from pydicom.uid import JPEG2000Lossless, RLELossless

from lungcal.ct.io import DicomSeriesReader, SimpleITKReader, load_ct
from lungcal.data.synthetic import fake_identifiers, write_dicom_series
from lungcal.errors import DataError

SPACING = (0.8, 0.9, 2.0)  # anisotropic on purpose: any axis mix-up changes the affine


def _volume(shape=(24, 20, 10), seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(-1000, 1500, size=shape).astype(np.int16)


def _series(folder, vol=None, origin=(-10.0, 20.0, -30.0), seed=0, **kw):
    vol = _volume(seed=seed) if vol is None else vol
    ids = fake_identifiers(np.random.default_rng(seed))
    paths = write_dicom_series(vol, origin, SPACING, folder, ids, np.random.default_rng(seed + 1), **kw)
    return vol, paths


def _expected_affine(origin, shape):
    # LPS origin, identity orientation -> RAS: x and y flip, origin moves to the far corner
    aff = np.diag([SPACING[0], SPACING[1], SPACING[2], 1.0])
    aff[:3, 3] = [-(origin[0] + (shape[0] - 1) * SPACING[0]), -(origin[1] + (shape[1] - 1) * SPACING[1]), origin[2]]
    return aff


def _ras(vol):
    return vol[::-1, ::-1, :].astype(np.float32)


def test_dicom_series_values_geometry_and_shuffled_files(tmp_path):
    vol, paths = _series(tmp_path / "s")
    # files out of order: file names no longer follow the slice position
    rng = np.random.default_rng(3)
    perm = rng.permutation(len(paths))
    for i, p in enumerate(paths):
        p.rename(p.with_name(f"tmp_{perm[i]:03d}.dcm"))
    img = load_ct(tmp_path / "s")
    assert img.shape == (1, *vol.shape) and img.dtype.is_floating_point
    np.testing.assert_array_equal(img[0].numpy(), _ras(vol))
    np.testing.assert_allclose(img.affine.numpy(), _expected_affine((-10.0, 20.0, -30.0), vol.shape), atol=1e-4)
    np.testing.assert_allclose(np.asarray(img.pixdim)[:3], SPACING, atol=1e-6)


def test_real_ct_small_file_against_pydicom(tmp_path):
    src = get_testdata_file("CT_small.dcm")
    ds0 = pydicom.dcmread(src)
    folder = tmp_path / "ct_small"
    folder.mkdir()
    iop = np.asarray(ds0.ImageOrientationPatient, float)
    normal = np.cross(iop[:3], iop[3:])
    for k in range(3):  # three slices 5 mm apart along the normal, written in reverse order
        ds = pydicom.dcmread(src)
        ds.ImagePositionPatient = list(np.asarray(ds0.ImagePositionPatient, float) + 5.0 * k * normal)
        ds.SOPInstanceUID = pydicom.uid.generate_uid()
        ds.save_as(folder / f"{2 - k}.dcm")
    img = load_ct(folder)
    hu = pydicom.pixels.apply_rescale(ds0.pixel_array, ds0).astype(np.float32)
    assert img.shape == (1, ds0.Columns, ds0.Rows, 3)
    # RAS flips the in-plane axes of this LPS-identity image; slice 0 = the lowest position
    np.testing.assert_allclose(img[0, :, :, 0].numpy(), hu.T[::-1, ::-1], atol=1e-3)
    dr, dc = (float(v) for v in ds0.PixelSpacing)
    np.testing.assert_allclose(np.asarray(img.pixdim)[:3], [dc, dr, 5.0], atol=1e-4)


def test_missing_modality_and_compressed_rle(tmp_path):
    vol, paths = _series(tmp_path / "rle", transfer_syntax=RLELossless)
    for p in paths:
        ds = pydicom.dcmread(p)
        assert ds.file_meta.TransferSyntaxUID == RLELossless
        del ds.Modality
        ds.save_as(p)
    np.testing.assert_array_equal(load_ct(tmp_path / "rle")[0].numpy(), _ras(vol))


def test_jpeg2000_lossless_decoded(tmp_path):
    vol, paths = _series(tmp_path / "j2k", vol=_volume((64, 64, 4)))  # openjpeg needs >= 32 px tiles
    try:
        for p in paths:
            ds = pydicom.dcmread(p)
            ds.compress(JPEG2000Lossless)
            ds.save_as(p)
    except Exception as exc:  # encoder plugin not available: decoding is still covered by RLE
        pytest.skip(f"no JPEG 2000 encoder: {exc}")
    np.testing.assert_array_equal(load_ct(tmp_path / "j2k")[0].numpy(), _ras(vol))


def test_gap_raises_unless_allowed(tmp_path):
    vol, paths = _series(tmp_path / "gap")
    paths[4].unlink()
    with pytest.raises(DataError, match="missing slice"):
        load_ct(tmp_path / "gap")
    img = load_ct(tmp_path / "gap", allow_gaps=True)
    assert img.shape == (1, *vol.shape)  # the gap is interpolated back onto the uniform grid
    ras = _ras(vol)
    np.testing.assert_allclose(img[0, :, :, 4].numpy(), 0.5 * (ras[:, :, 3] + ras[:, :, 5]), atol=1e-3)
    np.testing.assert_array_equal(img[0, :, :, 6].numpy(), ras[:, :, 6])


def test_uneven_spacing_is_resampled(tmp_path):
    vol, paths = _series(tmp_path / "uneven")
    ds = pydicom.dcmread(paths[5])
    pos = list(ds.ImagePositionPatient)
    pos[2] = float(pos[2]) + 0.5  # slice 5 sits 0.5 mm too high (steps 2.5 / 1.5 mm)
    ds.ImagePositionPatient = pos
    ds.save_as(paths[5])
    img = load_ct(tmp_path / "uneven")
    assert img.shape == (1, *vol.shape)
    np.testing.assert_allclose(np.asarray(img.pixdim)[2], 2.0, atol=1e-6)
    ras = _ras(vol)
    # the uniform grid point of slice 5 lies 0.5/2.5 of the way from slice 4 to the moved slice 5
    np.testing.assert_allclose(img[0, :, :, 5].numpy(), ras[:, :, 4] + 0.8 * (ras[:, :, 5] - ras[:, :, 4]), atol=1e-2)


def test_two_series_scout_and_non_ct_picks_the_axial_ct(tmp_path):
    folder = tmp_path / "mixed"
    vol, _ = _series(folder / "a", seed=0)  # 10 slices: the one we want
    _series(folder / "b", vol=_volume((24, 20, 6), seed=5), seed=5)  # a shorter CT series
    # an MR series with more slices must be ignored
    _, mr = _series(folder / "c", vol=_volume((24, 20, 14), seed=7), seed=7)
    for p in mr:
        ds = pydicom.dcmread(p)
        ds.Modality = "MR"
        ds.save_as(p)
    # a scout/localizer with many "slices" and a secondary capture, also ignored
    _, scout = _series(folder / "d", vol=_volume((24, 20, 16), seed=9), seed=9)
    for p in scout:
        ds = pydicom.dcmread(p)
        ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
        ds.save_as(p)
    _, sc = _series(folder / "e", vol=_volume((24, 20, 18), seed=11), seed=11)
    for p in sc:
        ds = pydicom.dcmread(p)
        ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.7"
        ds.save_as(p)
    (folder / "README.txt").write_text("not dicom")
    np.testing.assert_array_equal(load_ct(folder)[0].numpy(), _ras(vol))


def test_truncated_file_names_the_file(tmp_path):
    _, paths = _series(tmp_path / "trunc")
    data = paths[3].read_bytes()
    paths[3].write_bytes(data[: len(data) - 300])  # pixel data cut short
    with pytest.raises(DataError) as err:
        load_ct(tmp_path / "trunc")
    assert paths[3].name in str(err.value)


def test_corrupt_header_names_the_file(tmp_path):
    _, paths = _series(tmp_path / "bad")
    paths[2].write_bytes(b"garbage" * 10)
    with pytest.raises(DataError) as err:
        load_ct(tmp_path / "bad")
    assert paths[2].name in str(err.value)


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_ct(tmp_path / "nope.nii.gz")
    (tmp_path / "x.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match="unsupported"):
        load_ct(tmp_path / "x.png")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no axial CT series"):
        load_ct(tmp_path / "empty")


def _sitk_image(vol, origin, direction=(1, 0, 0, 0, 1, 0, 0, 0, 1)):
    img = sitk.GetImageFromArray(np.ascontiguousarray(vol.transpose(2, 1, 0)))
    img.SetSpacing(SPACING)
    img.SetOrigin(origin)
    img.SetDirection(direction)
    return img


def test_nifti_matches_nibabel(tmp_path):
    nib = pytest.importorskip("nibabel")
    vol = _volume()
    # an oblique-free but flipped direction (x reversed) exercises the orientation handling
    sitk.WriteImage(_sitk_image(vol, (5.0, -7.0, 11.0), (-1, 0, 0, 0, 1, 0, 0, 0, 1)), str(tmp_path / "v.nii.gz"))
    img = load_ct(tmp_path / "v.nii.gz")
    ref = nib.as_closest_canonical(nib.load(str(tmp_path / "v.nii.gz")))  # RAS, as MONAI/nibabel see it
    np.testing.assert_allclose(img.affine.numpy(), ref.affine, atol=1e-4)
    np.testing.assert_allclose(img[0].numpy(), np.asarray(ref.dataobj, dtype=np.float32), atol=1e-4)


def test_mhd_and_dicom_of_the_same_volume_agree(tmp_path):
    vol, _ = _series(tmp_path / "dcm", origin=(-10.0, 20.0, -30.0))
    sitk.WriteImage(_sitk_image(vol, (-10.0, 20.0, -30.0)), str(tmp_path / "v.mhd"))
    a, b = load_ct(tmp_path / "dcm"), load_ct(tmp_path / "v.mhd")
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(a.affine.numpy(), b.affine.numpy(), atol=1e-4)


def test_readers_are_monai_readers(tmp_path):
    vol, _ = _series(tmp_path / "dcm")
    sitk.WriteImage(_sitk_image(vol, (-10.0, 20.0, -30.0)), str(tmp_path / "v.nrrd"))
    assert SimpleITKReader().verify_suffix(str(tmp_path / "v.nrrd"))
    assert DicomSeriesReader().verify_suffix(str(tmp_path / "dcm"))
    x = LoadImage(image_only=True, ensure_channel_first=True)(str(tmp_path / "v.nrrd"), reader=SimpleITKReader())
    y = LoadImage(image_only=True, ensure_channel_first=True)(str(tmp_path / "dcm"), reader=DicomSeriesReader())
    np.testing.assert_array_equal(x.numpy(), y.numpy())
    # load_ct = LoadImage + RAS orientation (it only skips LoadImage's contiguity copy)
    z = load_ct(tmp_path / "v.nrrd")
    np.testing.assert_array_equal(z.numpy(), x.numpy())
    np.testing.assert_allclose(z.affine.numpy(), x.affine.numpy())
    assert str(z.meta["filename_or_obj"]).endswith("v.nrrd")
    shutil.rmtree(tmp_path / "dcm")


def _dose_report(path, seed=13):
    """A minimal DICOM SR object (what a CT dose report looks like to a folder scan)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.88.67"
    meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
    meta.TransferSyntaxUID = pydicom.uid.ExplicitVRLittleEndian
    ds = pydicom.Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.Modality = "SR"
    ds.SeriesInstanceUID = pydicom.uid.generate_uid()
    ds.SeriesNumber = 99
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def _mark_scout(paths):
    for p in paths:
        ds = pydicom.dcmread(p)
        ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
        ds.save_as(p)


def test_series_uid_picks_a_series_and_the_choice_is_logged_without_uids(tmp_path, caplog):
    folder = tmp_path / "pacs"
    vol, a = _series(folder / "a", seed=0)  # 10 slices
    small = _volume((24, 20, 6), seed=5)
    _, b = _series(folder / "b", vol=small, seed=5)
    _, scout = _series(folder / "d", vol=_volume((24, 20, 3), seed=9), seed=9)
    _mark_scout(scout)
    _dose_report(folder / "dose" / "sr.dcm")
    uid_b = str(pydicom.dcmread(b[0]).SeriesInstanceUID)
    uids = {str(pydicom.dcmread(p[0]).SeriesInstanceUID) for p in (a, b, scout)}
    with caplog.at_level("INFO", logger="lungcal.ct.io"):
        img = load_ct(folder)
    np.testing.assert_array_equal(img[0].numpy(), _ras(vol))  # default: the axial CT with most slices
    assert "4 series" in caplog.text and "CT localizer" in caplog.text and "structured report" in caplog.text
    assert "most slices" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="lungcal.ct.io"):
        img = load_ct(folder, series_uid=uid_b)
    np.testing.assert_array_equal(img[0].numpy(), _ras(small))
    assert "named by series_uid" in caplog.text and "(6 files)" in caplog.text
    assert not any(u in caplog.text for u in uids) and str(folder) not in caplog.text  # privacy
    info = img.meta["series_info"]
    assert info["format"] == "dicom" and info["modality"] == "CT" and info["n_gaps"] == 0
    assert info["n_series_in_folder"] == 4 and abs(info["step_median_mm"] - SPACING[2]) < 1e-6
    # a named series that is a scout, or not there at all
    with pytest.raises(DataError, match="not an axial CT series: it is a CT localizer") as err:
        load_ct(folder, series_uid=str(pydicom.dcmread(scout[0]).SeriesInstanceUID))
    assert err.value.field == "series_uid"
    with pytest.raises(DataError, match="not in the folder"):
        load_ct(folder, series_uid="1.2.3.4")


def test_folder_without_a_ct_series_lists_what_it_holds_in_one_line(tmp_path):
    folder = tmp_path / "nope"
    _, scout = _series(folder / "scout", vol=_volume((24, 20, 2), seed=9), seed=9)
    _mark_scout(scout)
    _, sc = _series(folder / "sc", vol=_volume((24, 20, 1), seed=11), seed=11)
    ds = pydicom.dcmread(sc[0])
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.7"
    ds.save_as(sc[0])
    _dose_report(folder / "sr.dcm")
    (folder / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="no axial CT series found") as err:
        load_ct(folder)
    text = str(err.value)
    assert "\n" not in text
    for what in ("CT localizer (scout) (2 files)", "secondary capture (a screen capture) (1 file)", "structured report",
                 "1 non-DICOM"):
        assert what in text, text


def test_series_uid_on_a_file_is_an_error(tmp_path):
    sitk.WriteImage(_sitk_image(_volume(), (0.0, 0.0, 0.0)), str(tmp_path / "v.nii.gz"))
    with pytest.raises(DataError, match="DICOM folder only"):
        load_ct(tmp_path / "v.nii.gz", series_uid="1.2.3")
    assert load_ct(tmp_path / "v.nii.gz").meta["series_info"] == {"format": "itk"}
