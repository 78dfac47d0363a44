"""Reading chest CT into a MONAI ``MetaTensor`` of Hounsfield units.

:func:`load_ct` is the one entry point. It returns ``(1, X, Y, Z)`` float32 HU in RAS orientation
with ``.affine`` / ``.pixdim`` in millimetres, from

* a DICOM series folder (:class:`DicomSeriesReader`, pydicom; compressed transfer syntaxes are
  decoded by the pylibjpeg plugins: JPEG lossless, JPEG 2000, RLE);
* NIfTI (``.nii``, ``.nii.gz``), MetaImage (``.mhd``, ``.mha``) and NRRD (``.nrrd``, ``.nhdr``)
  (:class:`SimpleITKReader`; MONAI's ``ITKReader`` needs the ``itk`` package, which we do not use).

Both readers are MONAI :class:`~monai.data.ImageReader` s and return RAS affines (DICOM and ITK
are LPS; the first two rows are negated), so they plug into ``LoadImage`` like MONAI's own. They
flip in-plane axes towards RAS while converting to float32 (one copy), and hand out ``(X, Y, Z)``
as a transposed view of slice-contiguous memory; :func:`load_ct` wraps that view in a MetaTensor
without the transposing copy ``LoadImage`` would make.

How a DICOM folder is read (real exports are messy):

1. every file under the folder (recursively) is parsed once (pixel data decoded later, only for
   the chosen series); files that are not DICOM at
   all (no ``DICM`` preamble, e.g. ``DICOMDIR`` or a README) are skipped, but a ``.dcm`` file that
   cannot be parsed is a :class:`~lungcal.errors.DataError` naming the file;
2. files are grouped by ``SeriesInstanceUID`` and each image is judged by what it holds
   (:func:`lungcal.ct.dicom_objects.kind`): CT pixels (SOP class or ``Modality``), grey levels,
   not a localizer, axial geometry. ``ImageType`` values 1 and 2 do not decide: a PACS or
   planning-system re-export (``ORIGINAL\\SECONDARY\\AXIAL``) or a derived axial series is read,
   and the series checks judge it (``derived``, ``hu_air``). Localizers (``ImageType`` LOCALIZER or
   SCOUT, or a series of at most 3 non-axial images), screen captures (Secondary Capture SOP
   classes, colour pixels, burned-in annotation), dose reports and other modalities, and coronal,
   sagittal or oblique reformats are not candidates. A missing ``Modality`` tag is tolerated. An
   enhanced (multi-frame) CT is read frame by frame from its functional groups
   (:func:`lungcal.ct.dicom_objects.frame_headers`);
3. the series named by ``series_uid`` (when given), else the axial CT series with the most slices
   (then the thinnest, then an ORIGINAL one; a projection such as a MIP only when there is nothing
   else), wins, and the choice is logged with what else the folder held (series number, kind, file
   count: no UIDs, no paths). A folder without an axial CT series is a one-line
   :class:`~lungcal.errors.DataError` listing what it found, each series named by what it is
   (``CT localizer (scout)``, ``CT secondary capture (a screen capture, ...)``, ``CT coronal
   reformat (not axial)``, ...), with the field and the fix of the largest one. The slices are
   sorted by ``ImagePositionPatient`` projected on the slice normal (never by file name or
   InstanceNumber); duplicated positions keep the first instance;
4. a gap (a step > 1.5x the median step) is a ``DataError`` unless ``allow_gaps=True``; uneven
   steps (and allowed gaps) are resampled linearly along the normal onto a uniform grid at the
   median step;
5. pixel data is decoded per slice (per frame) and rescaled with that slice's (frame's)
   ``RescaleSlope`` / ``RescaleIntercept``. A truncated or corrupt file is a ``DataError`` naming the file.

(This module is longer than the house's ~400 lines on purpose: both readers share the RAS
flip-while-copying and meta helpers, and the DICOM folder rules above are one contract best read
in one place.)

The loaded MetaTensor carries ``meta["series_info"]``: what the series checks
(:mod:`lungcal.ct.qc`) read from the header and the slice positions (modality, image type, slice
thickness, slice steps, gaps, duplicates, resampling; for NIfTI/MHD/NRRD only the format). It
holds no identifier.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np
import pydicom
import SimpleITK as sitk
import torch
from monai.data import ImageReader, MetaTensor
from monai.transforms import Orientation
from pydicom.errors import InvalidDicomError
from pydicom.pixels import pixel_array

from lungcal.errors import DataError
from lungcal.runtime.parallel import map_slabs

from .dicom_objects import frame_headers, is_ct_image, is_multiframe_ct, is_projection, kind, series_kind

__all__ = [
    "load_ct",
    "DicomSeriesReader",
    "SimpleITKReader",
    "ITK_SUFFIXES",
    "is_dicom_dir",
    "read_dicom_series",
    "DicomVolume",
    "SERIES_INFO",
]

log = logging.getLogger(__name__)

ITK_SUFFIXES = (".nii", ".nii.gz", ".mhd", ".mha", ".nrrd", ".nhdr")
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
#: the meta key of the series information (see the module docstring)
SERIES_INFO = "series_info"


class DicomVolume(NamedTuple):
    """A read DICOM series: ``array (X, Y, Z)`` float32 HU, ``affine`` 4x4 RAS mm, ``info`` (the
    ``series_info`` dict)."""

    array: np.ndarray
    affine: np.ndarray
    info: dict


def _single(data: Sequence[str | os.PathLike] | str | os.PathLike) -> Path:
    if isinstance(data, (str, os.PathLike)):
        return Path(data)
    data = list(data)
    if len(data) != 1:
        raise ValueError(f"one CT per call, got {len(data)} paths")
    return Path(data[0])


def _meta(affine_ras: np.ndarray, shape: Sequence[int]) -> dict[str, Any]:
    return {
        "affine": affine_ras.copy(),
        "original_affine": affine_ras.copy(),
        "spatial_shape": np.asarray(shape),
        "original_channel_dim": "no_channel",
        "space": "RAS",
    }


def _ras_flips(affine_ras: np.ndarray, shape: Sequence[int], allowed: Sequence[int] = (0, 1, 2)
               ) -> tuple[tuple[int, ...], np.ndarray]:
    """Axes to flip so that each voxel axis points along +R/+A/+S of its dominant world axis, and
    the affine after those flips. Flipping while the data is copied anyway (int -> float32) saves
    the extra full-volume copy that ``Orientation("RAS")`` would make later."""
    aff = affine_ras.copy()
    axes = []
    for i in allowed:
        j = int(np.argmax(np.abs(aff[:3, i])))
        if aff[j, i] < 0:
            axes.append(i)
            aff[:3, 3] += aff[:3, i] * (shape[i] - 1)
            aff[:3, i] = -aff[:3, i]
    return tuple(axes), aff


def _flipped(arr: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    return arr[tuple(slice(None, None, -1) if i in axes else slice(None) for i in range(arr.ndim))]


# --------------------------------------------------------------------------------------------
# SimpleITK: NIfTI, MetaImage, NRRD
# --------------------------------------------------------------------------------------------
class SimpleITKReader(ImageReader):
    """MONAI ``ImageReader`` backed by SimpleITK for NIfTI, MHD/MHA and NRRD volumes.

    ``get_data`` returns the voxel array as ``(X, Y, Z)`` float32 and a meta dict whose ``affine``
    is RAS (SimpleITK reports LPS; we negate the first two rows).
    """

    def verify_suffix(self, filename: Sequence[str | os.PathLike] | str | os.PathLike) -> bool:
        names = [filename] if isinstance(filename, (str, os.PathLike)) else list(filename)
        return all(str(n).lower().endswith(ITK_SUFFIXES) for n in names)

    def read(self, data: Sequence[str | os.PathLike] | str | os.PathLike, **kwargs):
        path = _single(data)
        if not path.is_file():
            raise DataError("image file not found", file=path, fix="check the path in the datalist")
        try:
            return sitk.ReadImage(str(path))
        except RuntimeError as exc:  # SimpleITK raises RuntimeError for unreadable files
            first = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else "unreadable"
            raise DataError(f"cannot read image ({first})", file=path,
                            fix="re-export the file or remove it from the datalist") from None

    def get_data(self, img) -> tuple[np.ndarray, dict]:
        if img.GetDimension() != 3 or img.GetNumberOfComponentsPerPixel() != 1:
            raise DataError(f"expected a 3D scalar CT volume, got {img.GetDimension()}D with "
                            f"{img.GetNumberOfComponentsPerPixel()} component(s)",
                            fix="provide a single 3D CT volume")
        zyx = sitk.GetArrayViewFromImage(img)  # (Z, Y, X) view of the ITK buffer, no copy
        direction = np.asarray(img.GetDirection(), dtype=np.float64).reshape(3, 3)
        affine = np.eye(4)
        affine[:3, :3] = direction @ np.diag(img.GetSpacing())
        affine[:3, 3] = img.GetOrigin()
        axes, affine = _ras_flips(_LPS_TO_RAS @ affine, zyx.shape[::-1])
        # the one copy: int -> float32 in memory order (streaming), flips included; the (X, Y, Z)
        # result is a transposed (Fortran-ordered) view of it
        out = np.empty(zyx.shape, dtype=np.float32)
        src = _flipped(zyx, [2 - a for a in axes])

        def copy(a: int, b: int) -> None:  # in slabs of slices on the process's threads
            out[a:b] = src[a:b]

        map_slabs(copy, len(out))
        arr = out.transpose(2, 1, 0)
        meta = _meta(affine, arr.shape)
        meta[SERIES_INFO] = {"format": "itk"}
        return arr, meta


# --------------------------------------------------------------------------------------------
# DICOM series via pydicom
# --------------------------------------------------------------------------------------------
def is_dicom_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder (assumed to hold a DICOM series)."""
    return Path(path).is_dir()


