"""Series suitability checks: is this series a chest CT lungcal can score?

:func:`check_series` runs the named checks below on one series and returns a :class:`QCReport`;
each check is ``pass``, ``warn`` or ``fail`` (``skip`` when an earlier check made it meaningless),
with the measured value and a reason in plain words. :class:`QCd` runs them inside a preprocessing
``Compose``. The thresholds are :class:`QCConfig` fields (a bundle's ``qc`` section passes them
as keyword arguments); docs/hospital.md ("What scans lungcal accepts") explains each default.

=================  ===========================================================================
check              measures
=================  ===========================================================================
series_type        DICOM Modality / ImageType: CT, not a localizer or projection; ImageType
                   value 1 DERIVED warns (``derived``), value 2 (SECONDARY) is not judged;
                   axial (the thickest voxel spacing runs head-to-foot)
geometry           a 3D volume (at least ``min_slices`` along every axis) with in-plane pixels
                   in ``[min_pixel_mm, max_pixel_mm]``
slice_thickness    max(SliceThickness tag, slice spacing) against ``warn_/max_slice_thickness_mm``
slice_positions    regular slice positions: no missing slice, no uneven steps, no duplicates
hu_air             the darkest 1% of the scan (air) near -1000 HU: the rescale was applied
lung_volume        the lung mask's volume in an adult range
lung_coverage      the lung beyond the first/last slice, extrapolated from the last ``fit_mm``
field_of_view      the same, beyond the in-plane edges of the image
=================  ===========================================================================

How much lung lies beyond an edge: the lung's cross-section area is taken plane by plane towards
that edge; if it is not zero at the edge, the lung runs out of the image there. The area is fitted
linearly over the last ``fit_mm`` and extrapolated to zero (a lung tapers towards its apex, its
bases and its outer wall), at most ``max_extrapolation_mm`` beyond the edge; the volume of that
tapering part, as a share of the lung, is the measured value. A thin tip or crescent in the last
slice is a few tenths of a percent; a scan that stops in the middle of the lungs is tens of
percent.

Beside the checks, the report carries the CT's acquisition statistics
(:class:`~lungcal.ct.acquisition.AcquisitionStats`: slice thickness, pixel size, HU of air, noise,
edge width), measured on the volume already read, so that a site check compares them at no extra
read (:mod:`lungcal.ctapp.data.series_qc` caches them with the report).

Arrays are ``(X, Y, Z)`` in RAS, as :func:`lungcal.ct.io.load_ct` returns them: the last slice is
the top (superior), x grows towards the patient's right, y towards the front.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import MapTransform

from lungcal.errors import ConfigError, DataError, LungcalError

from .acquisition import AcquisitionStats, acquisition_stats
from .io import SERIES_INFO, load_ct
from .masking import LungMasker, Masker, Spacing, mask_like, run_masker
from .qc_checks import (
    CHECKS,
    VERDICTS,
    QCCheck,
    QCConfig,
    beyond_edge,
    check_extent,
    check_geometry,
    check_hu_air,
    check_lung_volume,
    check_series_type,
    check_slice_positions,
    check_slice_thickness,
)

__all__ = ["CHECKS", "VERDICTS", "QCConfig", "QCCheck", "QCReport", "check_series", "beyond_edge", "QCd"]

log = logging.getLogger(__name__)


@dataclass
class QCReport:
    """The checks of one series, in :data:`CHECKS` order.

    Attributes:
        checks: the :class:`QCCheck` s.
        name: what was checked (a file or a pseudonym), for messages; never written to ``as_rows``.
        seconds: time spent on the checks and the lung mask (not on reading the image).
        lung_volume_ml: the lung mask's volume (None when not measured).
        acquisition: the CT's acquisition statistics (:mod:`lungcal.ct.acquisition`; None when not
            measured: not a 3D volume, or ``check_series(acquisition=False)``).
    """

    checks: list[QCCheck] = field(default_factory=list)
    name: str | None = None
    seconds: float = 0.0
    lung_volume_ml: float | None = None
    acquisition: AcquisitionStats | None = None

    def __getitem__(self, name: str) -> QCCheck:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def failed(self) -> list[QCCheck]:
        """The checks that failed."""
        return [c for c in self.checks if c.verdict == "fail"]

    @property
    def warnings(self) -> list[QCCheck]:
        """The checks that warned."""
        return [c for c in self.checks if c.verdict == "warn"]

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return not self.failed

    @property
    def verdict(self) -> str:
        """``fail`` if any check failed, else ``warn`` if any warned, else ``pass``."""
        return "fail" if self.failed else "warn" if self.warnings else "pass"

    def raise_if_failed(self, subject_or_file: str | os.PathLike | None = None) -> None:
        """Raise a :class:`DataError` naming the (first) failed check, its measured value and the fix."""
        if not self.failed:
            return
        first, rest = self.failed[0], self.failed[1:]
        also = f" (also failed: {', '.join(c.name for c in rest)})" if rest else ""
        raise DataError(f"series check '{first.name}' failed: {first.reason} (measured: {first.value}){also}",
                        file=subject_or_file if subject_or_file is not None else self.name,
                        field=f"qc.{first.name}", fix=first.fix or None)

    def as_rows(self, pseudonym: str | None = None) -> list[dict[str, str]]:
        """Rows for a ``qc.csv``: ``pseudonym, check, verdict, value`` (no paths, no reasons with
        paths: only what was measured)."""
        return [{"pseudonym": pseudonym or "", "check": c.name, "verdict": c.verdict, "value": c.value}
                for c in self.checks]

    def format(self) -> str:
        """A plain-text table, one line per check."""
        width = max((len(c.name) for c in self.checks), default=5)
        vwidth = max((len(c.value) for c in self.checks), default=5)
        lines = [f"{(self.name or 'series')}: {self.verdict.upper()} ({self.seconds:.1f} s)"]
        for c in self.checks:
            lines.append(f"  {c.name:<{width}}  {c.verdict:<4}  {c.value:<{vwidth}}  {c.reason}")
        if self.acquisition is not None:
            a = self.acquisition
            lines.append(f"  {'acquisition':<{width}}  slices {a.slice_thickness_mm:.2f} mm, pixels "
                         f"{a.pixel_mm:.2f} mm, air {a.air_hu:.0f} HU, noise {a.noise_hu:.1f} HU, "
                         f"edge {a.edge_sigma_mm:.2f} mm")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
def check_series(image, *, config: QCConfig | Mapping[str, Any] | None = None, masker: Masker | None = None,
                 mask: np.ndarray | None = None, spacing: Spacing | None = None,
                 info: Mapping[str, Any] | None = None, name: str | None = None, series_uid: str | None = None,
                 acquisition: bool = True, **overrides: Any) -> QCReport:
    """Run the series checks on one CT.

    Args:
        image: a path (DICOM folder, NIfTI, MHD, NRRD: read with :func:`~lungcal.ct.io.load_ct`),
            a HU MetaTensor ``(1, X, Y, Z)`` from it, or a HU array ``(X, Y, Z)`` in RAS (then
            ``spacing`` is needed).
        config: :class:`QCConfig`, a mapping of its fields, or None (defaults); ``overrides``
            replace single fields.
        masker: the lung masker (default :class:`~lungcal.ct.masking.LungMasker`).
        mask: a lung mask already computed for this image (skips the masker).
        spacing: voxel size in mm (arrays only; MetaTensors carry theirs).
        info: the DICOM series information (default: ``image.meta["series_info"]``).
        name: what to call the series in messages (default: the path).
        series_uid: with a DICOM folder holding several series, the one to check.
        acquisition: also measure the acquisition statistics (:attr:`QCReport.acquisition`).

    Returns:
        :class:`QCReport`. A series that cannot be read at all raises the loader's
        :class:`~lungcal.errors.DataError` instead.
    """
    cfg = QCConfig.from_any(config, **overrides)
    if isinstance(image, (str, os.PathLike)):
        name = name or str(image)
        image = load_ct(image, series_uid=series_uid)
    t0 = time.perf_counter()
    arr, spacing, info = _unpack(image, spacing, info)
    if name is None and isinstance(image, MetaTensor):
        name = image.meta.get("filename_or_obj")
    checks = [check_series_type(info, spacing, cfg), check_geometry(arr.shape, spacing, cfg)]
    volume, acq = None, None
    if min(arr.shape) < cfg.min_slices or not np.all(np.isfinite(spacing)) or np.any(spacing <= 0):
        why = "not measured: the series is not a 3D volume (see geometry)"
        checks += [QCCheck(n, "skip", "-", why) for n in CHECKS[2:]]
    else:
        checks += [check_slice_thickness(info, spacing, cfg), check_slice_positions(info, spacing),
                   check_hu_air(arr, cfg)]
        acq = acquisition_stats(arr, spacing, info) if acquisition else None
        if mask is None:
            mask = _safe_mask(masker or LungMasker(), arr, spacing)
        mask = np.asarray(mask).astype(bool, copy=False).reshape(arr.shape)
        volume = float(mask.sum() * np.prod(spacing) / 1000.0)
        checks.append(check_lung_volume(volume, cfg))
        if volume * 1000.0 < np.prod(spacing) or volume < 0.1 * cfg.min_lung_ml:
            why = "not measured: no lungs found (see lung_volume)"
            checks += [QCCheck(n, "skip", "-", why) for n in ("lung_coverage", "field_of_view")]
        else:
            checks += check_extent(mask, spacing, cfg)
    return QCReport(checks, name=None if name is None else str(name), seconds=time.perf_counter() - t0,
                    lung_volume_ml=volume, acquisition=acq)


def _unpack(image, spacing, info) -> tuple[np.ndarray, np.ndarray, dict]:
    if isinstance(image, MetaTensor):
        spacing = np.asarray(image.pixdim, float)[:3] if spacing is None else spacing
        info = dict(image.meta.get(SERIES_INFO) or {}) if info is None else info
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    arr = np.asarray(image)
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise ValueError(f"expected a (X, Y, Z) or (1, X, Y, Z) volume, got shape {arr.shape}")
    if spacing is None:
        raise ValueError("spacing is needed for a plain array")
    return arr, np.asarray(spacing, float).reshape(3), dict(info or {})


def _safe_mask(masker: Masker, arr: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    try:
        return run_masker(masker, arr, spacing)
    except LungcalError as exc:  # a plugged-in masker that refuses: no lungs as far as QC can tell
        log.info("the lung masker found no lungs (%s)", exc.message)
        return np.zeros(arr.shape, bool)


# --------------------------------------------------------------------------------------------
class QCd(MapTransform):
    """The series checks inside a preprocessing ``Compose``.

    Computes the lung mask of ``d[key]`` with ``masker`` (unless ``d[mask_key]`` is there),
    stores it as ``d[mask_key]`` (uint8 0/1 MetaTensor, so :class:`~lungcal.ct.transforms.LungMaskd`
    reuses it) and the :class:`QCReport` as ``d[report_key]``.

    Args:
        config: :class:`QCConfig` or a mapping of its fields.
        masker: the lung masker (default :class:`~lungcal.ct.masking.LungMasker`).
        policy: ``"raise"``: a failing series raises :class:`DataError` (naming the file, the check,
            the value and the fix); ``"record"``: only the report is stored. Warnings (and, with
            ``"record"``, failures) are logged with the row's pseudonym, never its path.
        subject_key: the row key holding the pseudonym used in logs.
    """

    def __init__(self, keys: KeysCollection = "image", mask_key: str = "lung_mask", report_key: str = "qc",
                 config: QCConfig | Mapping[str, Any] | None = None, masker: Masker | None = None,
                 policy: str = "raise", subject_key: str = "subject", allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        if policy not in ("raise", "record"):
            raise ConfigError(f"qc policy must be 'raise' or 'record', got {policy!r}", field="qc_policy",
                              fix="use raise (scoring) or record (training/study datalists)")
        self.mask_key, self.report_key, self.subject_key = mask_key, report_key, subject_key
        self.config = QCConfig.from_any(config)
        self.masker = masker or LungMasker()
        self.policy = policy

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        for key in self.key_iterator(d):
            img = d[key]
            t0 = time.perf_counter()
            arr, spacing, _ = _unpack(img, None if isinstance(img, MetaTensor) else np.ones(3), None)
            if self.mask_key in d:
                m = d[self.mask_key]
                mask = (m[0].detach().cpu().numpy() if isinstance(m, torch.Tensor) else np.asarray(m)[0]) > 0
            else:
                mask = _safe_mask(self.masker, arr, spacing)
                d[self.mask_key] = mask_like(mask, img)
            report = check_series(img, config=self.config, mask=mask)
            report.seconds = time.perf_counter() - t0
            d[self.report_key] = report
            who = d.get(self.subject_key) or "a CT"
            for c in report.warnings + (report.failed if self.policy == "record" else []):
                log.warning("series check %s: %s %s (%s)", c.name, c.verdict, who, c.reason)
            if self.policy == "raise":
                report.raise_if_failed(report.name)
        return d
