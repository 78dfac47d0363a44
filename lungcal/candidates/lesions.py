"""The default detector: every lesion type reaches the bag, solid nodules, subsolid nodules and masses.

A bag holds only the best ``K`` candidates, and on a real CT the best-scoring blobs of a single
ranking are solid: vessel crossings and hilar branches outscore a ground-glass nodule, whose
contrast over the lung is a third of a solid one's or less. So :class:`LesionDetector` runs two
channels and **interleaves** their rankings by a fixed pattern of slots, rather than merging them by
score (their scores measure different things and are not comparable):

1. **solid** (``S``): :class:`~lungcal.candidates.detector.LoGBlobDetector` on the CT as windowed,
   with scales up to 35 mm radius (nodules from 3 mm and masses up to 7 cm);
2. **ground glass** (``G``): :class:`GlassChannel`, the LoG search on a ground-glass image: the CT on
   a grid of about 2 mm, median-filtered over about 6 mm (thin vessels and their partial-volume
   voxels, which look like ground glass in this window, drop out; a ground-glass nodule of 8 mm and
   more stays), with the voxels denser than ``dense_hu`` (vessels, solid nodules and cores, the
   chest wall and mediastinum where the mask reaches them) filled in from the lung around them, then
   windowed to ``window_hu`` (-900 to -500 HU). A solid nodule is filled in, so it is no blob here;
   a part-solid one is a blob of its ground-glass halo.

The merged ranking takes, slot by slot, the next candidate of the channel that ``pattern`` names
(``"SSSG"``: three solid, one ground glass, repeated), skipping a candidate whose sphere overlaps one
already taken (closer than ``max(min_distance_mm, r1 + r2)``); a channel that runs out leaves its
slots to the other. So a bag of ``K`` = 8 holds the ground-glass channel's best two, whatever the
solid channel scores. A candidate's ``score`` is the solid channel's own score, a ground-glass
pick's interpolated between its solid neighbours (:func:`interleave` with ``reference="S"``), so
scores stay sorted and comparable across CTs (the FROC, a threshold). The ground-glass channel can
be gated by its own score (``GlassChannel.min_score``; off by default).

Why this pattern and these scores (``experiments/glass_gate.py``; docs/results.md, 2026-12-07):
interleaved ``SG`` and scored by place, the merged ranking lowered the solid CPM on phantoms from
0.903 to 0.689. Scored by the solid channel, ``SG`` gives 0.730 [0.669, 0.798], ``SSG`` 0.857
[0.799, 0.913] and ``SSSG`` 0.893 [0.838, 0.952] (within the CI of the solid channel alone, 0.903
[0.851, 0.957]): a ground-glass pick in the first two places of a CT without ground glass is a
false positive at the FROC's low rates. A gate on the ground-glass score also restores the CPM
(``SG`` at 0.12: 0.889) but drops faint real ground glass whose score depends on the scanner's
noise and kernel; on the tuning draw of the lesion bed (seed 11, default preset, K 8) ``SSSG``
ungated and ``SG`` gated at 0.12 both kept 15 of 20 ground-glass nodules of 10 mm and more at -700
HU or denser (``SG`` ungated 16), so the pattern, which needs no absolute score, was chosen.

Measured on the lesion test bed (lesions inserted into the real CTs of ``../shared``,
:mod:`lungcal.ctapp.evaluate.lesion_bed`; ``lungcal lesion-bed``): ``docs/results.md``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import ndimage

from lungcal.candidates.detector import Candidates, LoGBlobDetector, MaskMemo, _as_volume, _block_mean
from lungcal.ct.masking import Spacing
from lungcal.runtime.parallel import gaussian_filter_, map_ordered

__all__ = ["GlassChannel", "LesionDetector", "interleave", "median_filter"]

#: the solid channel's scales (radius, mm): the LoG detector's, plus 35 mm for masses up to 7 cm
SOLID_RADII_MM = (1.5, 2.5, 3.5, 5.0, 7.0, 10.0, 14.0, 19.0, 25.0, 35.0)

#: the solid channel's scale pyramid (``LoGBlobDetector.pyramid_sigma_vox``): a scale runs on a grid
#: sub-sampled by ``floor(sigma / (2 voxels))``, coarser than the LoG detector's 3. On the lesion bed
#: (461 lesions, 30 a cell) it kept every lesion's bag membership at the default preset and the target
#: cells' counts at full resolution, and the solid CPM on phantoms (0.893 either way), while the solid
#: channel at 1 mm took 2.46 -> 1.99 s on LIDC-IDRI-0314 (docs/results.md, 2026-12-07).
SOLID_PYRAMID_SIGMA_VOX = 2.0


def _fill_dense(hu: np.ndarray, dense: np.ndarray, sigma_vox: np.ndarray, level: float) -> np.ndarray:
    """``hu`` with its ``dense`` voxels replaced by the Gaussian-weighted mean of the other voxels
    around them (a normalised convolution); ``level`` where none is near."""
    keep = (~dense).astype(np.float32)
    num = gaussian_filter_(hu * keep, sigma_vox, mode="reflect", truncate=2.5)
    den = gaussian_filter_(keep, sigma_vox, mode="reflect", truncate=2.5)
    fill = np.where(den > 1e-3, num / np.maximum(den, np.float32(1e-3)), np.float32(level))
    return np.where(dense, fill, hu).astype(np.float32)


def median_filter(vol: np.ndarray, size: Sequence[int], slab: int = 8) -> np.ndarray:
    """``scipy.ndimage.median_filter(vol, size)`` (odd ``size`` per axis, ``mode="reflect"``), bit for bit,
    four to five times as fast: per slab of ``slab`` planes along the first axis, the ``prod(size)``
    shifted copies of the padded slab are stacked and partitioned at their middle (``np.partition``),
    where scipy's rank filter sorts a window per voxel. The scratch is ``prod(size)`` slabs, not volumes,
    per thread (:func:`~lungcal.runtime.parallel.cpu_threads`)."""
    size = tuple(int(s) for s in size)
    if len(size) != 3 or any(s < 1 or s % 2 == 0 for s in size):
        raise ValueError(f"size must be three odd positive ints, got {size}")
    vol = np.asarray(vol)
    half = [s // 2 for s in size]
    # scipy's "reflect" (d c b a | a b c d) is numpy's "symmetric"; a pad wider than the axis
    # repeats it, as scipy does
    pad = np.pad(vol, [(h, h) for h in half], mode="symmetric")
    out = np.empty_like(vol)
    n, (sx, sy, sz) = int(np.prod(size)), size
    X, Y, Z = vol.shape

    def one(a: int) -> None:
        b = min(a + slab, X)
        stack = np.empty((n, b - a, Y, Z), vol.dtype)
        i = 0
        for dx in range(sx):
            for dy in range(sy):
                for dz in range(sz):
                    stack[i] = pad[a + dx: b + dx, dy: dy + Y, dz: dz + Z]
                    i += 1
        out[a:b] = np.partition(stack, n // 2, axis=0)[n // 2]

    map_ordered(one, [(a,) for a in range(0, X, slab)])
    return out


def _coarse(vol: np.ndarray, mask: np.ndarray, spacing: np.ndarray, grid_mm: float
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``vol`` averaged over blocks of about ``grid_mm`` (the mask: the centre voxel of each block),
    and the step per axis."""
    step = np.maximum(1, np.floor(grid_mm / spacing + 1e-6)).astype(np.int64)
    if (step == 1).all():
        return vol, mask, step
    small = _block_mean(vol, step)
    centre = tuple(slice(int(s) // 2, None, int(s)) for s in step)
    m = mask[centre]
    pad = [(0, a - b) for a, b in zip(small.shape, m.shape)]
    m = np.pad(m, pad, mode="edge")[: small.shape[0], : small.shape[1], : small.shape[2]]
    return small, m, step


@dataclass
class GlassChannel:
    """The ground-glass channel (see the module docstring).

    Args:
        hu_window: the HU window that mapped the detector's image to [0, 1] (the pipeline's).
        window_hu: the ground-glass image's window (HU mapped to [0, 1]).
        grid_mm: the channel runs on the image averaged to about this voxel size (ground glass of
            8 mm and more needs no finer grid; at 1 mm it saves most of the cost).
        median_mm: the median filter's width (mm; odd number of voxels), 0 for none.
        dense_hu: voxels denser than this (after the median), grown by one voxel, are filled in from
            the lung around them (``fill_sigma_mm``).
        faint_max_hu: a peak is kept when the median-filtered CT at its centre is at most this; None
            (default) keeps every peak: the fill has already taken solid tissue out of this channel, and
            a part-solid nodule whose core fills its centre is found here by its halo (on the lesion
            bed, without the test the channel's own top 8 held 13 of 16 part-solid nodules of 8 mm and
            more, with -300 HU 10 of 16, and no ground glass was lost).
        radii_mm: the blob radii probed (mm): ground glass of 8-40 mm.
        min_score: a peak is kept when its score (the LoG search's, on the ground-glass image) is at
            least this. A CT without ground glass still has its best ground-glass blobs, each a false
            positive that takes a slot of the merged ranking; above this score, the channel returns
            nothing there and leaves its slots to the solid channel (``None``: keep every peak).
            On phantoms ``SG`` needs 0.12 to keep the solid CPM (0.889 [0.825, 0.943]; ungated
            0.730); on the evaluation draw of the lesion bed (seed 0, default preset) that gate left
            14 of 23 ground-glass nodules of 10 mm and more at -700 HU or denser in the bag against
            19 ungated: :class:`LesionDetector` keeps the gate off and spaces its ground-glass slots
            instead (``pattern``).
        top_k: candidates returned.
        log: other settings of the LoG search (:class:`LoGBlobDetector`'s keyword arguments).
    """

    hu_window: Sequence[float] = (-1000.0, 400.0)
    window_hu: Sequence[float] = (-900.0, -500.0)
    grid_mm: float = 2.0
    median_mm: float = 6.0
    dense_hu: float = -350.0
    fill_sigma_mm: float = 3.75
    faint_max_hu: float | None = None
    radii_mm: Sequence[float] = (5.0, 7.0, 10.0, 14.0, 20.0)
    min_score: float | None = None
    top_k: int = 32
    log: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hu_window = [float(v) for v in self.hu_window]
        self.window_hu = [float(v) for v in self.window_hu]
        self.radii_mm = [float(v) for v in self.radii_mm]
        self.log = dict(self.log)
        if not (self.hu_window[1] > self.hu_window[0] and self.window_hu[1] > self.window_hu[0]):
            raise ValueError(f"windows must have hi > lo, got {self.hu_window} and {self.window_hu}")

    def detect(self, image, lung_mask, spacing: Spacing, affine, *, memo: MaskMemo | None = None) -> Candidates:
        vol = _as_volume(image).astype(np.float32, copy=False)
        mask = _as_volume(lung_mask) > 0
        sp = np.asarray(spacing, np.float64).reshape(3)
        affine = np.asarray(affine, np.float64)
        lo, hi = self.hu_window
        small, m, step = _coarse(vol, mask, sp, self.grid_mm)
        hu = small * np.float32(hi - lo) + np.float32(lo)
        del small
        gsp = sp * step
        size = np.maximum(1, np.round(self.median_mm / gsp).astype(np.int64)) | 1
        med = median_filter(hu, tuple(int(s) for s in size)) if (size > 1).any() else hu
        dense = ndimage.binary_dilation(med > np.float32(self.dense_hu))
        rest = m & ~dense
        level = float(np.median(med[rest])) if rest.any() else float(self.window_hu[0])
        glass = _fill_dense(med, dense, self.fill_sigma_mm / gsp, level)
        glo, ghi = self.window_hu
        np.clip((glass - np.float32(glo)) / np.float32(ghi - glo), 0, 1, out=glass)
        # the coarse grid's affine: voxel i of it is the centre of block i
        gaff = affine.copy()
        gaff[:3, :3] = affine[:3, :3] * step[None, :]
        gaff[:3, 3] = affine[:3, 3] + affine[:3, :3] @ ((step - 1) / 2.0)
        det = LoGBlobDetector(**{**self.log, "radii_mm": self.radii_mm, "top_k": 4 * self.top_k})
        found = det.detect(glass, m, gsp, gaff, memo=memo)
        if len(found) == 0:
            return found
        v = found.voxel
        faint = np.ones(len(found), bool) if self.faint_max_hu is None else \
            med[v[:, 0], v[:, 1], v[:, 2]] <= np.float32(self.faint_max_hu)
        if self.min_score is not None:
            faint &= found.score >= self.min_score
        world = found.world[faint][: self.top_k]
        vox = np.rint((world - affine[:3, 3]) @ np.linalg.inv(affine[:3, :3]).T).astype(np.int64)
        vox = np.clip(vox, 0, np.asarray(vol.shape) - 1)
        return Candidates(vox, world, found.radius_mm[faint][: self.top_k], found.score[faint][: self.top_k])


def interleave(lists: Mapping[str, Candidates], pattern: str, spacing: Spacing, top_k: int,
               min_distance_mm: float = 5.0, reference: str | None = None) -> Candidates:
    """One ranking from per-channel rankings: slot by slot, the next candidate of the channel that
    ``pattern`` names (repeated), skipping candidates that overlap one already taken (spheres closer
    than ``max(min_distance_mm, r1 + r2)``); a channel that runs out gives its slots to the next one
    in the pattern.

    Scores: with ``reference`` (a channel), the reference channel's picks keep their own score and the
    other picks take one interpolated between their reference neighbours (the nearest one's beyond the
    first or the last), so scores stay comparable across CTs, as a FROC or a threshold needs, and a CT
    whose other channels are empty scores as the reference channel alone. Without it (or when the
    reference channel has no pick), the places counted down (``top_k`` for the first)."""
    if not pattern or any(ch not in lists for ch in set(pattern)):
        raise ValueError(f"pattern {pattern!r} must name only the channels {sorted(lists)}")
    sp = np.asarray(spacing, np.float64).reshape(3)
    pos = {ch: c.voxel * sp for ch, c in lists.items()}
    nxt = dict.fromkeys(lists, 0)
    taken_pos: list[np.ndarray] = []
    taken_r: list[float] = []
    picks: list[tuple[str, int]] = []
    slot = 0
    while len(picks) < top_k:
        got = False
        for j in range(len(pattern)):
            ch = pattern[(slot + j) % len(pattern)]
            c = lists[ch]
            while nxt[ch] < len(c):
                i = nxt[ch]
                nxt[ch] += 1
                if taken_pos:
                    reach = np.maximum(min_distance_mm, np.asarray(taken_r) + c.radius_mm[i])
                    if np.any(np.sum((np.asarray(taken_pos) - pos[ch][i]) ** 2, axis=1) < reach ** 2):
                        continue
                picks.append((ch, i))
                taken_pos.append(pos[ch][i])
                taken_r.append(float(c.radius_mm[i]))
                got = True
                break
            if got:
                break
        if not got:
            break
        slot += 1
    if not picks:
        return Candidates()
    vox = np.stack([lists[ch].voxel[i] for ch, i in picks])
    world = np.stack([lists[ch].world[i] for ch, i in picks])
    radius = np.array([lists[ch].radius_mm[i] for ch, i in picks])
    score = np.arange(len(picks), 0, -1, dtype=np.float64)
    ref = np.array([ch == reference for ch, _ in picks], bool)
    if ref.any():
        at = np.flatnonzero(ref)
        own = np.array([lists[ch].score[i] for ch, i in picks if ch == reference], np.float64)
        score = np.interp(np.arange(len(picks)), at, own)  # own scores at the reference picks
    return Candidates(vox, world, radius, score)


@dataclass
class LesionDetector:
    """Solid and ground-glass channels, interleaved (see the module docstring).

    Args:
        solid: keyword arguments of the solid channel's :class:`LoGBlobDetector` (its ``top_k`` is
            ignored); its radii default to :data:`SOLID_RADII_MM` and its ``pyramid_sigma_vox`` to
            :data:`SOLID_PYRAMID_SIGMA_VOX`.
        glass: keyword arguments of :class:`GlassChannel` (its ``hu_window`` is ``hu_window``).
        pattern: the slots, one letter a channel (``S`` solid, ``G`` ground glass), repeated. ``"SSSG"``
            was chosen among ``SG``, ``SSG`` and ``SSSG``, each with gates of the ground-glass
            channel from none to 0.12, on phantoms (the solid CPM) and on a tuning draw of the lesion
            bed (seed 11, default preset, K = 8; 126 lesions): the module docstring.
        top_k: candidates returned.
        hu_window: the HU window the pipeline applied (the CT bundles' -1000..400 HU by default; a
            bundle passes ``"@hu_window"``).
    """

    solid: Mapping[str, Any] = field(default_factory=dict)
    glass: Mapping[str, Any] = field(default_factory=dict)
    pattern: str = "SSSG"
    top_k: int = 32
    hu_window: Sequence[float] = (-1000.0, 400.0)

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        self.solid = dict(self.solid)
        self.glass = dict(self.glass)
        self.hu_window = [float(v) for v in self.hu_window]
        if not self.pattern or set(self.pattern) - {"S", "G"}:
            raise ValueError(f"pattern must be a string of S (solid) and G (ground glass), got {self.pattern!r}")
        self._channels()  # fails early on a bad setting

    def config(self) -> dict[str, Any]:
        """The arguments that rebuild it (JSON): the bag cache's key and a checkpoint's record."""
        return {"_target_": f"{type(self).__module__}.{type(self).__qualname__}",
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def _channels(self) -> dict[str, Any]:
        solid = {"radii_mm": SOLID_RADII_MM, "pyramid_sigma_vox": SOLID_PYRAMID_SIGMA_VOX, **self.solid}
        return {"S": LoGBlobDetector(**{**solid, "top_k": self.top_k}),
                "G": GlassChannel(**{**self.glass, "hu_window": self.hu_window, "top_k": self.top_k})}

    def detect(self, image, lung_mask, spacing: Spacing, affine) -> Candidates:
        """Both channels' candidates, interleaved by ``pattern``; at most ``top_k``."""
        if self.top_k == 0:
            return Candidates()
        vol = _as_volume(image).astype(np.float32, copy=False)
        mask = _as_volume(lung_mask) > 0
        chans = self._channels()
        used = set(self.pattern)
        memo = MaskMemo()  # the channels close the same lung mask once
        lists = {ch: det.detect(vol, mask, spacing, affine, memo=memo) for ch, det in chans.items() if ch in used}
        min_d = float(chans["S"].min_distance_mm)
        return interleave(lists, self.pattern, spacing, self.top_k, min_d, reference="S" if "S" in used else None)
