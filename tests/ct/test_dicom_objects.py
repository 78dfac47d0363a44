"""A DICOM series is judged by what it holds (lungcal.ct.dicom_objects through lungcal.ct.io.load_ct): each
variant an export can be, accepted or refused by name, on series written here and on the real planning CT
of ../shared (a radiotherapy planning system's ORIGINAL\\SECONDARY\\AXIAL export of a diagnostic CT)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import EnhancedCTImageStorage, ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

from lungcal.ct.dicom_objects import AXIAL_CT, Kind, frame_headers, kind, plane, series_kind
from lungcal.ct.io import load_ct
from lungcal.ct.qc import check_series
from lungcal.errors import DataError
from tests.ct.test_io import _ras, _series, _volume

PLANNING_CT = "NSCLC-Radiomics-LUNG1-002"


# --------------------------------------------------------------------------------------------
# the variants, as header edits of a series' files
def _edit(paths, edit) -> None:
    for p in paths:
        ds = pydicom.dcmread(p)
        edit(ds)
        ds.save_as(p)


def _image_type(*values):
    def edit(ds):
        ds.ImageType = list(values)
    return edit


def _secondary_capture(ds):
    ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage


def _rgb(ds):  # the header of a colour screen grab (the pixels are never decoded)
    ds.PhotometricInterpretation, ds.SamplesPerPixel = "RGB", 3


def _burned_in(ds):
    ds.BurnedInAnnotation = "YES"


def _coronal(ds):
    """The slice turned into a coronal plane: rows run along x, columns head-to-foot, slices stacked along y."""
    x, y, z = (float(v) for v in ds.ImagePositionPatient)
    ds.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    ds.ImagePositionPatient = [x, z, 0.0]


REFUSED = {  # edit -> (what the refusal names, the field it names)
    "localizer": (_image_type("ORIGINAL", "PRIMARY", "LOCALIZER"), "CT localizer (scout)", "ImageType"),
    "secondary capture": (_secondary_capture, "CT secondary capture (a screen capture)", "SOPClassUID"),
    "rgb": (_rgb, "CT colour image (RGB: a screen capture)", "PhotometricInterpretation"),
    "burned-in": (_burned_in, "CT image with burned-in annotation (a screen capture)", "BurnedInAnnotation"),
    "coronal reformat": (_coronal, "CT coronal reformat (not axial)", "ImageOrientationPatient"),
}
ACCEPTED = {  # ImageType -> the series check's verdict (default settings) and its words
    ("ORIGINAL", "SECONDARY", "AXIAL"): ("pass", "re-exported"),
    ("DERIVED", "SECONDARY", "AXIAL"): ("warn", "derived image"),
}


@pytest.mark.parametrize("image_type", list(ACCEPTED), ids="\\".join)
def test_secondary_axial_ct_series_are_read_and_judged_by_the_series_checks(tmp_path, image_type):
    vol, paths = _series(tmp_path / "s")
    _edit(paths, _image_type(*image_type))
    img = load_ct(tmp_path / "s")
    np.testing.assert_array_equal(img[0].numpy(), _ras(vol))
    assert img.meta["series_info"]["image_type"] == list(image_type)
    verdict, words = ACCEPTED[image_type]
    check = check_series(img)["series_type"]
    assert check.verdict == verdict and words in check.reason, check
    # derived="fail" refuses DERIVED (value 1); value 2, SECONDARY, is never judged
    strict = check_series(img, derived="fail")["series_type"].verdict
    assert strict == ("fail" if image_type[0] == "DERIVED" else "pass")


@pytest.mark.parametrize("variant", list(REFUSED))
def test_refused_variants_name_what_they_are_the_field_and_the_fix(tmp_path, variant):
    edit, what, field = REFUSED[variant]
    _, paths = _series(tmp_path / "s", vol=_volume((24, 20, 16)))
    _edit(paths, edit)
    with pytest.raises(DataError) as err:
        load_ct(tmp_path / "s")
    text = str(err.value)
    assert f"no axial CT series found; the folder holds: #2 {what} (16 files)" in text, text
    assert err.value.field == field and err.value.fix and "\n" not in text


def test_a_topogram_without_the_localizer_value_is_a_localizer(tmp_path):
    """One or two non-axial images (an AP and a lateral projection), ImageType saying only AXIAL: a localizer."""
    _, paths = _series(tmp_path / "s", vol=_volume((24, 20, 2)))
    _edit(paths, _coronal)
    with pytest.raises(DataError, match=r"#2 CT localizer \(scout: 2 coronal projection images\) \(2 files\)") as err:
        load_ct(tmp_path / "s")
    assert err.value.field == "ImageOrientationPatient" and "localizer is the planning projection" in err.value.fix


def test_the_axial_series_is_read_beside_a_reformat_a_localizer_and_a_screen_capture(tmp_path):
    folder = tmp_path / "study"
    vol, paths = _series(folder / "axial", seed=0)
    _edit(paths, _image_type("ORIGINAL", "SECONDARY", "AXIAL"))
    for i, (name, (edit, _, _)) in enumerate(REFUSED.items()):  # each with more images than the axial series
        _, other = _series(folder / name.replace(" ", "_"), vol=_volume((24, 20, 16), seed=i + 1), seed=i + 1)
        _edit(other, edit)
    np.testing.assert_array_equal(load_ct(folder)[0].numpy(), _ras(vol))


def test_a_mip_is_read_only_when_nothing_else_is_there(tmp_path):
    folder = tmp_path / "study"
    vol, _ = _series(folder / "axial", seed=0)
    _, mip = _series(folder / "mip", vol=_volume((24, 20, 16), seed=3), seed=3)
    _edit(mip, _image_type("DERIVED", "SECONDARY", "AXIAL", "MIP"))
    np.testing.assert_array_equal(load_ct(folder)[0].numpy(), _ras(vol))
    shutil.rmtree(folder / "axial")
    check = check_series(load_ct(folder))["series_type"]  # read, and refused by the series check, by name
    assert check.verdict == "fail" and "maximum-intensity projection" in check.reason


def test_kinds_and_planes():
    assert [plane(o) for o in ([1, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, -1], [0, 1, 0, 0, 0, -1],
                               [1, 0, 0, 0, 0.96, 0.28], [1, 0, 0, 0, 0.7, 0.7])] == \
        ["axial", "coronal", "sagittal", "axial", "oblique"]  # a 16 degree gantry tilt is still axial
    ds = Dataset()
    ds.Modality = "MR"
    assert kind(ds)[:2] == ("MR (not CT)", "Modality")
    assert series_kind([Kind(AXIAL_CT)] * 3 + [Kind("CT localizer (scout)")]).what == AXIAL_CT


# --------------------------------------------------------------------------------------------
# enhanced (multi-frame) CT
def _enhanced(slices: list[Path], out: Path, geometry: bool = True) -> Path:
    """An Enhanced CT Image Storage file holding the single-frame ``slices``: the frames in file order,
    each frame's position and rescale in its per-frame functional groups, the orientation and pixel
    measures shared (as scanners write them)."""
    src = [pydicom.dcmread(p) for p in slices]
    first = src[0]
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = EnhancedCTImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID, ds.SOPInstanceUID = EnhancedCTImageStorage, ds.file_meta.MediaStorageSOPInstanceUID
    for kw in ("Modality", "StudyInstanceUID", "SeriesInstanceUID", "SeriesNumber", "Rows", "Columns",
               "SamplesPerPixel", "PhotometricInterpretation", "BitsAllocated", "BitsStored", "HighBit",
               "PixelRepresentation"):
        setattr(ds, kw, first[kw].value)
    ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
    ds.NumberOfFrames = len(src)
    shared = Dataset()
    if geometry:
        orientation, measures = Dataset(), Dataset()
        orientation.ImageOrientationPatient = first.ImageOrientationPatient
        measures.PixelSpacing, measures.SliceThickness = first.PixelSpacing, first.SliceThickness
        shared.PlaneOrientationSequence, shared.PixelMeasuresSequence = [orientation], [measures]
    ds.SharedFunctionalGroupsSequence = [shared]
    frames = []
    for s in src:
        frame, position, rescale, frame_type = Dataset(), Dataset(), Dataset(), Dataset()
        position.ImagePositionPatient = s.ImagePositionPatient
        rescale.RescaleSlope, rescale.RescaleIntercept, rescale.RescaleType = s.RescaleSlope, s.RescaleIntercept, "HU"
        frame_type.FrameType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
        if geometry:
            frame.PlanePositionSequence = [position]
        frame.PixelValueTransformationSequence, frame.CTImageFrameTypeSequence = [rescale], [frame_type]
        frames.append(frame)
    ds.PerFrameFunctionalGroupsSequence = frames
    ds.PixelData = b"".join(s.PixelData for s in src)
    out.parent.mkdir(parents=True, exist_ok=True)
    ds.save_as(out, enforce_file_format=True)
    return out


def test_an_enhanced_multiframe_ct_is_read_as_its_single_frame_series(tmp_path):
    vol, paths = _series(tmp_path / "single")
    rng = np.random.default_rng(0)
    _enhanced([paths[i] for i in rng.permutation(len(paths))], tmp_path / "enhanced" / "ct.dcm")  # frames shuffled
    single, multi = load_ct(tmp_path / "single"), load_ct(tmp_path / "enhanced")
    np.testing.assert_array_equal(multi.numpy(), single.numpy())
    np.testing.assert_allclose(multi.affine.numpy(), single.affine.numpy(), atol=1e-6)
    info = multi.meta["series_info"]
    assert info["multiframe"] and info["n_files"] == vol.shape[2] and info["image_type"][:2] == ["ORIGINAL", "PRIMARY"]
    assert check_series(multi)["series_type"].verdict == "pass"
    headers = frame_headers(pydicom.dcmread(tmp_path / "enhanced" / "ct.dcm"))
    assert len(headers) == vol.shape[2] and all(kind(h).usable for h in headers)


def test_an_enhanced_ct_without_per_frame_geometry_is_refused_by_name(tmp_path):
    _, paths = _series(tmp_path / "single")
    _enhanced(paths, tmp_path / "enhanced" / "ct.dcm", geometry=False)
    with pytest.raises(DataError, match=r"enhanced multi-frame CT without per-frame geometry \(10 frames\)") as err:
        load_ct(tmp_path / "enhanced")
    assert "dcm2niix" in err.value.fix and err.value.field == "PerFrameFunctionalGroupsSequence"


# --------------------------------------------------------------------------------------------
# the real planning CT (../shared/data/ct, PROVENANCE.md)
@pytest.fixture(scope="module")
def planning(shared_dir):
    d = shared_dir / "data" / "ct" / PLANNING_CT
    if not (d / "dicom").is_dir():
        pytest.skip(f"the real planning CT is not in {d}")
    return d


@pytest.fixture(scope="module")
def planning_ct(planning):
    return load_ct(planning)  # the case folder: its dicom/ and the RT structure set beside it


def test_the_planning_ct_is_read_and_accepted_by_the_series_checks(planning_ct):
    info = planning_ct.meta["series_info"]
    assert info["image_type"] == ["ORIGINAL", "SECONDARY", "AXIAL"] and info["n_files"] == 111
    assert info["n_series_in_folder"] == 2  # the CT and the RT structure set, which is passed over
    assert planning_ct.shape == (1, 512, 512, 111)
    report = check_series(planning_ct)
    # accepted: nothing fails; its 3 mm slices warn (above 2.5 mm), as any 3 mm scan's do
    assert report.ok and [c.name for c in report.warnings] == ["slice_thickness"], report.format()
    assert "re-exported" in report["series_type"].reason and report["hu_air"].verdict == "pass"


@pytest.fixture(scope="module")
def planning_slab(planning, tmp_path_factory):
    """20 consecutive slices of the planning CT (its real headers and pixels), for the variants."""
    files = sorted((planning / "dicom").iterdir(), key=lambda p: float(pydicom.dcmread(p, stop_before_pixels=True)
                                                                         .ImagePositionPatient[2]))
    out = tmp_path_factory.mktemp("planning_slab")
    for p in files[40:60]:
        shutil.copy(p, out / p.name)
    return out


@pytest.mark.parametrize("variant", list(REFUSED))
def test_the_planning_ct_headers_edited_into_each_refused_variant_are_refused_by_name(planning_slab, tmp_path, variant):
    edit, what, field = REFUSED[variant]
    shutil.copytree(planning_slab, tmp_path / "s")
    _edit(sorted((tmp_path / "s").iterdir()), edit)
    with pytest.raises(DataError, match="the folder holds: #1 " + what.replace("(", r"\(").replace(")", r"\)")) as err:
        load_ct(tmp_path / "s")
    assert err.value.field == field


def test_the_planning_ct_as_an_enhanced_multiframe_ct_reads_the_same(planning_slab, tmp_path):
    _enhanced(sorted(planning_slab.iterdir()), tmp_path / "enhanced" / "ct.dcm")
    single, multi = load_ct(planning_slab), load_ct(tmp_path / "enhanced")
    np.testing.assert_array_equal(multi.numpy(), single.numpy())
    np.testing.assert_allclose(multi.affine.numpy(), single.affine.numpy(), atol=1e-6)
    assert float(single.min()) == -1024.0  # air, as the planning system stored it
    assert np.allclose(np.asarray(single.pixdim)[:3], (0.977, 0.977, 3.0), atol=1e-3)
