"""CT preprocessing as MONAI dictionary transforms: lung mask, crop to the lungs, spacing, HU window.

The chain built by :func:`build_preprocess` (and run by :func:`preprocess_ct`)::

    LoadCTd (HU, RAS)  ->  LungMaskd  ->  CropToLungd  ->  Spacingd  ->  HUWindowd

It departs from the order of DESIGN.md step 2 (Spacingd -> window -> mask -> crop) for speed: the
lung mask is computed on HU at the native grid (on a ~3 mm sub-sampled copy), and the volume is
cropped *before* it is resampled, so the expensive resampling only touches the lung box. Cropping
commutes with resampling (the affine of the crop is carried by the MetaTensor), so the result is
the same volume up to interpolation at the box faces; the window is applied last, after
interpolation, as on clinical workstations.

Lung mask: :class:`LungMaskd` runs a *masker* (``masker(hu, spacing) -> bool mask``), by default
:class:`lungcal.ct.masking.LungMasker` (body first, the air inside it, airways out, a rolling-ball
closing that keeps lesions attached to the pleura or hilum; see that module). ``masker=`` plugs in
another one (a learned segmenter; see docs/hospital.md). A scan whose mask is smaller than
``min_lung_ml`` (for example an abdomen-only CT) raises ``DataError("no lungs found ...")``: never
a silent empty crop. A volume too small for the masker and the detector (one slice, a few slices, a
small matrix: :mod:`lungcal.ct.extent`) is refused by the loader, naming the file and the minimum.

Series checks: ``build_preprocess(qc=...)`` puts :class:`lungcal.ct.qc.QCd` right after the
loader; it computes the lung mask once (``LungMaskd`` then reuses it) and stores the
:class:`~lungcal.ct.qc.QCReport` under ``"qc"`` (``qc_policy="raise"`` refuses a failing series
with a ``DataError``, ``"record"`` only stores the report).
"""
from __future__ import annotations

import math
import os
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.config import KeysCollection
from monai.data import MetaTensor
from monai.transforms import Compose, MapTransform, Spacingd, SpatialCrop, Transform

from lungcal.errors import ConfigError, DataError, LungcalError
from lungcal.runtime.parallel import cpu_threads, map_ordered

from .extent import require_extent
from .io import load_ct
from .masking import LungMasker, Masker, Spacing, mask_like, run_masker
from .qc import QCd

__all__ = [
    "DEFAULT_HU_WINDOW",
    "hu_window",
    "lung_mask",
    "lung_bbox",
    "LoadCTd",
    "HUWindowd",
    "SeparableSpacingd",
    "LungMaskd",
    "CropToLungd",
    "build_preprocess",
    "CTCompose",
    "preprocess_ct",
]

#: Liao et al. 2019: HU in [-1200, 600] mapped linearly to [0, 1]
DEFAULT_HU_WINDOW = (-1200.0, 600.0)


def hu_window(x, window: Sequence[float] = DEFAULT_HU_WINDOW, inplace: bool = False):
    """Map HU linearly from ``window = (lo, hi)`` to [0, 1] and clip (tensor or array)."""
    lo, hi = float(window[0]), float(window[1])
    if not hi > lo:
        raise ValueError(f"HU window must have hi > lo, got {window}")
    if isinstance(x, torch.Tensor):
        out = x if inplace else x.clone()
        return out.sub_(lo).div_(hi - lo).clamp_(0.0, 1.0)
    arr = x if inplace else np.array(x, dtype=np.float32, copy=True)
    arr -= lo
    arr /= hi - lo
    return np.clip(arr, 0.0, 1.0, out=arr)


