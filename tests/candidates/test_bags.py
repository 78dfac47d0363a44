"""extract_bag / extract_patches against a naive per-voxel reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lungcal.candidates.bags import extract_bag, extract_patches


def _naive_patch(vol, c, p, pad):
    out = np.full((p, p, p), pad, np.float32)
    lo = np.asarray(c) - p // 2
    for i in range(p):
        for j in range(p):
            for k in range(p):
                x, y, z = lo + (i, j, k)
                if 0 <= x < vol.shape[0] and 0 <= y < vol.shape[1] and 0 <= z < vol.shape[2]:
                    out[i, j, k] = vol[x, y, z]
    return out


@pytest.mark.parametrize("p", [5, 8])
def test_matches_naive_reference_including_borders_and_outside(p):
    rng = np.random.default_rng(1)
    vol = rng.random((13, 11, 9)).astype(np.float32)
    centres = np.array([[6, 5, 4], [0, 0, 0], [12, 10, 8], [1, 10, 2], [-3, 5, 4], [30, 30, 30], [-40, 2, 2]])
    got = extract_patches(vol, centres, p, pad_value=-1.0)
    ref = np.stack([_naive_patch(vol, c, p, -1.0) for c in centres])
    np.testing.assert_array_equal(got, ref)


def test_bag_shapes_mask_and_fewer_than_k():
    vol = torch.rand(1, 20, 20, 20)
    centres = np.array([[10, 10, 10], [0, 19, 5]])
    bag, mask = extract_bag(vol, centres, k=4, patch_size=6)
    assert bag.shape == (4, 1, 6, 6, 6) and bag.dtype == np.float32
    assert mask.tolist() == [True, True, False, False]
    assert np.all(bag[2:] == 0)
    np.testing.assert_array_equal(bag[0, 0], vol[0, 7:13, 7:13, 7:13].numpy())
    # more than k centres: the first k (best) are used
    many = np.tile(np.array([[10, 10, 10]]), (7, 1))
    bag, mask = extract_bag(vol, many, k=3, patch_size=4)
    assert bag.shape == (3, 1, 4, 4, 4) and mask.all()


def test_zero_candidates():
    bag, mask = extract_bag(np.zeros((1, 8, 8, 8)), np.zeros((0, 3), np.int64), k=5, patch_size=4)
    assert bag.shape == (5, 1, 4, 4, 4) and not mask.any()
    assert extract_patches(np.zeros((8, 8, 8)), np.zeros((0, 3)), 4).shape == (0, 4, 4, 4)


def test_odd_patch_is_centred_and_fractional_centres_round():
    vol = np.zeros((9, 9, 9), np.float32)
    vol[4, 4, 4] = 1.0
    patch = extract_patches(vol, [[4.2, 3.8, 4.0]], 3)[0]
    assert patch[1, 1, 1] == 1.0 and patch.sum() == 1.0


def test_bad_shapes():
    with pytest.raises(ValueError):
        extract_bag(np.zeros((2, 4, 4, 4)), [[1, 1, 1]], 1, 2)
    with pytest.raises(ValueError):
        extract_bag(np.zeros((4, 4, 4)), [[1, 1, 1]], -1, 2)
