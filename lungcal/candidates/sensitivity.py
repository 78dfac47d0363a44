"""Does a lesion reach the bag? Per-lesion scoring of a CT's candidates against known lesions.

A bag holds the patches of a CT's best ``K`` candidates (:func:`lungcal.candidates.bags.extract_bag`:
``P`` voxels a side, starting ``P // 2`` voxels before the centre voxel). A lesion **is in the bag**
when:

- (a nodule) some bag patch holds the lesion's centre at least ``margin_mm`` (5 mm) inside each of
  its faces, so the model sees the lesion, not a sliver of it;
- (a mass, larger than a patch) some bag candidate lies on it: within its radius of its centre.

Its **rank** is the 1-based place of the best candidate that qualifies in the detector's whole
ranking (0: none does), so ``in bag = 0 < rank <= K``; a larger ``K`` is read off the same ranking.
:func:`wilson_interval` gives the share's 95 % interval.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

__all__ = ["holds_centre", "lesion_ranks", "wilson_interval"]


def holds_centre(lesion_vox: np.ndarray, centres_vox: np.ndarray, patch_size: int, spacing: Sequence[float],
                 margin_mm: float = 5.0) -> np.ndarray:
    """``(L, N)`` bool: does the patch of candidate ``n`` (integer centre voxel, ``patch_size`` voxels
    a side) hold lesion ``l``'s centre (fractional voxel coordinates on the same grid) at least
    ``margin_mm`` inside every face?"""
    les = np.asarray(lesion_vox, np.float64).reshape(-1, 1, 3)
    cen = np.asarray(centres_vox, np.float64).reshape(1, -1, 3)
    sp = np.asarray(spacing, np.float64).reshape(1, 1, 3)
    p = int(patch_size)
    lo = cen - p // 2 - 0.5  # the patch's faces, voxel centres at integers
    hi = lo + p
    return np.all(((les - lo) * sp >= margin_mm) & ((hi - les) * sp >= margin_mm), axis=2)


def lesion_ranks(lesion_world: np.ndarray, radius_mm: np.ndarray, is_mass: np.ndarray, cand_voxel: np.ndarray,
                 cand_world: np.ndarray, affine: np.ndarray, patch_size: int, margin_mm: float = 5.0) -> np.ndarray:
    """``(L,)`` int: each lesion's rank in the candidate list (1-based, 0 = not reached; see the
    module docstring). ``cand_*`` are the detector's candidates best first, on the grid of ``affine``."""
    lesion_world = np.asarray(lesion_world, np.float64).reshape(-1, 3)
    n_les, n_cand = len(lesion_world), len(cand_voxel)
    if n_cand == 0 or n_les == 0:
        return np.zeros(n_les, np.int64)
    affine = np.asarray(affine, np.float64)
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    les_vox = (lesion_world - affine[:3, 3]) @ np.linalg.inv(affine[:3, :3]).T
    ok = holds_centre(les_vox, cand_voxel, patch_size, spacing, margin_mm)
    on = np.linalg.norm(np.asarray(cand_world)[None] - lesion_world[:, None], axis=2) <= np.asarray(radius_mm)[:, None]
    ok = np.where(np.asarray(is_mass, bool)[:, None], on | ok, ok)
    return np.where(ok.any(axis=1), ok.argmax(axis=1) + 1, 0).astype(np.int64)


def wilson_interval(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a share ``k / n`` (scipy's ``binomtest``; ``(nan, nan)`` for ``n = 0``)."""
    if n == 0:
        return float("nan"), float("nan")
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)
