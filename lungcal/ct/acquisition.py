"""Per-CT acquisition statistics: what the scanner and its settings leave in the image.

:func:`acquisition_stats` measures, on one loaded CT in HU (``(X, Y, Z)`` in RAS with its spacing,
as :func:`lungcal.ct.io.load_ct` returns it):

==================  ============================================================================
field               what it is
==================  ============================================================================
slice_thickness_mm  the DICOM ``SliceThickness`` when the file has one, else the slice spacing
slice_spacing_mm    the distance between slice centres (the z spacing)
pixel_mm            the in-plane pixel size (mean of x and y)
air_hu              the median HU of the air outside the body (a calibration check: about -1000)
noise_hu            the global noise level: the mode of the local SD in soft tissue (Christianson
                    et al., Radiology 2015): the SD of HU over a ~6 mm in-plane window around each
                    voxel whose window mean lies in [0, 100] HU, the histogram's peak, corrected for
                    the window's size
edge_sigma_mm       the sharpness: the Gaussian width (sigma, mm) of the edge spread at the
                    skin/air boundary (after Sanders et al., Med Phys 2016): larger is softer
==================  ============================================================================

How the edge width is read: a Gaussian-blurred step from air ``A`` to tissue ``T`` reads, at a
distance ``d`` from the edge, ``v = A + (T - A) Phi(d / s)`` with gradient
``|g| = (T - A) phi(d / s) / s``; so each voxel near the edge gives ``s = (T - A) phi(Phi^-1(u)) / |g|``
with ``u = (v - A) / (T - A)``, whatever its sub-voxel position. Values and gradients are read
after a one-voxel Gaussian in-plane smoothing (which tames the noise), the smoothing's width is
taken back out in quadrature, and the median over the edge voxels (``0.25 <= u <= 0.75``, within a
few mm of the outer body boundary) is the estimate. ``T`` is the median HU 4-8 mm inside the skin.

Every number comes from at most ``max_slices`` evenly spaced axial slices (8 by default), so a
512 x 512 x 300 CT costs a fraction of a second once it is loaded; the series checks
(:func:`lungcal.ct.qc.check_series`) compute it on the volume they have already read, and the
cached series-check report carries it (:mod:`lungcal.ctapp.data.series_qc`). A number that cannot
be measured (no air in the field of view, no soft tissue, no skin edge) is NaN.

Padding outside the reconstruction circle (below -1500 HU, e.g. -2048 or -3024) is neither air nor
tissue: it is treated as air for the body outline and left out of every statistic. The noise is
that of soft tissue, not of air; the edge is in-plane (the body's outline runs along z).
Validated on phantoms of known noise and kernel (``tests/ct/test_acquisition.py``: within 15% of
the noise and 0.25 mm of the applied blur) and plausible on two real scans.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch
from scipy import ndimage as ndi
from scipy.special import ndtri

__all__ = ["ACQUISITION_FIELDS", "AcquisitionStats", "acquisition_stats", "sample_slices", "body_masks",
           "air_level", "noise_level", "edge_sigma", "PADDING_BELOW_HU", "SUMMARY_VERSION", "SUMMARY_QUANTILES",
           "summarize_acquisitions", "summary_quantiles", "TOLERANCE", "training_range", "outside_training",
           "join_summaries"]

#: the measured numbers a site check compares (all floats; NaN when not measurable)
ACQUISITION_FIELDS = ("slice_thickness_mm", "slice_spacing_mm", "pixel_mm", "air_hu", "noise_hu", "edge_sigma_mm")
#: HU below this is padding outside the reconstruction circle, not air
PADDING_BELOW_HU = -1500.0
_BODY_HU = -500.0  # between air (-1000) and fat (-100): the body outline
_TISSUE_HU = (0.0, 100.0)  # soft tissue for the noise level (Christianson et al. 2015)
_NOISE_WINDOW_MM = 6.0
_AIR_MARGIN_MM = 5.0
_U_RANGE = (0.25, 0.75)
_MIN_VOXELS = 100
#: the version of :func:`summarize_acquisitions`' layout
SUMMARY_VERSION = 1
#: the quantile levels a summary keeps per field (a piecewise-linear CDF for comparisons)
SUMMARY_QUANTILES = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
#: how far beyond the training data's values a measurement may lie and still count as inside: the
#: estimators' own error on phantoms (``tests/ct/test_acquisition.py``: noise within 15 %, edge width within
#: 0.25 mm), half a typical slice-thickness step, and 25 HU of air (a scanner's air calibration tolerance).
#: ``noise_hu`` is relative (a fraction of the range's end), the others absolute.
TOLERANCE = {"slice_thickness_mm": 0.25, "slice_spacing_mm": 0.25, "pixel_mm": 0.1, "air_hu": 25.0,
             "noise_hu": 0.15, "edge_sigma_mm": 0.25}


@dataclass(frozen=True)
class AcquisitionStats:
    """The acquisition statistics of one CT (:data:`ACQUISITION_FIELDS`; NaN where not measurable).

    ``n_air``, ``n_tissue`` and ``n_edge`` count the voxels each estimate rests on; ``slices`` how
    many axial slices were sampled.
    """

    slice_thickness_mm: float
    slice_spacing_mm: float
    pixel_mm: float
    air_hu: float
    noise_hu: float
    edge_sigma_mm: float
    n_air: int = 0
    n_tissue: int = 0
    n_edge: int = 0
    slices: int = 0

    def as_dict(self) -> dict[str, float | int | None]:
        """Plain JSON (NaN written as None)."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AcquisitionStats:
        """Back from :meth:`as_dict` (None read as NaN; unknown keys ignored)."""
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: (math.nan if v is None else (int(v) if k.startswith("n_") or k == "slices"
                                                              else float(v))) for k, v in d.items() if k in names}
        return cls(**kw)

    def values(self) -> dict[str, float]:
        """The :data:`ACQUISITION_FIELDS` only."""
        return {k: float(getattr(self, k)) for k in ACQUISITION_FIELDS}


