"""Lung masks on real chest CT: the body first, then the air inside it.

:class:`LungMasker` is the built-in masker; anything with the same call,
``masker(hu (X, Y, Z), spacing (3,)) -> bool (X, Y, Z)``, can replace it in
:class:`lungcal.ct.transforms.LungMaskd` / ``build_preprocess(masker=...)`` (a learned segmenter
wrapped in a class, named by ``_target_`` in a bundle; see docs/hospital.md). A masker never
raises for "no lungs": it returns an empty (or small) mask and the caller decides.

The steps, vectorised with ``scipy.ndimage`` on a copy sub-sampled to about ``mask_voxel_mm``:

1. **Body.** The largest 3D component above ``body_threshold`` HU (skin, muscle, bone), its holes
   filled slice by slice. Values below ``padding_below`` (the -2048 / -3024 written outside the
   reconstruction circle) are neither air nor tissue.
2. **Air inside the body.** Voxels below ``threshold`` HU inside the filled body: lungs, airways,
   bowel gas. Air outside the body is dropped even where it touches nothing. When the body touches
   the in-plane edge of the image (a field of view that cuts the patient), the lungs cut by it are
   not holes of the body; the air components that lie mostly between body pixels of the same row
   or column (:func:`span_hull`, in the slices where the body reaches the edge) are taken back:
   the air outside the patient lies outside those spans.
3. **Airways out.** The air is eroded by ``airway_cut_mm`` (which cuts the bronchi joining the
   trachea to the lungs), the largest component and the second largest (when at least
   ``second_ratio`` of it) are kept as the lungs, then grown back inside the air by the same
   radius. The trachea, the main bronchi outside the lungs and bowel gas are dropped.
4. **Vessels and attached lesions in.** Holes are filled in 3D and per slice, the mask is closed
   with a ball of ``closing_mm``, then each lung (left and right of the body's midline, separately,
   so the mediastinum between them is never bridged) gets a per-slice closing with a disk of
   ``lesion_closing_mm``: the rolling ball of classic lung CAD (Armato et al. 1999), which takes
   back nodules and masses attached to the pleura or the hilum (a notch narrower than twice the
   radius). 0 turns it off. An axial slice shows a lesion as a notch only where the pleura faces
   sideways; where it faces up or down (the apex, the diaphragm) or turns a corner (the
   costovertebral gutter, the heart's border on the diaphragm) the lesion fills the lung's whole
   cross-section in the slices through it, and no disk takes it back. So, after step 5, the same
   closing runs in the coronal and the sagittal slices with a disk of ``lesion_closing_sideways_mm``
   (the union of the three; step 5's mass cores are counted against the axial closing alone, so
   the sideways one only adds).
5. **Masses against the chest wall or the mediastinum in.** A mass of 3-7 cm bulging into the lung
   leaves a pit far wider than the closing's disk, and its base on the chest wall is a wide flat
   mouth that no disk closes. What marks it is that the lung lies around it: along most lines
   through its inner part the lung is met on both sides within ``mass_chord_mm``. For each lung
   (the same halves as step 4) and each of the 13 lines of the 3D grid through a voxel (the axes,
   the face and the body diagonals), :func:`line_closing` with a line of ``mass_chord_mm`` marks
   the voxels outside the lung that lie on a shorter chord between two lung voxels; the count of
   such lines is the voxel's *enclosure* (0-13). The heart, the liver dome, the chest wall and the
   mediastinum touch the lung with a broad surface: only the few lines tangent to it have lung at
   both ends, so their voxels count few lines; the inner part of a mass counts most of them. The
   voxels left out by steps 1-4 with an enclosure of at least ``mass_directions``, in connected
   pieces of at least ``mass_core_ml``, are mass cores; the mask takes them and every voxel
   enclosed along at least one line within ``mass_reach_mm`` of a core and connected to it outside
   the lung (the rest of the mass, out to its base). ``mass_chord_mm`` 0 turns it off.
   Measured (``experiments/mass_mask.py``, masses of 30-70 mm inserted into three real CTs by
   :mod:`lungcal.data.synthetic.insertion`, a draw the settings were not tuned on): masses with at
   least half their sphere in the mask, against the mediastinum 38 % -> 90 % (21), against the costal
   pleura 14 % -> 71 % (21); nothing added to the three scans without a mass (0 mL); a real 10 cm
   tumour in broad contact with the chest wall stays out (its base is wider than ``mass_chord_mm``).
6. Upsampled (nearest) back to the native grid.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from monai.data import MetaTensor
from numpy.lib.stride_tricks import as_strided
from scipy import ndimage as ndi

from lungcal.runtime.parallel import map_slabs

__all__ = ["Spacing", "Masker", "LungMasker", "ball", "fill_holes_2d", "largest_component", "coarse_view",
           "upsample_nearest", "mask_like", "run_masker", "span_hull", "LINES", "line_closing"]

#: per-axis values (voxel spacing in mm, radii in voxels, integer steps): a sequence or a 1-D array
Spacing = Sequence[float] | np.ndarray

#: what a masker is: ``masker(hu, spacing) -> bool mask of hu.shape``
Masker = Callable[[np.ndarray, Spacing], np.ndarray]

_SLICE_ONLY = np.zeros((3, 3, 3), bool)
_SLICE_ONLY[:, :, 1] = ndi.generate_binary_structure(2, 1)


def ball(radius_vox: Spacing) -> np.ndarray:
    """A boolean ellipsoid structuring element with the given per-axis radii (voxels)."""
    r = [max(int(math.floor(v)), 0) for v in radius_vox]
    g = np.ogrid[tuple(slice(-k, k + 1) for k in r)]
    d = sum((gi / max(rv, 1e-6)) ** 2 for gi, rv in zip(g, radius_vox))
    return np.asarray(d <= 1.0)


def fill_holes_2d(mask: np.ndarray) -> np.ndarray:
    """Fill the holes of every axial slice at once: the background is labelled in 2D per slice
    (a 3D label whose structure does not connect along z) and only what touches the slice border
    stays background."""
    bg, _ = ndi.label(~mask, structure=_SLICE_ONLY)
    border = np.unique(np.concatenate([bg[0].ravel(), bg[-1].ravel(), bg[:, 0].ravel(), bg[:, -1].ravel()]))
    return ~np.isin(bg, border[border > 0])


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 3D (face-connected) component of ``mask`` (empty when ``mask`` is)."""
    labels, n = ndi.label(mask)
    if n == 0:
        return np.zeros(mask.shape, bool)
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    return labels == int(np.argmax(sizes))