def lung_mask(hu: np.ndarray, spacing: Spacing, *, min_lung_ml: float = 150.0, file: str | None = None,
              masker: Masker | None = None, **masker_kwargs) -> np.ndarray:
    """3D lung mask of a HU volume ``(X, Y, Z)``; raises when it holds less than ``min_lung_ml``.

    Args:
        hu: HU volume (numpy, any float/int dtype).
        spacing: voxel size in mm.
        min_lung_ml: below this lung volume the scan has no lungs.
        file: for the error message.
        masker: the masker (default :class:`~lungcal.ct.masking.LungMasker` built from
            ``masker_kwargs``: threshold, mask_voxel_mm, closing_mm, lesion_closing_mm,
            second_ratio, airway_cut_mm, body_threshold, padding_below).

    Returns:
        bool array of ``hu.shape``.

    Raises:
        DataError: a volume too small to mask (:mod:`lungcal.ct.extent`), or no lungs found.
    """
    masker = _make_masker(masker, masker_kwargs)
    hu = np.asarray(hu)
    require_extent(hu.shape, spacing, file=file)
    mask = run_masker(masker, hu, spacing)
    _require_lungs(mask, spacing, min_lung_ml, file)
    return mask


def _make_masker(masker: Masker | None, kwargs: Mapping) -> Masker:
    if masker is None:
        try:
            return LungMasker(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"bad lung mask setting ({exc})", field="mask_kwargs",
                              fix="use the LungMasker fields: see lungcal.ct.masking.LungMasker") from None
    if kwargs:
        raise ConfigError(f"lung mask settings {sorted(kwargs)} were given together with a masker", field="masker",
                          fix="configure the masker object itself, or leave masker out")
    if not callable(masker):
        raise ConfigError(f"the masker must be callable as masker(hu, spacing), got {type(masker).__name__}",
                          field="masker", fix="name a class with __call__(hu, spacing) -> mask as its _target_")
    return masker


def _require_lungs(mask: np.ndarray, spacing: Spacing, min_lung_ml: float, file: str | None) -> None:
    vol_ml = float(mask.sum() * np.prod(np.asarray(spacing, float)) / 1000.0)
    if vol_ml < min_lung_ml:
        raise DataError(f"no lungs found (lung-like air inside the body: {vol_ml:.0f} mL < {min_lung_ml:.0f} mL)",
                        file=file, fix="check that the image is a chest CT (not an abdomen-only scan or a scout) "
                                       "or remove it from the datalist")


def lung_bbox(mask: np.ndarray, spacing: Spacing, margin_mm: float | Sequence[float] = 10.0,
              file: str | os.PathLike | None = None):
    """(start, end) voxel indices of the mask's bounding box grown by ``margin_mm``, clipped to the volume
    (``file``: the image, named by the error of an empty mask)."""
    if not mask.any():
        raise DataError("no lungs found (empty lung mask)", file=file, fix="check that the image is a chest CT")
    margin = np.broadcast_to(np.asarray(margin_mm, float), (3,))
    start, end = [], []
    for ax in range(3):
        other = tuple(a for a in range(3) if a != ax)
        nz = np.flatnonzero(mask.any(axis=other))
        m = int(math.ceil(margin[ax] / float(spacing[ax])))
        start.append(max(int(nz[0]) - m, 0))
        end.append(min(int(nz[-1]) + 1 + m, mask.shape[ax]))
    return start, end


def _spacing_of(img: MetaTensor) -> np.ndarray:
    return np.asarray(img.pixdim, dtype=float)[:3]


def _filename(img) -> str | None:
    if isinstance(img, MetaTensor):
        f = img.meta.get("filename_or_obj")
        return None if f is None else str(f)
    return None


