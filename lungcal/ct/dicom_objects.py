"""What a DICOM object holds, judged by its content, and the frames of an enhanced multi-frame CT.

:func:`kind` says what one image is, in words, from what it holds: CT pixels (the SOP class or
``Modality``), grey levels (``PhotometricInterpretation``, ``SamplesPerPixel``, no
``BurnedInAnnotation``), a localizer or not (``ImageType``), and axial geometry
(``ImageOrientationPatient``). Only an image of kind :data:`AXIAL_CT` can be part of the volume
:func:`lungcal.ct.io.read_dicom_series` reads; every other kind names what it is, the DICOM attribute
that tells, and the fix:

========================================  ===================================  ==========================
what                                       told by                              kind
========================================  ===================================  ==========================
a structured report (e.g. a dose report)   SOP class 1.2.840.10008.5.1.4.1.1.88*  ``SR structured report``
a screen capture                           Secondary Capture SOP classes (..1.7*),  ``... secondary capture``,
                                           colour pixels (RGB, YBR, palette),    ``... colour image``,
                                           ``BurnedInAnnotation`` YES            ``... burned-in annotation``
another modality (MR, PT, RTSTRUCT, ...)   ``Modality``                         ``MR (not CT)``
a localizer (scout, topogram)              ``ImageType`` LOCALIZER / SCOUT       ``CT localizer (scout)``
a coronal, sagittal or oblique reformat    ``ImageOrientationPatient``          ``CT coronal reformat ...``
an axial CT slice                          all of the above                     ``axial CT``
========================================  ===================================  ==========================

``ImageType`` value 1 (ORIGINAL / DERIVED) and value 2 (PRIMARY / SECONDARY) do not decide here:
a PACS or planning-system re-export of a diagnostic CT is ``ORIGINAL\\SECONDARY\\AXIAL``, and its
pixels are the scan's own Hounsfield units. Whether a derived image is acceptable is the series
check's call (:func:`lungcal.ct.qc_checks.check_series_type`, the ``derived`` setting), and whether
the values are Hounsfield units is the ``hu_air`` check's. A series of at most
:data:`MAX_SCOUT_IMAGES` non-axial images is a localizer too (a topogram exported without the
LOCALIZER value): :func:`series_kind`.

An **enhanced (multi-frame) CT** (Enhanced CT Image Storage ``1.2.840.10008.5.1.4.1.1.2.1``, or the
Legacy Converted Enhanced CT ``.2.2``) holds a whole series in one file: :func:`frame_headers` turns
its per-frame functional groups (plane position and orientation, pixel measures, rescale, frame type;
a group missing from a frame is taken from the shared groups) into one header per frame, which is
judged like a single-frame slice. A file whose frames lack that geometry is refused by name
(``enhanced multi-frame CT without per-frame geometry``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from pydicom.dataset import Dataset

__all__ = ["AXIAL_CT", "CT_IMAGE_STORAGE", "ENHANCED_CT_STORAGE", "PROJECTION_IMAGE_TYPES", "EXCLUDED_IMAGE_TYPES",
           "MAX_SCOUT_IMAGES", "Kind", "sop_class", "is_ct_image", "is_multiframe_ct", "plane", "kind",
           "series_kind", "frame_headers", "is_projection"]

#: the kind of an image that can be a slice of the volume read
AXIAL_CT = "axial CT"
CT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.2"
ENHANCED_CT_STORAGE = ("1.2.840.10008.5.1.4.1.1.2.1", "1.2.840.10008.5.1.4.1.1.2.2")  # + legacy converted
_SECONDARY_CAPTURE = "1.2.840.10008.5.1.4.1.1.7"
_STRUCTURED_REPORT = "1.2.840.10008.5.1.4.1.1.88"
_GREY = ("MONOCHROME1", "MONOCHROME2")
#: ImageType values of a projection through the volume (its pixels are not one slice's HU)
PROJECTION_IMAGE_TYPES = {"MIP": "a maximum-intensity projection", "MINIP": "a minimum-intensity projection",
                          "PROJECTION IMAGE": "a projection image"}
#: ImageType values the series checks refuse, with what each is
EXCLUDED_IMAGE_TYPES = {"LOCALIZER": "a localizer (scout)", "SCOUT": "a scout", **PROJECTION_IMAGE_TYPES}
#: a series of at most this many non-axial images is a localizer (a topogram: one AP, one lateral)
MAX_SCOUT_IMAGES = 3
_EXPORT_AXIAL = "export the scan's axial CT series (the reconstruction itself) and point at its folder"
_CONVERT = ("convert it to single-frame slices or NIfTI (e.g. `dcm2niix -z y FOLDER`) and point at the result, "
            "or export the series as single-frame CT Image Storage")


class Kind(NamedTuple):
    """What a DICOM image is (``what``, in words; :data:`AXIAL_CT` for a usable slice), the attribute
    that tells (``field``) and what to do instead (``fix``)."""

    what: str
    field: str = ""
    fix: str = ""

    @property
    def usable(self) -> bool:
        """True for a slice of an axial CT series."""
        return self.what == AXIAL_CT


def sop_class(ds: Any) -> str:
    """The SOP class UID of ``ds`` (from the dataset, else its file meta)."""
    meta = getattr(ds, "file_meta", None)
    return str(getattr(ds, "SOPClassUID", "") or getattr(meta, "MediaStorageSOPClassUID", "") or "")


def is_ct_image(ds: Any) -> bool:
    """A CT image object: a CT Image Storage SOP class (single- or multi-frame), or ``Modality`` CT."""
    sop = sop_class(ds)
    return sop == CT_IMAGE_STORAGE or sop.startswith(CT_IMAGE_STORAGE + ".") or \
        str(getattr(ds, "Modality", "")).upper() == "CT"


def is_multiframe_ct(ds: Any) -> bool:
    """An enhanced (or legacy converted enhanced) multi-frame CT object."""
    return sop_class(ds) in ENHANCED_CT_STORAGE


def is_projection(image_type: Sequence[str]) -> bool:
    """True when the ImageType values name a projection (MIP, MinIP, projection image)."""
    return any(str(v).upper() in PROJECTION_IMAGE_TYPES for v in image_type)


def plane(orientation: Sequence[float]) -> str:
    """``axial``, ``coronal``, ``sagittal`` or ``oblique`` from ImageOrientationPatient (row and column
    cosines): the plane whose normal lies within about 37 degrees of the slice normal (a tilted gantry
    is still axial)."""
    iop = np.asarray(orientation, dtype=np.float64)
    normal = np.cross(iop[:3], iop[3:])
    norm = float(np.linalg.norm(normal))
    if not np.isfinite(norm) or norm == 0:
        return "oblique"
    axis = int(np.argmax(np.abs(normal)))
    if abs(normal[axis]) < 0.8 * norm:
        return "oblique"
    return ("sagittal", "coronal", "axial")[axis]


def _image_type(ds: Any) -> set[str]:
    return {str(v).upper().strip() for v in (getattr(ds, "ImageType", None) or [])}


def kind(ds: Any) -> Kind:
    """What the DICOM image ``ds`` (a slice, or one frame's header from :func:`frame_headers`) is; see the
    module docstring."""
    sop = sop_class(ds)
    ct_sop = sop == CT_IMAGE_STORAGE or sop.startswith(CT_IMAGE_STORAGE + ".")
    # a missing Modality is tolerated (the SOP class, else CT); a Modality that says otherwise decides
    modality = str(getattr(ds, "Modality", "") or ("CT" if ct_sop or not sop else "")).upper()
    prefix = f"{modality} " if modality else ""
    if modality == "SR" or sop.startswith(_STRUCTURED_REPORT):
        return Kind(f"{prefix}structured report (e.g. a dose report)", "SOPClassUID", _EXPORT_AXIAL)
    if sop.startswith(_SECONDARY_CAPTURE):
        return Kind(f"{prefix}secondary capture (a screen capture)", "SOPClassUID",
                    "a screen capture holds display grey levels, not Hounsfield units: " + _EXPORT_AXIAL)
    if modality != "CT":
        return Kind(f"{modality} (not CT)" if modality else f"SOP class {sop} (not CT)", "Modality", _EXPORT_AXIAL)
    photometric = str(getattr(ds, "PhotometricInterpretation", "") or "").upper()
    samples = int(getattr(ds, "SamplesPerPixel", 1) or 1)
    if (photometric and photometric not in _GREY) or samples > 1:
        return Kind(f"CT colour image ({photometric or f'{samples} samples per pixel'}: a screen capture)",
                    "PhotometricInterpretation",
                    "a colour image holds display colours, not Hounsfield units: " + _EXPORT_AXIAL)
    if str(getattr(ds, "BurnedInAnnotation", "") or "").upper() == "YES":
        return Kind("CT image with burned-in annotation (a screen capture)", "BurnedInAnnotation",
                    "text burned into the pixels is not anatomy: " + _EXPORT_AXIAL)
    if _image_type(ds) & {"LOCALIZER", "SCOUT"}:
        return Kind("CT localizer (scout)", "ImageType",
                    "a localizer is the planning projection, not the scan: " + _EXPORT_AXIAL)
    multiframe = sop in ENHANCED_CT_STORAGE
    if getattr(ds, "ImagePositionPatient", None) is None or getattr(ds, "ImageOrientationPatient", None) is None:
        if multiframe:
            return Kind("enhanced multi-frame CT without per-frame geometry", "PerFrameFunctionalGroupsSequence",
                        _CONVERT)
        return Kind("CT without slice geometry", "ImagePositionPatient", "re-export the series with its geometry tags")
    if getattr(ds, "PixelSpacing", None) is None or "Rows" not in ds:
        if multiframe:
            return Kind("enhanced multi-frame CT without pixel measures", "PixelMeasuresSequence", _CONVERT)
        return Kind("CT without pixel spacing", "PixelSpacing", "re-export the series with its geometry tags")
    where = plane(ds.ImageOrientationPatient)
    if where != "axial":
        return Kind(f"CT {where} reformat (not axial)", "ImageOrientationPatient", _EXPORT_AXIAL)
    return Kind(AXIAL_CT)


def series_kind(kinds: Sequence[Kind]) -> Kind:
    """What a series is, from its images' kinds: the most common kind; a series of at most
    :data:`MAX_SCOUT_IMAGES` non-axial images is a localizer (a topogram exported without the LOCALIZER
    ImageType value)."""
    if not kinds:
        return Kind("empty series")
    top = Counter(kinds).most_common(1)[0][0]
    if top.field == "ImageOrientationPatient" and len(kinds) <= MAX_SCOUT_IMAGES:
        where = top.what.split()[1]
        return Kind(f"CT localizer (scout: {len(kinds)} {where} projection image{'s' if len(kinds) > 1 else ''})",
                    "ImageOrientationPatient", "a localizer is the planning projection, not the scan: " + _EXPORT_AXIAL)
    return top


_PER_FRAME = {  # functional group -> the attributes it gives each frame's header
    "PlanePositionSequence": ("ImagePositionPatient",),
    "PlaneOrientationSequence": ("ImageOrientationPatient",),
    "PixelMeasuresSequence": ("PixelSpacing", "SliceThickness"),
    "PixelValueTransformationSequence": ("RescaleSlope", "RescaleIntercept"),
    "CTImageFrameTypeSequence": ("FrameType",),
}
_FROM_TOP = ("SOPClassUID", "Modality", "SeriesInstanceUID", "SeriesNumber", "Rows", "Columns",
             "PhotometricInterpretation", "SamplesPerPixel", "BurnedInAnnotation", "ImageType", "SliceThickness",
             "RescaleSlope", "RescaleIntercept")


def _group(frame: Dataset | None, shared: Dataset | None, name: str) -> Dataset | None:
    for source in (frame, shared):
        seq = None if source is None else source.get(name)
        if seq:
            return seq[0]
    return None


def frame_headers(ds: Dataset) -> list[Dataset]:
    """One header per frame of an enhanced multi-frame CT ``ds``: the top-level attributes a slice needs
    (SOP class, modality, series, rows and columns, photometric interpretation, image type) and, from
    its per-frame functional groups (else the shared ones), ``ImagePositionPatient``,
    ``ImageOrientationPatient``, ``PixelSpacing``, ``SliceThickness``, ``RescaleSlope`` /
    ``RescaleIntercept`` and ``ImageType`` (the frame's ``FrameType``). ``InstanceNumber`` is the frame's
    number (from 1). A header lacks what the file does not give; :func:`kind` then names it."""
    n = int(getattr(ds, "NumberOfFrames", 1) or 1)
    per = ds.get("PerFrameFunctionalGroupsSequence") or []
    shared_seq = ds.get("SharedFunctionalGroupsSequence") or []
    shared = shared_seq[0] if len(shared_seq) else None
    out = []
    for i in range(n):
        frame = per[i] if i < len(per) else None
        h = Dataset()
        for kw in _FROM_TOP:
            if kw in ds:
                setattr(h, kw, ds[kw].value)
        for group, keywords in _PER_FRAME.items():
            item = _group(frame, shared, group)
            if item is None:
                continue
            for kw in keywords:
                if kw in item:
                    setattr(h, kw, item[kw].value)
        if "FrameType" in h:
            h.ImageType = h.FrameType
            del h.FrameType
        h.InstanceNumber = i + 1
        out.append(h)
    return out
