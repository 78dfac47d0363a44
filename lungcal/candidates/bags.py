"""Bag extraction: K cubic patches of P^3 voxels around candidate centres.

A bag is ``(K, 1, P, P, P)`` float32 plus a ``(K,)`` bool validity mask. A CT with fewer than K
candidates (or none) gives a bag whose trailing slots are zero patches with ``mask = False``;
MIL models ignore them (:mod:`lungcal.mil`).

The patch around centre ``c`` covers voxels ``c - P//2 ... c - P//2 + P - 1`` on each axis (for odd
``P`` the centre is the middle voxel; for even ``P`` it is voxel ``P//2`` of the patch). Voxels
outside the volume read ``pad_value`` (0 = air after the HU window). The volume is padded once and
all patches are gathered with one fancy-indexing call -- no Python loop over candidates or voxels.
"""
from __future__ import annotations

import numpy as np

from .detector import _as_volume

__all__ = ["extract_bag", "extract_patches"]


def extract_patches(image, centres_vox, patch_size: int, pad_value: float = 0.0) -> np.ndarray:
    """Gather ``(N, P, P, P)`` float32 patches around ``(N, 3)`` integer voxel centres.

    Centres may lie anywhere (even outside the volume); out-of-volume voxels read ``pad_value``.
    """
    vol = _as_volume(image).astype(np.float32, copy=False)
    p = int(patch_size)
    if p < 1:
        raise ValueError(f"patch_size must be >= 1, got {patch_size}")
    centres = np.asarray(centres_vox).reshape(-1, 3)
    if centres.size and not np.issubdtype(centres.dtype, np.integer):
        centres = np.rint(centres)
    centres = centres.astype(np.int64)
    n = len(centres)
    if n == 0:
        return np.zeros((0, p, p, p), np.float32)
    shape = np.asarray(vol.shape)
    lo = centres - p // 2  # (N, 3) patch origin in unpadded coordinates
    # pad once, just enough for every requested patch (centres far outside are clipped to the
    # padded border, which reads pad_value as well)
    before = np.maximum(0, -lo.min(axis=0)).clip(max=p)
    after = np.maximum(0, (lo + p).max(axis=0) - shape).clip(max=p)
    padded = np.pad(vol, list(zip(before, after)), mode="constant", constant_values=pad_value)
    origin = lo + before  # origin in padded coordinates
    # a patch entirely outside the volume: point it at a pad-only region if one exists, else
    # mark it for blanking below
    limit = np.asarray(padded.shape) - p
    outside = np.any((lo + p <= 0) | (lo >= shape), axis=1)
    origin = np.clip(origin, 0, limit)
    ar = np.arange(p)
    ix = (origin[:, 0, None] + ar)[:, :, None, None]
    iy = (origin[:, 1, None] + ar)[:, None, :, None]
    iz = (origin[:, 2, None] + ar)[:, None, None, :]
    patches = padded[ix, iy, iz]  # (N, P, P, P)
    if outside.any():
        patches[outside] = pad_value
    return np.ascontiguousarray(patches, np.float32)


def extract_bag(image, centres_vox, k: int, patch_size: int, pad_value: float = 0.0):
    """Build one MIL bag from the first ``k`` candidate centres.

    Args:
        image: ``(1, X, Y, Z)`` or ``(X, Y, Z)`` volume (numpy array, torch tensor or MetaTensor),
            typically the ``[0, 1]`` output of ``preprocess_ct``.
        centres_vox: ``(N, 3)`` integer voxel centres, best first (``Candidates.voxel``); ``N`` may
            be 0 or smaller than ``k``; extra centres beyond ``k`` are ignored.
        k: bag size K.
        patch_size: patch edge P in voxels.
        pad_value: value of voxels outside the volume and of empty slots.

    Returns:
        ``(bag, mask)``: numpy ``(K, 1, P, P, P)`` float32 and ``(K,)`` bool, ``mask[i]`` True iff
        slot ``i`` holds a real candidate (the first ``min(N, K)`` slots).
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    p = int(patch_size)
    centres = np.asarray(centres_vox).reshape(-1, 3)[:k]
    n = len(centres)
    bag = np.full((k, 1, p, p, p), pad_value, np.float32)
    mask = np.zeros(k, bool)
    if n:
        bag[:n, 0] = extract_patches(image, centres, p, pad_value)
        mask[:n] = True
    return bag, mask