def _header(path: Path):
    try:
        return pydicom.dcmread(path)  # one read per file: the pixel bytes stay (undecoded) in memory
    except InvalidDicomError:
        if path.suffix.lower() == ".dcm":
            raise DataError("not a readable DICOM file", file=path,
                            fix="re-export the series or delete the corrupt file") from None
        return None  # a stray non-DICOM file (README, DICOMDIR index, ...)
    except Exception as exc:  # truncated header etc.
        raise DataError(f"corrupt DICOM header ({type(exc).__name__})", file=path,
                        fix="re-export the series or delete the corrupt file") from None


class _Image(NamedTuple):
    """One image of a series: its file, its header (the file's, or one frame's), the dataset holding its
    pixels, and the frame (None for a single-frame file)."""

    path: Path
    ds: Any
    source: Any
    frame: int | None


def _images(path: Path, ds) -> list[_Image]:
    if is_multiframe_ct(ds):  # an enhanced CT: one header per frame (dicom_objects.frame_headers)
        return [_Image(path, h, ds, i) for i, h in enumerate(frame_headers(ds))]
    return [_Image(path, ds, ds, None)]


def _series_label(number, kind: str, n: int, unit: str = "file") -> str:
    num = f"#{number} " if number not in (None, "") else ""
    return f"{num}{kind} ({n} {unit}{'s' if n != 1 else ''})"


