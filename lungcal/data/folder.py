"""What a path a user points at holds: the CT images in it, and every other file with why it is skipped.

:func:`find_cts` is how ``lungcal predict``, ``lungcal qc`` and ``lungcal site-check`` read a CT file or
a folder (one function, so all see the same CTs in the same order, hence the same pseudonyms
``ct0000``...):

- a **DICOM series folder** (DICOM files directly in it: ``*.dcm``, or files with the ``DICM``
  preamble) is one CT; the other files directly in it are listed as skipped (the reader,
  :func:`lungcal.ct.io.read_dicom_series`, picks the axial CT series among its DICOM files);
- a **volume file** (NIfTI, MHD/MHA, NRRD) is one CT, unless its voxels are not a CT image
  (:func:`image_kind`: a binary mask, a label map, values that are not Hounsfield units): then a
  :class:`~lungcal.errors.DataError` naming the file says what it is;
- **any other folder** (a case folder as exported, with the CT, a nodule mask, annotation XML and
  CSVs; a folder of case folders; a folder of studies) is read entry by entry, in sorted order
  (hidden entries ignored), and a sub-folder without DICOM files is read the same way, at any depth,
  so a folder of case folders gives each case's CT whatever format the case holds:

  ==========================================  ==============================================
  entry                                       read as
  ==========================================  ==============================================
  a volume file that is a CT image             one CT
  a volume file that is not (mask, labels)     skipped, named as such (:func:`image_kind`)
  a sub-folder with DICOM files (any depth)    one CT: a DICOM series folder, read recursively
  any other sub-folder (a case folder)         read by these rules; its entries are named
                                               ``case/entry``; one that holds no CT is skipped
                                               as one entry ("no CT in it (...)")
  any other file (XML, CSV, PDF, PNG, ...)     skipped ("not a CT image")
  ==========================================  ==============================================

  A folder holding no CT at all is a ``DataError`` listing what it holds.

:func:`case_ct` is the same rule for a path that must name one CT (a datalist or site-CSV row's
``image``, an NLST study folder): a case folder holding one CT gives that CT.

A CT found here can still be refused later (unreadable, too small, a failed series check); that
is decided by the reader and the checks, one CT at a time, never for the whole folder.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import numpy as np
import pydicom
import SimpleITK as sitk

from lungcal.errors import DataError

__all__ = ["CT_SUFFIXES", "MAX_LABELS", "Found", "find_cts", "case_ct", "image_kind", "is_dicom_file",
           "is_dicom_folder", "holds_dicom", "dicom_study_date"]

#: the volume file types lungcal reads (DICOM comes as a folder)
CT_SUFFIXES = (".nii", ".nii.gz", ".mha", ".mhd", ".nrrd", ".nhdr")
#: a volume with at most this many distinct values, none negative, is a mask or a label map
MAX_LABELS = 16
#: a volume whose values span less than this is not in Hounsfield units (air -1000, tissue 0-100)
MIN_HU_RANGE = 200.0
_FIX = ("point at a CT file (NIfTI/MHD/NRRD), a DICOM series folder, or a folder holding them "
        "(one CT file or DICOM folder each)")


@dataclass
class Found:
    """What :func:`find_cts` found: the CTs (files or DICOM folders, in order) and the skipped entries
    as ``(name, why)``, ``name`` relative to the folder (a sub-folder ends with ``/``)."""

    cts: list[Path] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def skipped_lines(self) -> list[str]:
        """``skipped NAME: why`` per skipped entry."""
        return [f"skipped {name}: {why}" for name, why in self.skipped]


def is_dicom_file(p: Path) -> bool:
    """A ``.dcm`` file, or a file without a suffix that starts with the DICOM preamble."""
    if p.suffix.lower() == ".dcm":
        return True
    if p.suffix:  # a named file type that is not DICOM (e.g. .json, .txt, .nii)
        return False
    try:
        with open(p, "rb") as fh:
            fh.seek(128)
            return fh.read(4) == b"DICM"
    except OSError:
        return False


def _visible(folder: Path) -> Iterator[Path]:
    return (p for p in folder.iterdir() if not p.name.startswith("."))


def is_dicom_folder(path: str | os.PathLike) -> bool:
    """True when the folder holds DICOM files itself (one series: one study), not only sub-folders."""
    return any(p.is_file() and is_dicom_file(p) for p in _visible(Path(path)))


def holds_dicom(path: str | os.PathLike) -> bool:
    """True when a DICOM file lies anywhere under the folder (stops at the first)."""
    for root, dirs, files in os.walk(str(path)):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(not f.startswith(".") and is_dicom_file(Path(root) / f) for f in files):
            return True
    return False


def image_kind(path: str | os.PathLike) -> str | None:
    """Why the volume file ``path`` is not a CT image, or None when it may be one.

    A CT holds air (about -1000 HU) and tissue: many distinct values over more than a thousand HU.
    A volume with at most :data:`MAX_LABELS` distinct values, none negative, is a binary mask or a
    label map (a nodule mask stores 0/1, or the number of readers per voxel); one whose values span
    less than :data:`MIN_HU_RANGE` is not in Hounsfield units (a normalised image, a probability
    map). The values are read on a grid of at most about 64 points per axis. A file that cannot be
    read here is left to the reader (None), which refuses it with its own reason.
    """
    try:
        img = sitk.ReadImage(str(path))
    except RuntimeError:
        return None
    if img.GetNumberOfComponentsPerPixel() != 1 or img.GetDimension() < 2:
        return None
    arr = sitk.GetArrayViewFromImage(img)
    sample = np.asarray(arr[tuple(slice(None, None, max(1, n // 64)) for n in arr.shape)])
    if sample.size == 0:
        return None
    values = np.unique(sample)
    if values.size <= MAX_LABELS and float(values[0]) >= 0:
        shown = ", ".join(f"{v:g}" for v in values[:8]) + (", ..." if values.size > 8 else "")
        if values.size == 1:
            what = f"a blank volume (every value {shown})"
        elif values.size == 2 and float(values[0]) == 0:
            what = f"a binary mask (values {shown})"
        else:
            what = f"a label map (values {shown})"
        return f"{what}, not a CT image: a CT holds air at about -1000 HU"
    lo, hi = float(values[0]), float(values[-1])
    if hi - lo < MIN_HU_RANGE:
        return (f"values from {lo:g} to {hi:g} are not Hounsfield units (a CT holds air at about -1000 HU "
                "and tissue at 0-100 HU): a normalised image or a probability map, not a CT image")
    return None


def find_cts(path: str | os.PathLike, field: str | None = None) -> Found:
    """The CTs of ``path`` (a CT file, a DICOM series folder, or a folder holding them) and the skipped
    entries; see the module docstring.

    Raises:
        DataError: the path does not exist, it is a file that is not a CT volume (naming what it is),
            or a folder holding no CT (listing what it holds).
    """
    path = Path(str(path)).expanduser()
    if path.is_dir():
        if is_dicom_folder(path):
            others = sorted(p.name for p in _visible(path) if p.is_file() and not is_dicom_file(p))
            return Found([path.absolute()], [(n, "not a DICOM file") for n in others])
        found = _read_folder(path, "", {os.path.realpath(path)})
        if not found.cts:
            listing = "; ".join(f"{n}: {w}" for n, w in found.skipped) or "nothing"
            raise DataError(f"the folder holds no CT; found {listing}", file=path, field=field,
                            fix="put one NIfTI/MHD/NRRD file or DICOM series folder per CT in it (or one case "
                                "folder per CT holding one)")
        return found
    if not path.exists():
        raise DataError("not found", file=path, field=field, fix=_FIX)
    if not path.name.lower().endswith(CT_SUFFIXES):
        raise DataError(f"not a CT image ({_kind_of(path)})", file=path, field=field, fix=_FIX)
    why = image_kind(path)
    if why is not None:
        raise DataError(why, file=path, field=field, fix="pass the CT image itself, not its mask or annotation")
    return Found([path.absolute()])


def dicom_study_date(path: str | os.PathLike) -> str | None:
    """A DICOM CT's ``StudyDate`` as ``YYYY-MM-DD``: read from the first DICOM file (in name order) of the folder
    ``path`` (or from the file ``path``), its header only (pixels not read); ``None`` for a CT that is not DICOM,
    a header that cannot be read, or a date that is absent or not a valid ``YYYYMMDD``. The date is a patient
    identifier: it is returned, never logged."""
    p = Path(str(path))
    first = None
    if p.is_file() and is_dicom_file(p):
        first = p
    elif p.is_dir():
        for root, dirs, files in os.walk(str(p)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            hit = next((Path(root) / f for f in sorted(files)
                        if not f.startswith(".") and is_dicom_file(Path(root) / f)), None)
            if hit is not None:
                first = hit
                break
    if first is None:
        return None
    try:
        ds = pydicom.dcmread(first, stop_before_pixels=True, specific_tags=["StudyDate"])
        # the raw bytes, not the DA value: converting a malformed date makes pydicom log and warn it, value and all
        raw = ds.get_item("StudyDate")
        value = getattr(raw, "value", None)
        text = (value.decode("ascii", "replace") if isinstance(value, bytes) else str(value or "")).strip()
    except Exception:  # an unreadable header: no date, the series checks say why later
        return None
    if len(text) != 8 or not text.isdigit():
        return None
    try:
        return date(int(text[:4]), int(text[4:6]), int(text[6:])).isoformat()
    except ValueError:
        return None


def case_ct(path: str | os.PathLike, field: str | None = None) -> Path:
    """The one CT that ``path`` names: a CT file or a folder holding DICOM files as it is (the reader
    picks the axial series), and a case folder without DICOM files (a CT volume beside its masks and
    annotations) as the one CT :func:`find_cts` finds in it. A path that does not exist is returned as
    it is (the caller says so, naming its row).

    Raises:
        DataError: a case folder holding no CT (listing what it holds), or several (naming them).
    """
    p = Path(str(path)).expanduser()
    if not p.is_dir() or holds_dicom(p):
        return p
    found = find_cts(p, field=field)
    if len(found.cts) > 1:
        names = ", ".join(str(c.relative_to(p.absolute())) for c in found.cts[:4])
        names += ", ..." if len(found.cts) > 4 else ""
        raise DataError(f"the folder holds {len(found.cts)} CTs ({names}), where one is expected", file=p, field=field,
                        fix="name the CT file or DICOM folder itself")
    return found.cts[0]


def _read_folder(folder: Path, prefix: str, ancestors: set[str]) -> Found:
    """The CTs and skipped entries of a folder that is not a DICOM series folder (module docstring);
    ``prefix`` names its entries relative to the folder the user pointed at."""
    found = Found()
    for p in sorted(_visible(folder)):
        name = prefix + p.name
        if p.is_dir():
            if holds_dicom(p):
                found.cts.append(p.absolute())
                continue
            real = os.path.realpath(p)
            if real in ancestors:  # a link back up the tree
                found.skipped.append((name + "/", "a link to a folder that holds it"))
                continue
            sub = _read_folder(p, name + "/", ancestors | {real})
            if sub.cts:
                found.cts += sub.cts
                found.skipped += sub.skipped
            else:
                found.skipped.append((name + "/", _no_ct(sub)))
        elif p.name.lower().endswith(CT_SUFFIXES):
            why = image_kind(p)
            if why is None:
                found.cts.append(p.absolute())
            else:
                found.skipped.append((name, why))
        elif p.suffix.lower() == ".raw" and p.with_suffix(".mhd").exists():
            continue  # the voxels of an .mhd header beside it
        else:
            found.skipped.append((name, f"not a CT image ({_kind_of(p)})"))
    return found


def _no_ct(sub: Found) -> str:
    """Why a sub-folder holding no CT is skipped, with what it holds (entries by type)."""
    kinds = Counter("folder" if n.endswith("/") else _kind_of(Path(n)) for n, _ in sub.skipped)
    return f"no CT in it ({'holds ' + ', '.join(f'{n} {k}' for k, n in sorted(kinds.items())) if kinds else 'empty'})"


def _kind_of(p: Path) -> str:
    suffix = "".join(p.suffixes[-2:]) if p.name.lower().endswith(".gz") else p.suffix
    return suffix.lower() if suffix else "a file without a type"