def acquisition_stats(image: Any, spacing: Any = None, info: Mapping[str, Any] | None = None,
                      max_slices: int = 8) -> AcquisitionStats:
    """Measure one CT's acquisition (see the module docstring).

    Args:
        image: a HU MetaTensor ``(1, X, Y, Z)`` from :func:`~lungcal.ct.io.load_ct`, or a HU array
            ``(X, Y, Z)`` (then ``spacing`` is needed). Axial slices along the last axis.
        spacing: voxel size in mm (default: the MetaTensor's ``pixdim``).
        info: the series information (default ``image.meta["series_info"]``); its
            ``slice_thickness_mm`` (the DICOM tag) is used when present.
        max_slices: how many evenly spaced axial slices are measured.
    """
    arr, spacing, info = _unpack(image, spacing, info)
    tag = info.get("slice_thickness_mm")
    thickness = float(tag) if tag else float(spacing[2])
    px = np.asarray(spacing, float)[:2]
    sub = sample_slices(arr, max_slices)
    body, anything, padding = body_masks(sub, px)
    inside, outside = _inplane_distance(body, px), _inplane_distance(~body, px)
    air, n_air = air_level(sub, px, anything, padding, outside)
    noise, n_tissue = noise_level(sub, px, body, inside)
    edge, n_edge = edge_sigma(sub, px, body, padding, air, inside, outside)
    return AcquisitionStats(thickness, float(spacing[2]), float(np.mean(px)), air, noise, edge, n_air, n_tissue,
                            n_edge, int(sub.shape[0]))


def summarize_acquisitions(stats: Sequence[AcquisitionStats | None], profiles: Sequence[str | None] = (),
                           kernels: Sequence[str | None] = ()) -> dict[str, Any]:
    """A summary of many CTs' acquisitions without any identifier: what a stage-1 run logs of its training split.

    Args:
        stats: one entry per CT (None: not measured, e.g. series checks off).
        profiles, kernels: per CT, the scanner profile name and kernel label its datalist row
            records (synthetic cohorts; None or empty where unknown); only their counts are kept.

    Returns:
        ``{"version", "n" (CTs), "n_measured", "fields": {field: {"n" (finite values), "mean", "sd",
        "min", "max", "quantiles": {"0.01": ..., "0.5": ..., "0.99": ...}}}, "profiles": {name: count},
        "kernels": {name: count}}`` for every field of :data:`ACQUISITION_FIELDS` (None where no finite
        value; ``sd`` with ``ddof=1``, None for one value). Plain JSON.
    """
    measured = [a for a in stats if a is not None]
    out: dict[str, Any] = {"version": SUMMARY_VERSION, "n": len(stats), "n_measured": len(measured), "fields": {}}
    for name in ACQUISITION_FIELDS:
        v = np.array([getattr(a, name) for a in measured], float)
        v = v[np.isfinite(v)]
        if not v.size:
            out["fields"][name] = {"n": 0, "mean": None, "sd": None, "min": None, "max": None,
                                   "quantiles": {f"{q:g}": None for q in SUMMARY_QUANTILES}}
            continue
        qs = np.quantile(v, SUMMARY_QUANTILES)
        out["fields"][name] = {"n": int(v.size), "mean": float(v.mean()),
                               "sd": float(v.std(ddof=1)) if v.size > 1 else None,
                               "min": float(v.min()), "max": float(v.max()),
                               "quantiles": {f"{q:g}": float(x) for q, x in zip(SUMMARY_QUANTILES, qs)}}
    for key, names in (("profiles", profiles), ("kernels", kernels)):
        counts = Counter(str(p) for p in names if p)
        out[key] = dict(sorted(counts.items()))
    return out