def _float_tag(ds, name: str) -> float | None:
    try:
        v = getattr(ds, name, None)
        return None if v in (None, "") else float(v)
    except (TypeError, ValueError):
        return None


def read_dicom_series(folder: str | os.PathLike, allow_gaps: bool = False, gap_factor: float = 1.5,
                      uneven_tol: float = 0.05, series_uid: str | None = None) -> DicomVolume:
    """Read the main axial CT series of ``folder``.

    Args:
        folder: a folder holding one or more DICOM series (searched recursively).
        allow_gaps: when False, a missing slice raises :class:`DataError`; when True the gap is
            filled by linear interpolation.
        gap_factor: a step larger than ``gap_factor`` x the median step counts as a gap.
        uneven_tol: relative deviation of the steps above which the slices are resampled onto a
            uniform grid at the median step.
        series_uid: read this series (its ``SeriesInstanceUID``) instead of the axial CT series
            with the most slices.

    Returns:
        :class:`DicomVolume` ``(array (X, Y, Z) float32 HU, affine 4x4 RAS in mm, info)``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError("DICOM folder not found", file=folder, fix="check the path in the datalist")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    series: dict[str, list[_Image]] = defaultdict(list)
    found: dict[str, list] = defaultdict(list)  # every DICOM series, usable or not: (kind, number, is a frame)
    n_other = 0
    for f in files:
        ds = _header(f)
        if ds is None:
            n_other += 1
            continue
        if "PixelData" not in ds and is_ct_image(ds):
            raise DataError("truncated CT image file (no pixel data)", file=f,
                            fix="re-export the series or delete the truncated file")
        uid = str(getattr(ds, "SeriesInstanceUID", ""))
        for image in _images(f, ds):
            what = kind(image.ds)
            found[uid].append((what, getattr(ds, "SeriesNumber", None), image.frame is not None))
            if not what.usable:
                continue
            key = uid + "|" + "x".join(f"{v:.4f}" for v in np.asarray(image.ds.ImageOrientationPatient, float)) + \
                f"|{image.ds.Rows}x{image.ds.Columns}"
            series[key].append(image)
    kinds = {uid: series_kind([k for k, _, _ in v]) for uid, v in found.items()}
    listing = "; ".join(_series_label(v[0][1], kinds[uid].what, len(v), "frame" if v[0][2] else "file")
                        for uid, v in found.items())
    listing = (listing or "no DICOM files") + (f"; {n_other} non-DICOM file(s)" if n_other else "")
    if series_uid is not None:
        chosen = [kv for kv in series.items() if kv[0].split("|", 1)[0] == str(series_uid)]
        if not chosen:
            named = kinds.get(str(series_uid))
            raise DataError(
                ("the requested series is not an axial CT series: it is a " + named.what) if named else
                "the requested series_uid is not in the folder", file=folder, field="series_uid",
                fix=f"the folder holds: {listing}; name an axial CT series, or leave series_uid out")
    else:
        chosen = list(series.items())
    if not chosen:
        # named by what the folder's largest series is (a localizer, a screen capture, a reformat, ...)
        main = kinds[max(found, key=lambda u: len(found[u]))] if found else None
        raise DataError(f"no axial CT series found; the folder holds: {listing}", file=folder,
                        field=(main.field or None) if main else None,
                        fix=(main.fix if main and main.fix else
                             "point the datalist at the folder of the axial CT series"))

    def rank(members: list[_Image]) -> tuple:
        """Projections (MIP, MinIP) last, then the most slices, the thinnest, an ORIGINAL image."""
        ds = members[0].ds
        image_type = [str(v).upper() for v in (getattr(ds, "ImageType", None) or [])]
        return (not is_projection(image_type), len(members), -(_float_tag(ds, "SliceThickness") or 0.0),
                image_type[:1] == ["ORIGINAL"])

    key, members = max(chosen, key=lambda kv: rank(kv[1]))
    if len(found) > 1 or len(chosen) > 1:
        n = getattr(members[0].ds, "SeriesNumber", None)
        log.info("DICOM folder with %d series (%s): read %s%s", len(found), listing,
                 _series_label(n, "axial CT", len(members), "frame" if members[0].frame is not None else "file"),
                 " (named by series_uid)" if series_uid is not None else " (the axial CT series with the most slices)")
    if len(members) < 2:
        raise DataError("the CT series has a single slice; a 3D volume needs at least 2", file=folder,
                        fix="export the whole series")

    ds0 = members[0].ds
    iop = np.asarray(ds0.ImageOrientationPatient, dtype=np.float64)
    row_cos, col_cos = iop[:3], iop[3:]
    normal = np.cross(row_cos, col_cos)
    positions = np.array([np.asarray(m.ds.ImagePositionPatient, float) for m in members])
    proj = positions @ normal
    order = np.lexsort((np.array([int(getattr(m.ds, "InstanceNumber", 0) or 0) for m in members]), proj))
    proj = proj[order]
    keep = np.concatenate([[True], np.diff(proj) > 1e-3])
    if not keep.all():
        log.warning("%d duplicated slice position(s) in the series; keeping the first of each", (~keep).sum())
    n_dup = int((~keep).sum())
    order, proj = order[keep], proj[keep]
    members = [members[i] for i in order]
    if len(members) < 2:
        raise DataError("every slice of the CT series sits at the same position; a 3D volume needs at least 2",
                        file=folder, field="ImagePositionPatient", fix="export the whole series")
    steps = np.diff(proj)
    step = float(np.median(steps))
    gaps = np.flatnonzero(steps > gap_factor * step)
    if gaps.size and not allow_gaps:
        z = proj[gaps[0]]
        raise DataError(f"missing slice(s): the positions jump by {steps[gaps[0]]:.2f} mm at {z:.2f} mm "
                        f"along the slice normal (usual step {step:.2f} mm)", file=folder, field="ImagePositionPatient",
                        fix="re-export the complete series, or pass allow_gaps=True to interpolate across the gap")

    rows, cols = int(ds0.Rows), int(ds0.Columns)
    dr, dc = (float(v) for v in ds0.PixelSpacing)  # (between rows, between columns)
    affine = np.eye(4)
    affine[:3, 0] = row_cos * dc
    affine[:3, 1] = col_cos * dr
    affine[:3, 2] = normal * step
    affine[:3, 3] = positions[order[0]]
    shape = (cols, rows, len(members))  # (X = column index, Y = row index, Z = sorted slice)
    # in-plane flips towards RAS happen while the slices are written (no extra copy later); the
    # slice axis keeps the sorted order (increasing along the normal)
    axes, affine_ras = _ras_flips(_LPS_TO_RAS @ affine, shape, allowed=(0, 1))
    zyx = np.empty(shape[::-1], dtype=np.float32)  # slices written contiguously ...
    target = _flipped(zyx, [2 - a for a in axes])
    for k, image in enumerate(members):
        target[k] = _slice_hu(image, rows, cols)
    vol = zyx.transpose(2, 1, 0)  # ... and seen as (X, Y, Z) without a copy
    uneven = bool(gaps.size) or (steps.max() - steps.min()) > uneven_tol * step
    if uneven:
        grid = proj[0] + step * np.arange(int(round((proj[-1] - proj[0]) / step)) + 1)
        vol = _resample_z(vol, proj, grid)
        log.info("uneven slice spacing (%.3f-%.3f mm): resampled to %.3f mm", steps.min(), steps.max(), step)
    info = {
        "format": "dicom",
        "modality": str(getattr(ds0, "Modality", "") or ""),
        "image_type": [str(v) for v in (getattr(ds0, "ImageType", None) or [])],
        "slice_thickness_mm": _float_tag(ds0, "SliceThickness"),
        "n_files": len(members) + n_dup,  # images: slices, or an enhanced CT's frames
        "multiframe": members[0].frame is not None,
        "n_series_in_folder": len(found),
        "step_min_mm": float(steps.min()), "step_median_mm": step, "step_max_mm": float(steps.max()),
        "n_gaps": int(gaps.size), "n_duplicates": n_dup, "resampled": bool(uneven),
    }
    return DicomVolume(vol, affine_ras, info)


def _slice_hu(image: _Image, rows: int, cols: int) -> np.ndarray:
    path, ds = image.path, image.ds  # the rescale is the slice's, or the frame's (its functional groups)
    try:
        if "PixelData" not in image.source:
            raise ValueError("no pixel data")
        pix = image.source.pixel_array if image.frame is None else pixel_array(image.source, index=image.frame)
    except Exception as exc:
        raise DataError(f"cannot decode pixel data ({type(exc).__name__}: {str(exc)[:120]})", file=path,
                        fix="the file is truncated or corrupt: re-export the series or delete the file") from None
    if pix.shape != (rows, cols):
        raise DataError(f"slice shape {pix.shape} differs from the series' {(rows, cols)}", file=path,
                        fix="re-export the series")
    slope = float(getattr(ds, "RescaleSlope", 1) or 1)
    intercept = float(getattr(ds, "RescaleIntercept", 0) or 0)
    out = pix.astype(np.float32)
    if slope != 1:
        out *= slope
    if intercept:
        out += intercept
    return out


def _resample_z(vol: np.ndarray, z: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Linear interpolation along the last axis from positions ``z`` to ``target`` (vectorised)."""
    idx = np.clip(np.searchsorted(z, target, side="right") - 1, 0, len(z) - 2)
    w = ((target - z[idx]) / (z[idx + 1] - z[idx])).astype(np.float32)
    w = np.clip(w, 0.0, 1.0)
    return vol[:, :, idx] * (1 - w) + vol[:, :, idx + 1] * w