def coarse_view(hu: np.ndarray, spacing: Spacing, voxel_mm: float) -> tuple[np.ndarray, np.ndarray]:
    """A strided view of ``hu`` at about ``voxel_mm`` (the centre of each block; no copy) and the
    integer step per axis."""
    spacing = np.asarray(spacing, dtype=float)
    step = np.maximum(1, np.floor(voxel_mm / spacing + 1e-6)).astype(int)
    # the centre of each block, but never past the last voxel: an axis shorter than half a step
    # (a single thin slice) keeps one plane instead of none
    off = np.minimum(step // 2, np.maximum(np.asarray(hu.shape[:3]) - 1, 0))
    return hu[off[0]:: step[0], off[1]:: step[1], off[2]:: step[2]], step


def upsample_nearest(mask: np.ndarray, step: Sequence[int] | np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Undo :func:`coarse_view` for a mask: repeat each voxel ``step`` times per axis, cropped to ``shape``
    (past the last block, the last voxel repeats).

    ``np.repeat`` per axis, the last axis first (on the small array) and the first last, whose rows are
    whole planes copied in slabs on :func:`~lungcal.runtime.parallel.cpu_threads` threads: three times as
    fast as one broadcast copy, whose innermost repeat is copied voxel by voxel."""
    n = mask.shape
    counts = [np.bincount(np.minimum(np.arange(int(s)) // int(t), m - 1), minlength=m)
              for s, t, m in zip(shape, step, n)]
    mid = np.repeat(np.repeat(mask, counts[2], axis=2), counts[1], axis=1)
    out = np.empty(tuple(int(s) for s in shape), mask.dtype)
    starts = np.concatenate([[0], np.cumsum(counts[0])])

    def rows(a: int, b: int) -> None:
        out[starts[a]:starts[b]] = np.repeat(mid[a:b], counts[0][a:b], axis=0)

    map_slabs(rows, n[0])
    return out


def mask_like(mask: np.ndarray, img) -> torch.Tensor:
    """``mask`` as a ``(1, X, Y, Z)`` uint8 0/1 tensor (1 byte per voxel), a MetaTensor with ``img``'s
    geometry when ``img`` is one."""
    mt = torch.from_numpy(np.ascontiguousarray(mask, dtype=bool)[None].view(np.uint8))
    if isinstance(img, MetaTensor):
        return MetaTensor(mt, meta={**img.meta, "affine": img.affine.clone()})
    return mt


def run_masker(masker: Masker, hu: np.ndarray, spacing: Spacing) -> np.ndarray:
    """Call ``masker`` and check what it returns: a boolean array of ``hu.shape``."""
    mask = np.asarray(masker(hu, spacing))
    if mask.shape != hu.shape:
        raise ValueError(f"the lung masker {type(masker).__name__} returned shape {mask.shape}, expected {hu.shape}")
    return mask.astype(bool, copy=False)


def _closing_2d(mask: np.ndarray, radius_mm: float, spacing: np.ndarray) -> np.ndarray:
    """Per-slice closing with a disk of ``radius_mm``, exact in mm, by two Euclidean distance
    transforms of each axial slice. A slice without lung stays empty and one the growth fills whole
    comes out full, as a 3D transform whose z sampling keeps every distance inside its slice gives
    (that form, one transform of the volume, takes twice as long: it also runs the z pass).

    Each slice is transformed on its lung's box padded by more than the radius (clipped to the slice):
    the padding's outer ring is farther than the radius from the lung, so it is background for the
    second transform, and no pixel of the box is nearer to a background pixel outside it than to one on
    that ring; the result is the whole slice's, bit for bit (tested), at the cost of the box."""
    samp = (float(spacing[0]), float(spacing[1]))
    pad = [int(math.ceil(radius_mm / s)) + 1 for s in samp]
    out = np.zeros(mask.shape, bool)
    rows, cols = np.asarray(mask.any(axis=1)), np.asarray(mask.any(axis=0))  # (X, Z), (Y, Z): lung in each slice
    for z in np.flatnonzero(rows.any(axis=0)):
        xs, ys = np.flatnonzero(rows[:, z]), np.flatnonzero(cols[:, z])
        x0, x1 = max(int(xs[0]) - pad[0], 0), min(int(xs[-1]) + 1 + pad[0], mask.shape[0])
        y0, y1 = max(int(ys[0]) - pad[1], 0), min(int(ys[-1]) + 1 + pad[1], mask.shape[1])
        m = mask[x0:x1, y0:y1, z]
        grown = ndi.distance_transform_edt(~m, sampling=samp) <= radius_mm
        if grown.all():  # only where the box is the whole slice: its padding's ring is never grown
            out[:, :, z] = True
        else:
            out[x0:x1, y0:y1, z] = ndi.distance_transform_edt(grown, sampling=samp) > radius_mm
    return out


#: the 13 lines of the 3D grid through a voxel: the axes, the face diagonals and the body diagonals
LINES: tuple[tuple[int, int, int], ...] = tuple((a, b, c) for a, b, c in itertools.product((-1, 0, 1), repeat=3)
                                                if (a, b, c) > (0, 0, 0))


def _sheared(arr: np.ndarray, axis: int, direction: np.ndarray, reach: int) -> np.ndarray:
    """A view of ``arr`` (padded by ``reach`` on both sides of every axis the line moves along, other
    than ``axis``) in which each line ``p + t * direction`` runs along ``axis``: the stride along
    ``axis`` steps along the line. Writable, and no two of its elements share memory."""
    base = arr[tuple(slice(reach, None) if b != axis and direction[b] < 0 else slice(None) for b in range(arr.ndim))]
    strides, shape = list(base.strides), list(base.shape)
    for b in range(arr.ndim):
        if b != axis and direction[b]:
            strides[axis] += int(direction[b]) * base.strides[b]
            shape[b] = arr.shape[b] - reach
    return as_strided(base, tuple(shape), tuple(strides))


def line_closing(mask: np.ndarray, length_vox: int, direction: Sequence[int]) -> np.ndarray:
    """Binary closing of ``mask`` with a line of ``length_vox`` voxels (made odd) along ``direction``
    (steps of -1, 0 or 1 per axis); outside the array is background, so a chord that leaves the array
    is never closed. A voxel comes out True when it is in ``mask`` or lies on a run of background
    shorter than the line with ``mask`` at both ends.

    The dilation and the erosion are ``scipy.ndimage.maximum_filter1d`` / ``minimum_filter1d`` (whose
    cost does not grow with the length) along a view in which the line runs along one axis
    (:func:`_sheared`); the result equals ``ndi.binary_closing`` with the whole line (tested)."""
    d = np.asarray(direction, dtype=int)
    half = max(int(length_vox) // 2, 0)
    if half == 0 or not d.any():
        return np.array(mask, dtype=bool)
    axis = int(np.flatnonzero(d)[0])
    if d[axis] < 0:
        d = -d
    reach = mask.shape[axis] + 2 * half  # how far a line moves sideways while it crosses the array
    pad = [(half, half) if b == axis else (reach, reach) if d[b] else (0, 0) for b in range(mask.ndim)]
    src = np.pad(np.asarray(mask, dtype=np.uint8), pad)
    grown, closed = np.zeros_like(src), np.zeros_like(src)
    size = 2 * half + 1
    ndi.maximum_filter1d(_sheared(src, axis, d, reach), size, axis=axis, output=_sheared(grown, axis, d, reach),
                         mode="constant", cval=0)
    ndi.minimum_filter1d(_sheared(grown, axis, d, reach), size, axis=axis, output=_sheared(closed, axis, d, reach),
                         mode="constant", cval=0)
    return closed[tuple(slice(p[0], p[0] + n) for p, n in zip(pad, mask.shape))].astype(bool)


def span_hull(mask: np.ndarray) -> np.ndarray:
    """Per axial slice, the pixels between two ``mask`` pixels of the same row or of the same column
    (the union of the row spans and the column spans): a vectorised stand-in for the slice's convex
    hull that holds everything the hull of a body cut by the image edge encloses along the edge."""
    def between(axis: int) -> np.ndarray:
        after = np.logical_or.accumulate(mask, axis=axis)
        before = np.flip(np.logical_or.accumulate(np.flip(mask, axis=axis), axis=axis), axis=axis)
        return after & before

    return between(0) | between(1)


@dataclass
class LungMasker:
    """The built-in lung masker (see the module docstring for the steps).

    Args:
        threshold: air/lung threshold (HU).
        body_threshold: body tissue threshold (HU).
        padding_below: values below this are padding outside the reconstruction (HU).
        mask_voxel_mm: the mask is computed on a grid sub-sampled to about this voxel size.
        closing_mm: radius of the 3D closing (mm): vessels and small bumps at the lung surface.
        lesion_closing_mm: radius of the per-slice, per-lung closing (mm) in the axial slices that
            takes back lesions attached to the pleura or hilum; 0 turns the whole closing off (the
            sideways one too).
        lesion_closing_sideways_mm: the radius of the same closing in the coronal and the sagittal
            slices (their union with the axial one), so that a lesion on a part of the pleura that
            faces up or down (the apex, the diaphragm, the corners where the pleura turns), which no
            axial slice shows as a notch, is taken back as well; 0 turns it off.
        second_ratio: the second largest air component is a lung when at least this fraction of
            the largest.
        airway_cut_mm: radius of the erosion that cuts the bronchi between trachea and lungs
            (mm); 0 keeps the airways.
        mass_chord_mm: step 5, masses against the chest wall or the mediastinum: the longest chord
            between two lung voxels (mm) that counts a line as enclosing a voxel; longer than the
            largest mass to take back. 0 turns step 5 off.
        mass_directions: how many of the 13 lines must enclose a voxel for it to be a mass core.
        mass_core_ml: the smallest connected mass core (mL).
        mass_reach_mm: how far from a core (mm) the enclosed voxels are taken with it.
        mass_voxel_mm: the enclosure is counted on the mask sub-sampled to about this voxel size
            (a mass is 5 or more such voxels across; the count costs a 16th of the mask's grid).
    """

    threshold: float = -400.0
    body_threshold: float = -500.0
    padding_below: float = -1500.0
    mask_voxel_mm: float = 3.0
    closing_mm: float = 6.0
    lesion_closing_mm: float = 20.0
    lesion_closing_sideways_mm: float = 20.0
    second_ratio: float = 0.15
    airway_cut_mm: float = 5.0
    mass_chord_mm: float = 80.0
    mass_directions: int = 8
    mass_core_ml: float = 2.0
    mass_reach_mm: float = 25.0
    mass_voxel_mm: float = 6.0

    def __call__(self, hu: np.ndarray, spacing: Spacing) -> np.ndarray:
        """Boolean lung mask of the HU volume ``hu`` ``(X, Y, Z)`` with voxel size ``spacing`` mm."""
        spacing = np.asarray(spacing, dtype=float)
        coarse, step = coarse_view(hu, spacing, self.mask_voxel_mm)
        mask = self.coarse_mask(coarse, spacing * step)
        if (step == 1).all():
            return mask
        return upsample_nearest(mask, step, hu.shape)

    def config(self) -> dict:
        """The settings, as plain numbers (for logs and cache keys)."""
        return {"class": type(self).__name__, **asdict(self)}

    # ----------------------------------------------------------------------------------------
    def coarse_mask(self, coarse: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Steps 1-5 on an already sub-sampled volume with voxel size ``cs`` mm."""
        inside = self.air_inside_body(coarse, cs)
        lungs = self._drop_airways(inside, cs)
        if not lungs.any():
            return lungs
        return self._close(lungs, cs)

    def air_inside_body(self, coarse: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Steps 1-2: the air enclosed by the body (lungs, airways, bowel gas)."""
        valid = coarse > self.padding_below
        air = (coarse < self.threshold) & valid
        body = largest_component(coarse > self.body_threshold)
        filled = fill_holes_2d(body)
        inside = air & filled
        on_edge = body[0].any(axis=0) | body[-1].any(axis=0) | body[:, 0].any(axis=0) | body[:, -1].any(axis=0)
        if on_edge.any():  # the field of view cuts the patient: take back the lungs it cuts
            inside |= self._cut_by_fov(air & ~filled, body, np.flatnonzero(on_edge))
        return inside

    @staticmethod
    def _cut_by_fov(outside_air: np.ndarray, body: np.ndarray, slices: np.ndarray) -> np.ndarray:
        """The components of the air outside the filled body that lie mostly within the body's
        spans (:func:`span_hull`) in the slices where the body touches the image edge."""
        labels, n = ndi.label(outside_air)
        if n == 0:
            return np.zeros_like(outside_air)
        hull = np.zeros_like(body)
        hull[:, :, slices] = span_hull(body[:, :, slices])
        total = np.bincount(labels.ravel(), minlength=n + 1)
        within = np.bincount(labels[hull], minlength=n + 1)
        keep = np.flatnonzero(within >= 0.5 * np.maximum(total, 1))
        keep = keep[keep > 0]
        return np.isin(labels, keep) if keep.size else np.zeros_like(outside_air)

    def _drop_airways(self, inside: np.ndarray, cs: np.ndarray) -> np.ndarray:
        core = inside
        cut = self.airway_cut_mm / cs
        if self.airway_cut_mm > 0 and (cut >= 1).any():
            core = ndi.binary_erosion(inside, structure=ball(cut))
            if not core.any():
                core = inside
        labels, n = ndi.label(core)
        if n == 0:
            return np.zeros_like(inside)
        sizes = np.bincount(labels.ravel(), minlength=n + 1).astype(np.int64)
        sizes[0] = 0
        order = np.argsort(-sizes)[:2]
        keep = [int(order[0])]
        if len(order) > 1 and sizes[order[1]] > 0 and sizes[order[1]] >= self.second_ratio * sizes[order[0]]:
            keep.append(int(order[1]))
        mask = np.isin(labels, keep)
        if core is not inside:  # grow the kept lungs back inside the air they came from
            mask = ndi.binary_dilation(mask, structure=ball(cut)) & inside
        return mask

    def _close(self, mask: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Steps 4-5 on the lung box (padded by the closing radii) only."""
        rad = self.closing_mm / cs
        # step 5 adds only voxels between lung voxels
        reach = max(self.closing_mm, self.lesion_closing_mm, self.lesion_closing_sideways_mm)
        pad = np.ceil(reach / cs).astype(int) + 1
        nz = [np.flatnonzero(mask.any(axis=tuple(a for a in range(3) if a != ax))) for ax in range(3)]
        lo = [int(v[0]) for v in nz]
        hi = [int(v[-1]) + 1 for v in nz]
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        sub = np.pad(mask[box], [(p, p) for p in pad])
        sub = ndi.binary_fill_holes(sub)
        sub = fill_holes_2d(sub)  # vessels entering at the hilum are not closed cavities in 3D
        if (rad >= 1).any():
            sub = ndi.binary_closing(sub, structure=ball(rad))
        closed = sub
        if self.lesion_closing_mm > 0:
            closed = sub | self._lesion_closing(sub, cs, {2: self.lesion_closing_mm})
        if self.mass_chord_mm > 0:  # mass cores are what the axial closing left out
            closed = closed | self._masses(sub, closed, cs)
        if self.lesion_closing_mm > 0 and self.lesion_closing_sideways_mm > 0:
            closed |= self._sideways(sub, cs)
        sub = closed
        out = np.zeros(mask.shape, bool)
        out[box] = sub[tuple(slice(p, p + b - a) for p, a, b in zip(pad, lo, hi))]
        return out

    @staticmethod
    def _halves(lungs: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]]:
        """The x ranges of the two lungs: split halfway across the lungs' x extent."""
        xs = np.flatnonzero(lungs.any(axis=(1, 2)))
        centre = int(round((xs[0] + xs[-1]) / 2))
        return (0, centre), (centre, lungs.shape[0])

    def enclosure(self, lungs: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Step 5's count, per voxel outside ``lungs``, of the 13 lines (:data:`LINES`) along which the
        same lung lies on both sides within ``mass_chord_mm`` (int8, 0 inside ``lungs``)."""
        count = np.zeros(lungs.shape, np.int8)
        if not lungs.any():  # e.g. a thin volume whose coarse view lost the lung
            return count
        for x0, x1 in self._halves(lungs):
            half = lungs[x0:x1]
            if not half.any():
                continue
            for line in LINES:
                n = int(round(self.mass_chord_mm / float(np.linalg.norm(np.asarray(line) * cs)))) | 1
                count[x0:x1] += line_closing(half, n, line) & ~half
        return count

    def _masses(self, lungs: np.ndarray, closed: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Step 5 (module docstring) on the lung box: the mass cores left out of ``closed`` and the
        enclosed voxels within ``mass_reach_mm`` of them."""
        small, step = coarse_view(lungs, cs, self.mass_voxel_mm)
        count = self.enclosure(np.ascontiguousarray(small), cs * step)
        if (step > 1).any():
            count = upsample_nearest(count, step, lungs.shape)
        core = (count >= self.mass_directions) & ~closed
        if not core.any():
            return core
        labels, n = ndi.label(core)
        ml = np.bincount(labels.ravel(), minlength=n + 1) * float(np.prod(cs)) / 1000.0
        keep = np.flatnonzero(ml >= self.mass_core_ml)
        keep = keep[keep > 0]
        if keep.size == 0:
            return np.zeros_like(core)
        core = np.isin(labels, keep)
        near = ndi.distance_transform_edt(~core, sampling=cs) <= self.mass_reach_mm
        enclosed, _ = ndi.label((count > 0) & ~closed)  # never across the lung to another pocket
        reached = np.unique(enclosed[core])
        return core | (near & np.isin(enclosed, reached[reached > 0]))

    def _sideways(self, lungs: np.ndarray, cs: np.ndarray) -> np.ndarray:
        """Step 4's closing in the coronal and sagittal slices (on the mask's own grid: on a grid twice as
        coarse, which costs a fifth, the solid CPM on phantoms fell from 0.895 to 0.847)."""
        r = self.lesion_closing_sideways_mm
        return self._lesion_closing(lungs, cs, {1: r, 0: r}) & ~lungs

    def _lesion_closing(self, lungs: np.ndarray, cs: np.ndarray, radii: dict[int, float]) -> np.ndarray:
        """Per-slice closing of each lung separately (split halfway across the lungs' x extent), each on
        its own box padded by the radius; ``radii``: the slicing axis (2 axial, 1 coronal, 0 sagittal) ->
        the disk's radius (mm). The union over the slicing axes."""
        radii = {a: float(r) for a, r in radii.items() if r > 0}
        pad = np.ceil(max(radii.values()) / cs).astype(int) + 1
        out = np.zeros_like(lungs)
        for x0, x1 in self._halves(lungs):
            half = lungs[x0:x1]
            if not half.any():
                continue
            idx = [np.flatnonzero(half.any(axis=tuple(b for b in range(3) if b != a))) for a in range(3)]
            lo = np.array([int(v[0]) for v in idx])
            hi = np.array([int(v[-1]) + 1 for v in idx])
            # padded in the axes some slice's plane spans: the closing reaches that far past the lung
            span = [any(a != s for s in radii) for a in range(3)]
            p = np.where(span, pad, 0)
            sub = np.pad(half[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]], [(int(v), int(v)) for v in p])
            closed = np.zeros_like(sub)
            for s, r in radii.items():  # the slicing axis last: _closing_2d closes every plane across it
                moved = np.moveaxis(sub, s, 2)
                sp = np.r_[np.delete(cs, s), cs[s]]
                closed |= np.moveaxis(_closing_2d(moved, r, sp), 2, s)
            # back onto the half's grid, clipped to the half (never across the midline) and the array
            g0 = np.array([x0, 0, 0]) + lo - p
            lim_lo = np.array([x0, 0, 0])
            lim_hi = np.array([x1, lungs.shape[1], lungs.shape[2]])
            a = np.maximum(g0, lim_lo)
            b = np.minimum(g0 + np.array(closed.shape), lim_hi)
            out[a[0]:b[0], a[1]:b[1], a[2]:b[2]] |= closed[a[0] - g0[0]:b[0] - g0[0], a[1] - g0[1]:b[1] - g0[1],
                                                           a[2] - g0[2]:b[2] - g0[2]]
        return out