class LoadCTd(MapTransform):
    """Load ``d[key]`` with :func:`lungcal.ct.io.load_ct` (HU, RAS, channel first).

    Unlike MONAI's ``LoadImaged`` this never swallows reader errors, so a bad file surfaces as a
    :class:`DataError` naming the file. A DICOM folder holding several series reads the one named
    by ``d[series_key]`` (a datalist row's ``series_uid``) when the row has it. A volume too small
    for the lung mask and the detector (:mod:`lungcal.ct.extent`: one slice, a few slices, a small
    matrix) is refused here, naming the file, its size and the minimum.
    """

    def __init__(self, keys: KeysCollection = "image", allow_gaps: bool = False, series_key: str = "series_uid",
                 allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        self.allow_gaps = allow_gaps
        self.series_key = series_key

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        uid = d.get(self.series_key) or None
        for key in self.key_iterator(d):
            path = d[key]
            d[key] = load_ct(path, allow_gaps=self.allow_gaps, series_uid=uid)
            require_extent(d[key].shape[1:], _spacing_of(d[key]), file=path)
        return d


class HUWindowd(MapTransform):
    """Map HU in ``window`` to [0, 1] (clipped), in place. Default window [-1200, 600]."""

    def __init__(self, keys: KeysCollection = "image", window: Sequence[float] = DEFAULT_HU_WINDOW,
                 allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        self.window = (float(window[0]), float(window[1]))
        if not self.window[1] > self.window[0]:
            raise ValueError(f"HU window must have hi > lo, got {window}")

    def __call__(self, data):
        d = dict(data)
        for key in self.key_iterator(d):
            img = d[key]
            if not isinstance(img, torch.Tensor):
                img = torch.as_tensor(np.asarray(img, dtype=np.float32))
            d[key] = hu_window(img, self.window, inplace=True)
        return d


class LungMaskd(MapTransform):
    """Compute the lung mask of the HU image ``d[key]`` into ``d[mask_key]`` (uint8 0/1 MetaTensor,
    same geometry; :class:`CropToLungd` turns it into float32 after cropping).

    Args:
        masker: any ``masker(hu, spacing) -> bool mask`` (a bundle names it by ``_target_``);
            default :class:`~lungcal.ct.masking.LungMasker` built from ``masker_kwargs``.
        min_lung_ml: a smaller mask raises ``DataError("no lungs found ...")`` naming the file.
        masker_kwargs: the fields of :class:`~lungcal.ct.masking.LungMasker` (threshold,
            mask_voxel_mm, closing_mm, lesion_closing_mm, airway_cut_mm, ...), when ``masker`` is
            None.

    When ``d[mask_key]`` is already there (computed by :class:`~lungcal.ct.qc.QCd` earlier in the
    chain) it is reused, and only the ``min_lung_ml`` check runs. A volume too small for the masker
    and the detector (:mod:`lungcal.ct.extent`) is refused first, naming the file.
    """

    def __init__(self, keys: KeysCollection = "image", mask_key: str = "lung_mask", masker: Masker | None = None,
                 min_lung_ml: float = 150.0, allow_missing_keys: bool = False, **masker_kwargs: Any):
        super().__init__(keys, allow_missing_keys)
        self.mask_key = mask_key
        self.masker = _make_masker(masker, masker_kwargs)
        self.min_lung_ml = float(min_lung_ml)

    def __call__(self, data):
        d = dict(data)
        for key in self.key_iterator(d):
            img = d[key]
            spacing = _spacing_of(img) if isinstance(img, MetaTensor) else np.ones(3)
            if isinstance(img, MetaTensor):  # a plain array has no voxel size to judge its extent by
                require_extent(tuple(img.shape)[-3:], spacing, file=_filename(img))
            if self.mask_key in d:
                m = d[self.mask_key]
                m = (m[0].detach().cpu().numpy() if isinstance(m, torch.Tensor) else np.asarray(m)[0]) > 0
                _require_lungs(m, spacing, self.min_lung_ml, _filename(img))
                continue
            arr = img[0].detach().cpu().numpy() if isinstance(img, torch.Tensor) else np.asarray(img)[0]
            m = run_masker(self.masker, arr, spacing)
            _require_lungs(m, spacing, self.min_lung_ml, _filename(img))
            d[self.mask_key] = mask_like(m, img)
        return d


class CropToLungd(MapTransform):
    """Crop ``keys`` (image and mask) to the bounding box of ``d[mask_key]`` plus ``margin_mm``.

    The crop is a MONAI ``SpatialCrop``, so the affine of the outputs moves with the box. The
    cropped mask comes out float32 {0, 1}.
    """

    def __init__(self, keys: KeysCollection = ("image", "lung_mask"), mask_key: str = "lung_mask",
                 margin_mm: float = 10.0, allow_missing_keys: bool = False):
        super().__init__(keys, allow_missing_keys)
        self.mask_key = mask_key
        self.margin_mm = margin_mm

    def __call__(self, data):
        d = dict(data)
        mask = d[self.mask_key]
        spacing = _spacing_of(mask) if isinstance(mask, MetaTensor) else np.ones(3)
        if isinstance(mask, torch.Tensor):
            m0 = mask[0].detach().cpu()
            arr = m0.numpy().view(bool) if m0.dtype == torch.uint8 else (m0 > 0).numpy()
        else:
            arr = np.asarray(mask)[0] > 0
        start, end = lung_bbox(arr, spacing, self.margin_mm, file=_filename(mask))
        crop = SpatialCrop(roi_start=start, roi_end=end)
        for key in self.key_iterator(d):
            d[key] = crop(d[key])
        if isinstance(d[self.mask_key], torch.Tensor) and not d[self.mask_key].is_floating_point():
            d[self.mask_key] = d[self.mask_key].float()  # float32 {0, 1} for resampling and downstream use
        return d


class CTCompose(Compose):
    """A MONAI ``Compose`` that re-raises a :class:`~lungcal.errors.LungcalError` from inside a
    transform as itself (MONAI wraps every transform error in ``RuntimeError``), so a bad CT still
    surfaces as one clear ``DataError``."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except RuntimeError as exc:
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, LungcalError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise cause.with_traceback(None) from None


class SeparableSpacingd(MapTransform):
    """MONAI's ``Spacingd`` geometry, with a large output resampled axis by axis in bounded memory.

    ``Spacingd`` samples the whole output at once through a coordinate grid of three floats per output
    voxel: resampling a real 2.5 mm scan's lung box to the full-resolution preset's 1 mm grid peaked at
    5.1x the float32 volume and took 6.7x its bare SimpleITK read (``scripts/bench_ct.py``). Here the
    output's affine and shape are ``Spacingd``'s own (from its lazy mode). A change of voxel size maps
    each output axis onto one input axis (``src = scale * dst + offset``), so an output of more than
    ``max_voxels`` voxels is interpolated one axis at a time, shrinking axes first: linear (``bilinear``)
    or nearest, clamped at the border as ``padding_mode="border"``, in chunks of at most ``max_voxels``
    (``Spacingd`` keeps the scan's directions, so the map is per axis even for an oblique scan; were it
    not, ``Spacingd`` would resample in one shot). Values differ from the one-shot result only in float
    rounding (at most 0.06 HU on LIDC-IDRI-0001 at 1 mm; the nearest-neighbour mask is identical).
    An output within ``max_voxels`` (the default 2.5 mm preset's, about 1 M voxels) goes through
    ``Spacingd`` itself, unchanged.
    """

    def __init__(self, keys: KeysCollection, pixdim: Sequence[float], mode: Sequence[str],
                 padding_mode: str = "border", dtype: Any = np.float32, max_voxels: int = 4_000_000,
                 allow_missing_keys: bool = False) -> None:
        super().__init__(keys, allow_missing_keys)
        if padding_mode != "border":
            raise ConfigError(f"SeparableSpacingd pads at the border only, got {padding_mode!r}",
                              field="padding_mode", fix="use padding_mode='border' (or MONAI's Spacingd)")
        self.modes = tuple(mode)
        self.max_voxels = int(max_voxels)
        kw = {"pixdim": pixdim, "mode": self.modes, "padding_mode": padding_mode, "dtype": dtype}
        self.spacing = Spacingd(keys, allow_missing_keys=allow_missing_keys, **kw)
        self.geometry = Spacingd(keys, allow_missing_keys=allow_missing_keys, lazy=True, **kw)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict:
        d = dict(data)
        keys = list(self.key_iterator(d))
        views = {k: MetaTensor(d[k].as_tensor(), meta=dict(d[k].meta)) for k in keys
                 if isinstance(d[k], MetaTensor)}  # the lazy pass must not touch the inputs
        if len(views) != len(keys):
            return self.spacing(d)
        planned: dict[Hashable, Any] = dict(self.geometry(dict(views)))  # MetaTensors with the op pending
        shapes = {k: tuple(int(n) for n in planned[k].peek_pending_shape()) for k in keys}
        if all(math.prod(shape) <= self.max_voxels for shape in shapes.values()):
            return self.spacing(d)
        for key, mode in zip(keys, self.modes):
            img = d[key]
            dst = np.asarray(planned[key].peek_pending_affine(), np.float64)
            xform = np.linalg.solve(np.asarray(img.affine, np.float64), dst)
            if not np.allclose(xform[:3, :3], np.diag(np.diag(xform[:3, :3])), atol=1e-9):
                return self.spacing(data)  # not per axis (Spacingd keeps the directions, so never met)
            out = self._separable(img.as_tensor().to(torch.float32), xform, shapes[key], mode)
            meta = {k: v for k, v in img.meta.items() if k != "affine"}
            d[key] = MetaTensor(out, affine=torch.as_tensor(dst), meta=meta)
        return d

    def _separable(self, x: torch.Tensor, xform: np.ndarray, shape: tuple[int, ...], mode: str) -> torch.Tensor:
        src = x
        for ax in sorted(range(3), key=lambda a: -xform[a, a]):  # shrinking axes first: smaller intermediates
            x = self._axis(x, ax + 1, shape[ax], float(xform[ax, ax]), float(xform[ax, 3]), mode)
        if x.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():  # every axis was a slice
            x = x.clone(memory_format=torch.contiguous_format)  # a new volume, as a resampled one is
        return x

    def _axis(self, x: torch.Tensor, axis: int, n_out: int, scale: float, offset: float, mode: str) -> torch.Tensor:
        """Interpolate ``x`` along ``axis`` onto ``n_out`` points at ``scale * i + offset`` (clamped).

        An axis whose voxel size does not change and whose points fall on input voxels (a 1 mm scan's
        slices on the 1 mm grid) is a slice of the input, with no arithmetic: the interpolation there
        gives the input values exactly (``lerp`` at weight 0 or 1). Otherwise the output is made in
        chunks along the other spatial axis of the largest stride (contiguous pieces of memory), on
        :func:`~lungcal.runtime.parallel.cpu_threads` threads; each voxel by the same arithmetic."""
        n_in = x.shape[axis]
        shift = round(offset)
        if scale == 1.0 and offset == shift and 0 <= shift and shift + n_out <= n_in:
            return x.narrow(axis, shift, n_out)
        pos = (torch.arange(n_out, dtype=torch.float64) * scale + offset).clamp(0, n_in - 1)
        out_shape = list(x.shape)
        out_shape[axis] = n_out
        out = torch.empty(out_shape, dtype=torch.float32)
        chunk_dim = max((d for d in range(1, x.ndim) if d != axis), key=lambda d: x.stride(d))
        per_chunk = max(1, self.max_voxels // max(1, math.prod(out_shape) // out_shape[chunk_dim]))
        per_chunk = min(per_chunk, -(-out_shape[chunk_dim] // (2 * cpu_threads())))  # work for every thread
        if mode == "nearest":
            near = torch.round(pos).long()
        else:
            lo = pos.floor().long().clamp(max=max(0, n_in - 2))
            hi = (lo + 1).clamp(max=n_in - 1)
            view = [1] * x.ndim
            view[axis] = n_out
            w = (pos - lo).to(torch.float32).view(view)

        def one(c0: int) -> None:
            part = x.narrow(chunk_dim, c0, min(per_chunk, out_shape[chunk_dim] - c0))
            target = out.narrow(chunk_dim, c0, part.shape[chunk_dim])
            if mode == "nearest":
                target.copy_(part.index_select(axis, near))
            else:
                target.copy_(torch.lerp(part.index_select(axis, lo), part.index_select(axis, hi), w))

        map_ordered(one, [(c0,) for c0 in range(0, out_shape[chunk_dim], per_chunk)])
        return out


class _Contiguous(Transform):
    def __call__(self, data):
        return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}


def build_preprocess(spacing: Sequence[float] | float | None = (1.0, 1.0, 1.0),
                     hu_window: Sequence[float] = DEFAULT_HU_WINDOW, margin_mm: float = 10.0,
                     allow_gaps: bool = False, load: bool = True, masker: Masker | None = None,
                     min_lung_ml: float = 150.0, qc: Any = None, qc_policy: str = "raise",
                     **mask_kwargs) -> CTCompose:
    """The preprocessing :class:`CTCompose` on dicts ``{"image": path}`` -> ``{"image", "lung_mask"}``.

    Args:
        spacing: output voxel size in mm (a number or three); None keeps the native grid.
        hu_window: HU range mapped to [0, 1].
        margin_mm: margin around the lung box.
        allow_gaps: DICOM: interpolate across missing slices instead of failing.
        load: include the loader (False when ``image`` is already a HU MetaTensor).
        masker: the lung masker (``masker(hu, spacing) -> bool mask``); default
            :class:`~lungcal.ct.masking.LungMasker` built from ``mask_kwargs``.
        min_lung_ml: a smaller lung mask raises ``DataError("no lungs found ...")``.
        qc: None (no series checks), True (default thresholds), a mapping of
            :class:`~lungcal.ct.qc.QCConfig` fields or a ``QCConfig``: run :class:`~lungcal.ct.qc.QCd`
            after the loader and keep the report under ``"qc"``.
        qc_policy: ``"raise"`` (a failing series is a ``DataError``) or ``"record"``.
        mask_kwargs: passed to :class:`~lungcal.ct.masking.LungMasker` (threshold, mask_voxel_mm,
            closing_mm, lesion_closing_mm, airway_cut_mm, ...).
    """
    masker = _make_masker(masker, mask_kwargs)
    chain: list = [LoadCTd("image", allow_gaps=allow_gaps)] if load else []
    if qc is not None and qc is not False:
        chain.append(QCd("image", config=None if qc is True else qc, masker=masker, policy=qc_policy))
    chain += [LungMaskd("image", masker=masker, min_lung_ml=min_lung_ml),
              CropToLungd(("image", "lung_mask"), margin_mm=margin_mm)]
    if spacing is not None:
        pix = tuple(float(s) for s in np.broadcast_to(np.asarray(spacing, float), (3,)))
        chain.append(SeparableSpacingd(("image", "lung_mask"), pixdim=pix, mode=("bilinear", "nearest"),
                                       padding_mode="border", dtype=np.float32))
    chain += [HUWindowd("image", window=hu_window), _Contiguous()]
    return CTCompose(chain)


def preprocess_ct(path: str | os.PathLike, spacing: Sequence[float] | float | None = (1.0, 1.0, 1.0),
                  hu_window: Sequence[float] = DEFAULT_HU_WINDOW, margin_mm: float = 10.0,
                  allow_gaps: bool = False, series_uid: str | None = None, **kwargs) -> dict:
    """Load and preprocess one CT.

    Args:
        series_uid: DICOM folder with several series: the one to read.
        kwargs: the rest of :func:`build_preprocess` (masker, min_lung_ml, qc, qc_policy, and the
            lung mask settings).

    Returns:
        ``{"image": MetaTensor (1, X, Y, Z) float32 in [0, 1], "lung_mask": MetaTensor (1, X, Y, Z)
        float32 in {0, 1}}`` on the lung box (plus ``margin_mm``) resampled to ``spacing`` mm; the
        affines (RAS, mm) place both in the scanner's world. With ``qc``, also ``"qc"``: the
        :class:`~lungcal.ct.qc.QCReport`.

    Raises:
        DataError: unreadable image (named), slice gap, no lungs found, or (``qc`` with the
            ``"raise"`` policy) a failed series check.
    """
    row = {"image": str(path)}
    if series_uid:
        row["series_uid"] = series_uid
    out = build_preprocess(spacing, hu_window, margin_mm, allow_gaps, **kwargs)(row)
    res = {"image": out["image"], "lung_mask": out["lung_mask"]}
    if "qc" in out:
        res["qc"] = out["qc"]
    return res