class DicomSeriesReader(ImageReader):
    """MONAI ``ImageReader`` for a DICOM series folder (pydicom); see the module docstring.

    Args:
        allow_gaps: interpolate across missing slices instead of raising :class:`DataError`.
        series_uid: read this series instead of the axial CT series with the most slices.
    """

    def __init__(self, allow_gaps: bool = False, series_uid: str | None = None) -> None:
        self.allow_gaps = allow_gaps
        self.series_uid = series_uid

    def verify_suffix(self, filename: Sequence[str | os.PathLike] | str | os.PathLike) -> bool:
        names = [filename] if isinstance(filename, (str, os.PathLike)) else list(filename)
        return all(Path(n).is_dir() for n in names)

    def read(self, data: Sequence[str | os.PathLike] | str | os.PathLike, **kwargs):
        return read_dicom_series(_single(data), allow_gaps=kwargs.get("allow_gaps", self.allow_gaps),
                                 series_uid=kwargs.get("series_uid", self.series_uid))

    def get_data(self, img) -> tuple[np.ndarray, dict]:
        vol, affine, info = img
        meta = _meta(affine, vol.shape)
        meta[SERIES_INFO] = dict(info)
        return vol, meta


# --------------------------------------------------------------------------------------------
def reader_for(path: str | os.PathLike, allow_gaps: bool = False, series_uid: str | None = None) -> ImageReader:
    """The reader for ``path``: a folder is a DICOM series, a known suffix goes to SimpleITK."""
    p = Path(path)
    if p.is_dir():
        return DicomSeriesReader(allow_gaps=allow_gaps, series_uid=series_uid)
    if str(p).lower().endswith(ITK_SUFFIXES):
        if not p.exists():
            raise DataError("image file not found", file=p, fix="check the path in the datalist")
        return SimpleITKReader()
    if not p.exists():
        raise DataError("image not found", file=p, fix="check the path in the datalist")
    raise DataError(f"unsupported image type '{p.suffix or p.name}'", file=p,
                    fix="use a DICOM series folder, NIfTI (.nii/.nii.gz), MHD/MHA or NRRD")