def join_summaries(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """``first`` widened by ``second`` (two :func:`summarize_acquisitions` summaries): each field's ``min`` and
    ``max`` span both, ``n`` and ``n_measured`` add up, the counts of profiles and kernels add up. The
    quantiles, mean and sd stay ``first``'s (a site test compares with the training data's central range;
    what one CT is flagged against is the min-max range, :func:`outside_training`)."""
    for s in (first, second):
        if s.get("version") != SUMMARY_VERSION:
            raise ValueError(f"acquisition summary version {s.get('version')!r}, expected {SUMMARY_VERSION}")
    out = {**first, "n": int(first.get("n", 0)) + int(second.get("n", 0)),
           "n_measured": int(first.get("n_measured", 0)) + int(second.get("n_measured", 0)), "fields": {}}
    for name in ACQUISITION_FIELDS:
        a = dict((first.get("fields") or {}).get(name) or {})
        b = (second.get("fields") or {}).get(name) or {}
        lows = [v for v in (a.get("min"), b.get("min")) if v is not None]
        highs = [v for v in (a.get("max"), b.get("max")) if v is not None]
        a.update(n=int(a.get("n") or 0) + int(b.get("n") or 0), min=min(lows) if lows else None,
                 max=max(highs) if highs else None)
        out["fields"][name] = a
    for key in ("profiles", "kernels"):
        counts = Counter(first.get(key) or {})
        counts.update(second.get(key) or {})
        out[key] = dict(sorted(counts.items()))
    return out


def summary_quantiles(summary: Mapping[str, Any], field: str) -> tuple[np.ndarray, np.ndarray]:
    """``(levels, values)`` of one field of a :func:`summarize_acquisitions` summary (empty when none).

    ``np.interp(x, values, levels)`` is then the training data's CDF at ``x`` (piecewise linear between
    the kept quantiles), e.g. to place a new site's CTs within the training range.
    """
    if summary.get("version") != SUMMARY_VERSION:
        raise ValueError(f"acquisition summary version {summary.get('version')!r}, expected {SUMMARY_VERSION}")
    q = (summary.get("fields", {}).get(field) or {}).get("quantiles") or {}
    pairs = [(float(k), float(v)) for k, v in q.items() if v is not None]
    if not pairs:
        return np.empty(0), np.empty(0)
    levels, values = np.array(sorted(pairs)).T
    return levels, values


def training_range(summary: Mapping[str, Any], field: str, central: bool = True) -> tuple[float, float] | None:
    """The training data's range of one field, widened by :data:`TOLERANCE`: its 1st-99th percentiles
    (``central``; 2 % of training CTs fall outside by construction, what a site test compares with) or its
    minimum and maximum (what one CT is flagged against). None when the summary has no value for it."""
    f = (summary.get("fields") or {}).get(field) or {}
    if central:
        q = f.get("quantiles") or {}
        lo, hi = q.get(f"{SUMMARY_QUANTILES[0]:g}"), q.get(f"{SUMMARY_QUANTILES[-1]:g}")
    else:
        lo, hi = f.get("min"), f.get("max")
    if lo is None or hi is None:
        return None
    tol = TOLERANCE.get(field, 0.0)
    if field == "noise_hu":
        return float(lo) * (1 - tol), float(hi) * (1 + tol)
    return float(lo) - tol, float(hi) + tol


def outside_training(summary: Mapping[str, Any] | None, stats: AcquisitionStats | None) -> list[dict[str, float | str]]:
    """The fields of one CT's acquisition outside everything the training data held (:func:`training_range`
    with ``central=False``), each as ``{"field", "value", "low", "high"}``; empty when inside, not measured,
    or without a summary."""
    if summary is None or stats is None:
        return []
    out: list[dict[str, float | str]] = []
    for name, value in stats.values().items():
        rng = training_range(summary, name, central=False)
        if rng is None or not math.isfinite(value):
            continue
        if not rng[0] <= value <= rng[1]:
            out.append({"field": name, "value": value, "low": rng[0], "high": rng[1]})
    return out


def sample_slices(arr: np.ndarray, max_slices: int = 8) -> np.ndarray:
    """At most ``max_slices`` evenly spaced axial slices of ``arr`` ``(X, Y, Z)`` as one contiguous float32
    stack ``(k, X, Y)`` (slices first: every function below works on such a stack)."""
    z = arr.shape[2]
    idx = np.unique(np.linspace(0, z - 1, min(int(max_slices), z)).round().astype(int))
    return np.stack([np.asarray(arr[:, :, i], dtype=np.float32) for i in idx])  # one slice at a time: no 3D gather


def body_masks(sub: np.ndarray, px: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(body, anything, padding)`` of a slice stack ``(k, X, Y)`` with in-plane pixels ``px`` (mm): the
    largest object of each slice with its holes (lungs, airways) filled, every object above -500 HU,
    and the padding outside the reconstruction circle."""
    px = np.asarray(px, float)[:2]
    padding = sub < PADDING_BELOW_HU
    smooth = ndi.gaussian_filter(np.where(padding, np.float32(-1000.0), sub), (0, *(2.0 / px)), truncate=2.0)
    anything = smooth > _BODY_HU
    body = np.zeros_like(anything)
    for k in range(sub.shape[0]):  # per sampled slice (at most max_slices): fill its holes, keep its largest object
        labels, n = ndi.label(ndi.binary_fill_holes(anything[k]))
        if n:
            sizes = np.bincount(labels.ravel())
            sizes[0] = 0
            body[k] = labels == int(np.argmax(sizes))
    return body, anything | body, padding


def air_level(sub: np.ndarray, px: Any, anything: np.ndarray, padding: np.ndarray,
              outside: np.ndarray | None = None) -> tuple[float, int]:
    """``(median HU, voxels)`` of the air more than 5 mm outside the body and outside every other object
    (table, arms), padding excluded. ``outside``: the in-plane distance (mm) of non-body voxels to the
    body, when already computed."""
    body_free = ~(anything | padding)
    outside = _inplane_distance(body_free, px) if outside is None else outside
    vals = sub[body_free & (outside > _AIR_MARGIN_MM)]
    return (float(np.median(vals)), int(vals.size)) if vals.size >= _MIN_VOXELS else (math.nan, int(vals.size))


def noise_level(sub: np.ndarray, px: Any, body: np.ndarray, inside: np.ndarray | None = None) -> tuple[float, int]:
    """``(noise SD in HU, voxels)``: the global noise level of soft tissue (Christianson et al. 2015).

    The SD over a ``w x w`` in-plane window (``w`` the odd number of pixels nearest 6 mm, at least 3)
    around every body voxel (the window inside the body) whose window mean lies in [0, 100] HU; the
    peak of their histogram (the SD most of the homogeneous tissue shows) divided by
    ``sqrt((n - 2) / (n - 1))``, the mode of the sample SD of ``n = w^2`` normal values over its true
    SD. ``inside``: the in-plane distance (mm) of body voxels to the outline, when already computed.
    """
    px = np.asarray(px, float)[:2]
    w = max(3, int(round(_NOISE_WINDOW_MM / float(np.mean(px)))) | 1)
    n = w * w
    x = sub - np.float32(50.0)  # centred on soft tissue: small squares in float32
    mean = ndi.uniform_filter(x, (1, w, w))
    var = (ndi.uniform_filter(x * x, (1, w, w)) - mean * mean) * np.float32(n / (n - 1))
    inside = _inplane_distance(body, px) if inside is None else inside
    inner = inside > (w // 2 + 0.5) * float(px.max()) * math.sqrt(2.0)  # the whole window inside the body
    sel = inner & (mean >= _TISSUE_HU[0] - 50.0) & (mean <= _TISSUE_HU[1] - 50.0)
    sd = np.sqrt(np.clip(var[sel], 0, None))
    if sd.size < _MIN_VOXELS:
        return math.nan, int(sd.size)
    hi = 2.0 * float(np.median(sd)) + 1e-6
    counts, edges = np.histogram(sd, bins=100, range=(0.0, hi))
    peak = int(np.argmax(ndi.gaussian_filter1d(counts.astype(float), 2.0)))
    mode = 0.5 * (edges[peak] + edges[peak + 1])
    return float(mode / math.sqrt((n - 2) / (n - 1))), int(sd.size)


def edge_sigma(sub: np.ndarray, px: Any, body: np.ndarray, padding: np.ndarray, air_hu: float,
               inside: np.ndarray | None = None, outside: np.ndarray | None = None) -> tuple[float, int]:
    """``(sigma mm, voxels)``: the Gaussian width of the edge spread at the skin/air boundary (module docstring).

    ``inside`` / ``outside``: the in-plane distances (mm) of body / non-body voxels to the outline, when
    already computed.
    """
    if not math.isfinite(air_hu):
        return math.nan, 0
    px = np.asarray(px, float)[:2]
    inside = _inplane_distance(body, px) if inside is None else inside
    outside = _inplane_distance(~body, px) if outside is None else outside
    filled = np.where(padding, np.float32(air_hu), sub)
    ok = np.ones(sub.shape, bool)
    ok[:, :3], ok[:, -3:], ok[:, :, :3], ok[:, :, -3:] = False, False, False, False
    if padding.any():  # not within 3 voxels of the reconstruction circle
        ok &= ~ndi.maximum_filter(padding, size=(1, 7, 7))
    reach = max(4.0, 3.0 * float(px.max()))  # mm from the outline on either side
    near = np.flatnonzero((np.where(body, inside, outside) <= reach) & ok)
    s = (0.0, 1.0, 1.0)  # the smoothing: one voxel in-plane
    smoothing_mm = float(np.mean(px))
    value = ndi.gaussian_filter(filled, s).ravel()[near]
    grad = np.hypot(ndi.gaussian_filter(filled, s, order=(0, 1, 0)).ravel()[near] / px[0],
                    ndi.gaussian_filter(filled, s, order=(0, 0, 1)).ravel()[near] / px[1])
    kernel, n = math.nan, 0
    depth = 4.0  # mm: where the tissue level is read (unsmoothed), just beyond the kernel's spread; refined once
    for _ in range(2):
        band = body & ok & (inside > depth) & (inside <= depth + max(float(px.max()), 1.0))
        if band.sum() < _MIN_VOXELS // 2:
            return math.nan, 0
        step = float(np.median(filled[band])) - air_hu
        if step < 300:  # no skin/air edge to speak of
            return math.nan, 0
        u = (value - air_hu) / step
        sel = (u >= _U_RANGE[0]) & (u <= _U_RANGE[1]) & (grad > 0)
        n = int(sel.sum())
        if n < _MIN_VOXELS // 2:
            return math.nan, n
        z = ndtri(u[sel])
        sigma_t = float(np.median(step * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) / grad[sel]))
        kernel = math.sqrt(max(sigma_t * sigma_t - smoothing_mm * smoothing_mm, 0.0))
        depth = min(max(3.0 * kernel, 1.5 * float(px.max())), 8.0)
    return kernel, n


# --------------------------------------------------------------------------------------------
def _inplane_distance(mask: np.ndarray, px: Any) -> np.ndarray:
    """In-plane Euclidean distance (mm) of every ``mask`` voxel of a stack ``(k, X, Y)`` to the nearest
    non-mask voxel of its slice (infinite in a slice that is all mask)."""
    px = np.asarray(px, float)[:2]
    out = np.zeros(mask.shape, np.float32)
    for k in range(mask.shape[0]):  # one 2D transform per sampled slice (at most max_slices)
        if mask[k].all():
            out[k] = np.inf
        elif mask[k].any():
            out[k] = ndi.distance_transform_edt(mask[k], sampling=px)
    return out


def _unpack(image: Any, spacing: Any, info: Mapping[str, Any] | None) -> tuple[np.ndarray, np.ndarray, dict]:
    meta = getattr(image, "meta", None)
    if spacing is None and hasattr(image, "pixdim"):
        spacing = np.asarray(image.pixdim, float)[:3]
    if info is None and isinstance(meta, Mapping):
        info = dict(meta.get("series_info") or {})
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    arr = np.asarray(image)
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 3:
        raise ValueError(f"expected a (X, Y, Z) or (1, X, Y, Z) volume, got shape {arr.shape}")
    if spacing is None:
        raise ValueError("spacing is needed for a plain array")
    return arr, np.asarray(spacing, float).reshape(3), dict(info or {})
