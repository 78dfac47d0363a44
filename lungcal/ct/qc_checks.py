"""The series checks one by one, and their thresholds (:class:`QCConfig`).

Each ``check_*`` function measures one thing and returns a :class:`QCCheck` (verdict, measured
value, reason in plain words, fix); :func:`lungcal.ct.qc.check_series` runs them in order. See
:mod:`lungcal.ct.qc` for the list and docs/hospital.md for why each default is what it is.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lungcal.errors import ConfigError

from .dicom_objects import EXCLUDED_IMAGE_TYPES

__all__ = ["VERDICTS", "CHECKS", "QCConfig", "QCCheck", "beyond_edge", "check_series_type", "check_geometry",
           "check_slice_thickness", "check_slice_positions", "check_hu_air", "check_lung_volume", "check_extent"]

#: verdicts, from best to worst; ``skip`` = not measured (an earlier check failed)
VERDICTS = ("pass", "warn", "fail", "skip")
#: the check names, in the order they run
CHECKS = ("series_type", "geometry", "slice_thickness", "slice_positions", "hu_air", "lung_volume",
          "lung_coverage", "field_of_view")


@dataclass
class QCConfig:
    """Thresholds of the series checks (plain keyword arguments; a bundle's ``qc`` section).

    Args:
        max_slice_thickness_mm: thicker slices fail (3.0 mm: screening protocols reconstruct at
            <= 2.5-3 mm; at 5 mm and more, nodules under about 5 mm vanish).
        warn_slice_thickness_mm: thicker slices warn (2.5 mm).
        min_slices: fewer voxels than this along any axis fail (16): a scout or a single slice.
        min_pixel_mm, max_pixel_mm: in-plane pixel size outside this range fails (0.2-3.0 mm;
            clinical chest CT is 0.5-1.0 mm, the synthetic cohort 2.5 mm).
        air_hu_low, air_hu_high: the air level (the darkest 1% of the scan) passes in this range
            (-1100 to -900 HU).
        air_hu_tolerance: beyond that range by up to this much it warns (100 HU); further it
            fails (an unapplied rescale reads air near 0 or +1000).
        min_lung_ml: a lung mask smaller than this fails (1000 mL: an adult chest CT at any
            breath-hold holds more; an abdomen CT catching the lung bases holds less).
        low_lung_ml: below this it warns (1500 mL).
        high_lung_ml: above this it warns (8500 mL).
        max_lung_ml: above this it fails (12000 mL: larger than any adult lung; the mask has
            leaked into air outside the lungs).
        coverage_warn_pct, coverage_fail_pct: share of the lung estimated beyond the first or
            last slice that warns (2%) or fails (5%): the apex and the bases must be in the scan.
        fov_warn_pct, fov_fail_pct: share of the lung estimated beyond the in-plane edges that
            warns (1%) or fails (20%): a field of view that cuts the lungs a little is reported,
            one that leaves out a fifth of them is refused.
        fit_mm: length of lung towards an edge over which its cross-section is fitted (15 mm).
        max_extrapolation_mm: the lung is extrapolated at most this far beyond an edge (100 mm).
        derived: verdict for a derived image, ImageType value 1 DERIVED (pixels computed from other
            images: an axial reformat, a resampled or filtered copy; a localizer or a projection fails
            anyway): "warn" (default: still CT in HU, scored with a warning) or "fail" to refuse them.
            ImageType value 2 is not judged: SECONDARY only says the image was made after the exam,
            so a PACS or planning-system re-export of the scan's own slices (``ORIGINAL\\SECONDARY``)
            passes, and ``DERIVED\\SECONDARY`` is judged as DERIVED.
    """

    max_slice_thickness_mm: float = 3.0
    warn_slice_thickness_mm: float = 2.5
    min_slices: int = 16
    min_pixel_mm: float = 0.2
    max_pixel_mm: float = 3.0
    air_hu_low: float = -1100.0
    air_hu_high: float = -900.0
    air_hu_tolerance: float = 100.0
    min_lung_ml: float = 1000.0
    low_lung_ml: float = 1500.0
    high_lung_ml: float = 8500.0
    max_lung_ml: float = 12000.0
    coverage_warn_pct: float = 2.0
    coverage_fail_pct: float = 5.0
    fov_warn_pct: float = 1.0
    fov_fail_pct: float = 20.0
    fit_mm: float = 15.0
    max_extrapolation_mm: float = 100.0
    derived: str = "warn"

    def __post_init__(self) -> None:
        if self.derived not in ("warn", "fail"):
            raise ConfigError(f"qc.derived must be 'warn' or 'fail', got {self.derived!r}", field="qc.derived",
                              fix="use warn or fail")
        pairs = [("warn_slice_thickness_mm", "max_slice_thickness_mm"), ("air_hu_low", "air_hu_high"),
                 ("min_lung_ml", "low_lung_ml"), ("low_lung_ml", "high_lung_ml"), ("high_lung_ml", "max_lung_ml"),
                 ("coverage_warn_pct", "coverage_fail_pct"), ("fov_warn_pct", "fov_fail_pct"),
                 ("min_pixel_mm", "max_pixel_mm")]
        for lo, hi in pairs:
            if not getattr(self, lo) <= getattr(self, hi):
                raise ConfigError(f"qc.{lo} ({getattr(self, lo)}) must not exceed qc.{hi} ({getattr(self, hi)})",
                                  field=f"qc.{lo}", fix="order the thresholds")

    @classmethod
    def from_any(cls, config: QCConfig | Mapping[str, Any] | None = None, **overrides: Any) -> QCConfig:
        """A config from a ``QCConfig``, a mapping of its fields (a bundle's ``qc`` section) or None,
        with ``overrides`` on top; unknown keys are a :class:`ConfigError`."""
        base = dataclasses.asdict(config) if isinstance(config, QCConfig) else dict(config or {})
        base.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(base) - names)
        if unknown:
            raise ConfigError(f"unknown qc setting(s) {unknown}", field="qc", fix=f"use only {sorted(names)}")
        return cls(**base)


@dataclass(frozen=True)
class QCCheck:
    """One check's outcome: ``verdict`` in :data:`VERDICTS`, the measured ``value`` (text with its
    unit), ``reason`` (plain words) and, unless it passed, the ``fix``."""

    name: str
    verdict: str
    value: str
    reason: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


def _verdict(value: float, warn_above: float, fail_above: float) -> str:
    return "fail" if value > fail_above else "warn" if value > warn_above else "pass"


def slice_axis(spacing: Any) -> int | None:
    """The through-plane axis of a volume in RAS (0 x, 1 y, 2 z) read from its spacing: the axis whose spacing
    differs from the other two when those two are equal (the square in-plane pixels), else the thickest axis when
    it is clearly thicker (by 20 %), else None (isotropic: cannot tell).

    Equal pixels first, then thickness: a thin-slice axial scan has slices thinner than its pixels (0.625 mm
    slices at 0.78 mm pixels, a 400 mm field of view), and the thickest axis alone would call it sagittal."""
    sp = np.asarray(spacing, float)[:3]
    for axis in (2, 0, 1):
        others = [sp[i] for i in range(3) if i != axis]
        if abs(others[0] - others[1]) <= 0.01 * max(others) and abs(sp[axis] - others[0]) > 0.01 * max(others):
            return axis
    thick = int(np.argmax(sp))
    return thick if sp[thick] > 1.2 * np.min(sp) else None


def check_series_type(info: Mapping[str, Any], spacing: np.ndarray, cfg: QCConfig) -> QCCheck:
    name = "series_type"
    thick_axis = slice_axis(spacing)
    if thick_axis is not None and thick_axis != 2:
        plane = "sagittal" if thick_axis == 0 else "coronal"
        return QCCheck(name, "fail", f"{plane} slices", f"not an axial series: its slices are {plane} "
                       f"(the thickest spacing, {spacing[thick_axis]:.2f} mm, runs along {'xyz'[thick_axis]})",
                       "export the axial reconstruction of the scan")
    if info.get("format") != "dicom":
        return QCCheck(name, "pass", "no DICOM tags", "no DICOM tags to check (NIfTI/MHD/NRRD); the geometry "
                       "checks apply")
    modality = str(info.get("modality") or "CT").upper()
    image_type = [str(v).upper() for v in info.get("image_type") or []]
    value = f"{modality} {'/'.join(image_type) or '-'}"
    if modality != "CT":
        return QCCheck(name, "fail", value, f"the modality is {modality}, not CT", "export the CT series")
    for key, what in EXCLUDED_IMAGE_TYPES.items():
        if key in image_type:
            return QCCheck(name, "fail", value, f"the series is {what}, not an axial CT reconstruction",
                           "export the axial CT series of the scan")
    # value 1 (ORIGINAL / DERIVED) is judged, value 2 (PRIMARY / SECONDARY: made at or after the exam) is not
    if image_type[:1] == ["DERIVED"]:
        return QCCheck(name, cfg.derived, value,
                       "a derived image (ImageType DERIVED: pixels computed from other images, e.g. an axial "
                       "reformat or a filtered copy), not the scanner's own reconstruction",
                       "prefer the ORIGINAL axial series when the scan has one")
    if image_type[1:2] == ["SECONDARY"]:
        return QCCheck(name, "pass", value, "an original axial CT series, re-exported (SECONDARY: e.g. by a PACS "
                       "or planning system)")
    return QCCheck(name, "pass", value, "an original axial CT series")


def check_geometry(shape: Sequence[int], spacing: np.ndarray, cfg: QCConfig) -> QCCheck:
    name = "geometry"
    value = f"{'x'.join(str(int(s)) for s in shape)} voxels, {'x'.join(f'{s:.2f}' for s in spacing)} mm"
    if not np.all(np.isfinite(spacing)) or np.any(spacing <= 0):
        return QCCheck(name, "fail", value, "the voxel spacing is not a positive size", "re-export the series")
    if min(shape) < cfg.min_slices:
        return QCCheck(name, "fail", value, f"not a 3D volume: {min(shape)} voxel(s) along one axis "
                       f"(< {cfg.min_slices}), like a scout or a single slice", "export the axial CT series")
    px = float(max(spacing[0], spacing[1])), float(min(spacing[0], spacing[1]))
    if px[0] > cfg.max_pixel_mm or px[1] < cfg.min_pixel_mm:
        return QCCheck(name, "fail", value, f"in-plane pixels of {px[1]:.2f}-{px[0]:.2f} mm are outside "
                       f"{cfg.min_pixel_mm}-{cfg.max_pixel_mm} mm", "export the original reconstruction")
    return QCCheck(name, "pass", value, "a 3D volume with a plausible voxel size")


def check_slice_thickness(info: Mapping[str, Any], spacing: np.ndarray, cfg: QCConfig) -> QCCheck:
    name = "slice_thickness"
    tag = info.get("slice_thickness_mm")
    eff = max(float(tag or 0.0), float(spacing[2]))
    value = f"{eff:.2f} mm" + (f" (tag {float(tag):.2f}, spacing {spacing[2]:.2f})" if tag else "")
    verdict = _verdict(eff, cfg.warn_slice_thickness_mm, cfg.max_slice_thickness_mm)
    if verdict == "pass":
        return QCCheck(name, verdict, value, f"slices of at most {cfg.warn_slice_thickness_mm:g} mm")
    limit = cfg.max_slice_thickness_mm if verdict == "fail" else cfg.warn_slice_thickness_mm
    return QCCheck(name, verdict, value, f"slices of {eff:.1f} mm are thicker than {limit:g} mm: small nodules "
                   "blur into their neighbourhood",
                   f"use a reconstruction of at most {cfg.max_slice_thickness_mm:g} mm "
                   "(screening protocols reconstruct at 1-2.5 mm)")


def check_slice_positions(info: Mapping[str, Any], spacing: np.ndarray) -> QCCheck:
    name = "slice_positions"
    if info.get("format") != "dicom":
        return QCCheck(name, "pass", f"every {spacing[2]:.2f} mm", "a regular grid (the file stores no slice "
                       "positions)")
    lo, med, hi = info.get("step_min_mm"), info.get("step_median_mm"), info.get("step_max_mm")
    value = f"steps {lo:.2f}-{hi:.2f} mm" if lo is not None else "-"
    if info.get("n_gaps"):
        return QCCheck(name, "fail", value, f"{info['n_gaps']} missing slice position(s) (a step of {hi:.2f} mm "
                       f"where {med:.2f} mm is usual), filled by interpolation", "re-export the complete series")
    if info.get("resampled"):
        return QCCheck(name, "warn", value, f"uneven slice steps, resampled to {med:.2f} mm",
                       "re-export the series with regular slice positions if you can")
    if info.get("n_duplicates"):
        return QCCheck(name, "warn", value, f"{info['n_duplicates']} duplicated slice position(s) dropped",
                       "check the export for repeated images")
    return QCCheck(name, "pass", value, "regular slice positions, no gaps")


def check_hu_air(arr: np.ndarray, cfg: QCConfig) -> QCCheck:
    name = "hu_air"
    sample = arr[::4, ::4, :].ravel()
    sample = sample[sample > -1500]  # padding outside the reconstruction circle is not air
    if sample.size == 0:
        return QCCheck(name, "fail", "-", "the image holds only padding values (below -1500)", "re-export the series")
    air = float(np.percentile(sample, 1))
    value = f"{air:.0f} HU"
    if cfg.air_hu_low <= air <= cfg.air_hu_high:
        return QCCheck(name, "pass", value, "air reads about -1000 HU")
    off = cfg.air_hu_low - air if air < cfg.air_hu_low else air - cfg.air_hu_high
    if off <= cfg.air_hu_tolerance:
        return QCCheck(name, "warn", value, f"air reads {air:.0f} HU, a little off -1000 HU (scanner calibration)",
                       "check the scanner's air calibration")
    why = "the rescale slope/intercept was probably not applied (stored values, not HU)" if air > -500 else \
        "the values are not Hounsfield units"
    return QCCheck(name, "fail", value, f"air reads {air:.0f} HU instead of about -1000 HU: {why}",
                   "export the series with its RescaleSlope/RescaleIntercept, or convert it to HU")


def check_lung_volume(ml: float, cfg: QCConfig) -> QCCheck:
    name = "lung_volume"
    value = f"{ml:.0f} mL"
    if ml < cfg.min_lung_ml:
        return QCCheck(name, "fail", value, f"{'no lungs' if ml < 0.1 * cfg.min_lung_ml else 'too little lung'} "
                       f"for an adult chest CT (< {cfg.min_lung_ml:.0f} mL)",
                       "check that the series is a chest CT covering both lungs")
    if ml > cfg.max_lung_ml:
        return QCCheck(name, "fail", value, f"more than any adult lung (> {cfg.max_lung_ml:.0f} mL): the lung mask "
                       "took in air outside the lungs", "check the image; plug in another lung masker if needed")
    if ml < cfg.low_lung_ml or ml > cfg.high_lung_ml:
        return QCCheck(name, "warn", value, f"outside the usual adult range {cfg.low_lung_ml:.0f}-"
                       f"{cfg.high_lung_ml:.0f} mL", "check the lung mask")
    return QCCheck(name, "pass", value, "an adult lung volume")


def check_extent(mask: np.ndarray, spacing: np.ndarray, cfg: QCConfig) -> list[QCCheck]:
    total = float(mask.sum()) * float(np.prod(spacing))
    beyond = {}
    for axis, (lo_name, hi_name) in enumerate((("left", "right"), ("back", "front"), ("bottom", "top"))):
        other = tuple(a for a in range(3) if a != axis)
        area = mask.sum(axis=other).astype(float) * float(np.prod(spacing[list(other)]))  # mm^2 per plane
        for side, prof in ((lo_name, area[::-1]), (hi_name, area)):
            missing = beyond_edge(prof, float(spacing[axis]), cfg.fit_mm, cfg.max_extrapolation_mm)
            beyond[side] = 100.0 * missing / (total + missing) if total + missing > 0 else 0.0
    # lung coverage: top and bottom
    cov = max(beyond["top"], beyond["bottom"])
    value = f"top {beyond['top']:.1f}%, bottom {beyond['bottom']:.1f}%"
    verdict = _verdict(cov, cfg.coverage_warn_pct, cfg.coverage_fail_pct)
    if verdict == "pass":
        coverage = QCCheck("lung_coverage", "pass", value, "apex and bases inside the scan")
    else:
        end = "top (apex)" if beyond["top"] >= beyond["bottom"] else "bottom (bases)"
        coverage = QCCheck("lung_coverage", verdict, value, f"the lungs run out of the scan at the {end}: about "
                           f"{cov:.1f}% of the lung lies beyond it", "scan (or export) the whole chest, from above "
                           "the lung apices to below the costophrenic angles")
    # field of view: the in-plane edges
    sides = ("right", "left", "front", "back")
    worst = max(sides, key=lambda s: beyond[s])
    cut = sum(beyond[s] for s in sides)
    value = f"{cut:.1f}% cut" + (f" (most at the {worst})" if cut > 0 else "")
    verdict = _verdict(cut, cfg.fov_warn_pct, cfg.fov_fail_pct)
    if verdict == "pass":
        fov = QCCheck("field_of_view", "pass", value, "the lungs lie inside the field of view")
    else:
        how = "most of the lung is inside" if verdict == "warn" else "too much of the lung is outside"
        fov = QCCheck("field_of_view", verdict, value, f"the field of view cuts the lungs at the {worst} edge: about "
                      f"{cut:.1f}% of the lung lies outside the image ({how})",
                      "reconstruct with a field of view that holds the whole chest")
    return [coverage, fov]


def beyond_edge(area_mm2: np.ndarray, step_mm: float, fit_mm: float = 15.0, max_mm: float = 100.0) -> float:
    """Estimated lung volume (mm^3) beyond the end of ``area_mm2``, the lung's cross-section areas
    on successive planes ``step_mm`` apart, the last one at the edge of the image.

    The areas over the last ``fit_mm`` are fitted by a line and extrapolated to zero; the tapering
    part beyond the edge holds ``a_edge^2 / (2 |slope|)``. A lung that does not taper towards the
    edge is extrapolated ``max_mm`` at the edge's area.
    """
    area = np.asarray(area_mm2, float)
    if area.size == 0 or area[-1] <= 0:
        return 0.0
    edge = float(area[-1])
    n = min(area.size, max(2, int(round(fit_mm / step_mm)) + 1))
    if n < 2:
        return edge * max_mm
    y = area[-n:]
    x = np.arange(n, dtype=float) * step_mm
    slope = float(np.polyfit(x, y, 1)[0])
    length = max_mm if slope >= 0 else min(edge / (2.0 * -slope), max_mm)
    return edge * length