def load_ct(path: str | os.PathLike, allow_gaps: bool = False, series_uid: str | None = None) -> MetaTensor:
    """Load a chest CT as a ``(1, X, Y, Z)`` float32 MetaTensor of HU, RAS, affine in mm.

    Args:
        path: a DICOM series folder, or a NIfTI / MHD / MHA / NRRD file.
        allow_gaps: DICOM only: interpolate across missing slices instead of raising.
        series_uid: DICOM only: the ``SeriesInstanceUID`` to read when the folder holds several
            series (default: the axial CT series with the most slices).

    Raises:
        DataError: missing path, unsupported type, unreadable/corrupt file (named), no axial CT
            series (listing what the folder holds), a ``series_uid`` that is not an axial CT series
            of the folder, or a slice gap when ``allow_gaps`` is False.
    """
    if series_uid is not None and not Path(path).is_dir():
        raise DataError("series_uid applies to a DICOM folder only", file=path, field="series_uid",
                        fix="leave series_uid empty for NIfTI/MHD/NRRD files")
    reader = reader_for(path, allow_gaps=allow_gaps, series_uid=series_uid)
    # What MONAI's LoadImage(reader, ensure_channel_first=True) does, minus its np.ascontiguousarray:
    # the readers hand out (X, Y, Z) as a transposed view of slice-contiguous memory, and a full
    # 3D transposing copy costs more than everything else here (~1.5 s for 512x512x300).
    # Downstream transforms accept strided tensors; the crop is made contiguous later.
    try:
        arr, meta = reader.get_data(reader.read(str(path)))
    except DataError as exc:
        if exc.file is not None:
            raise
        raise DataError(exc.message, file=path, field=exc.field, row=exc.row, fix=exc.fix) from None
    meta = dict(meta)
    affine = torch.as_tensor(meta.pop("affine"), dtype=torch.float64)
    meta["filename_or_obj"] = str(path)
    img = MetaTensor(torch.from_numpy(np.asarray(arr, dtype=np.float32))[None], affine=affine, meta=meta)
    # MONAI types Orientation's result as a Tensor; a MetaTensor in gives a MetaTensor out
    return cast(MetaTensor, Orientation(axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S")))(img))
