"""lungcal.runtime.parallel: slabs on threads give the one-thread results bit for bit; the CT path's
threaded steps (detector, masks, resampling, loading) against their one-thread or scipy selves."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch
from scipy import ndimage

from lungcal.candidates.detector import LoGBlobDetector, _block_mean, _distance_above
from lungcal.candidates.lesions import LesionDetector, median_filter
from lungcal.ct.masking import upsample_nearest
from lungcal.runtime.parallel import cpu_threads, gaussian_filter_, map_ordered, spans


@pytest.fixture
def threads():
    """Run the body with torch (hence lungcal's CPU numerics) at a given thread count, then restore it."""
    before = torch.get_num_threads()

    def set_(n: int) -> None:
        torch.set_num_threads(n)

    yield set_
    torch.set_num_threads(before)


def test_cpu_threads_follows_torch(threads):
    threads(3)
    assert cpu_threads() == 3
    threads(1)
    assert cpu_threads() == 1


@pytest.mark.parametrize("n,parts", [(10, 3), (3, 8), (1, 1), (100, 7)])
def test_spans_cut_a_range_into_nonempty_pieces(n, parts):
    s = spans(n, parts)
    assert s[0][0] == 0 and s[-1][1] == n and len(s) == min(n, parts)
    assert all(b > a for a, b in s) and all(s[i][1] == s[i + 1][0] for i in range(len(s) - 1))


def test_map_ordered_keeps_order_raises_and_does_not_nest():
    seen: set[str] = set()

    def square(i):
        seen.add(threading.current_thread().name)
        return i * i

    assert map_ordered(square, [(i,) for i in range(50)], threads=3) == [i * i for i in range(50)]
    assert any(name.startswith("lungcal") for name in seen)  # it did use the pool

    def boom(i):
        if i == 7:
            raise ValueError("seven")
        return i

    with pytest.raises(ValueError, match="seven"):
        map_ordered(boom, [(i,) for i in range(10)], threads=2)

    def outer(i):  # a map inside a pool thread runs in that thread: no deadlock on a full pool
        return sum(map_ordered(lambda j: j + i, [(j,) for j in range(4)], threads=2))

    assert map_ordered(outer, [(i,) for i in range(6)], threads=2) == [6 + 4 * i for i in range(6)]


def test_a_forked_child_makes_its_own_pool():
    """The parent's pool threads do not exist in a forked child (a bag worker, a DataLoader worker): the
    child must not hand work to them (it would wait forever; the alarm turns that into a failure)."""
    assert map_ordered(lambda i: i, [(i,) for i in range(4)], threads=2) == [0, 1, 2, 3]  # the parent's pool
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            signal.alarm(20)
            code = 0 if map_ordered(lambda i: i + 1, [(i,) for i in range(8)], threads=2) == list(range(1, 9)) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("mode,truncate", [("nearest", 3.0), ("reflect", 2.5), ("constant", 4.0)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_gaussian_filter_in_place_is_scipys_bit_for_bit(mode, truncate, n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=(23, 31, 17)).astype(np.float32)
    sigma = (1.7, 0.0, 2.3)  # an axis of no width is left alone, as scipy does
    want = ndimage.gaussian_filter(x, sigma, mode=mode, truncate=truncate)
    got = x.copy()
    assert gaussian_filter_(got, sigma, mode=mode, truncate=truncate, threads=n) is got
    np.testing.assert_array_equal(got, want)


def test_gaussian_filter_refuses_a_2d_array():
    with pytest.raises(ValueError, match="3D"):
        gaussian_filter_(np.zeros((4, 4), np.float32), 1.0)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_distance_above_is_the_distance_transform_in_slabs(threads, n):
    """Against scipy on the whole volume, with slabs that hold no zero at all (the lungs' far end)."""
    threads(n)
    rng = np.random.default_rng(n)
    x = ndimage.binary_dilation(rng.random((60, 20, 18)) > 0.995, iterations=2)
    x[30:] = False  # rows 30-59 hold no mask voxel: ~x has no zero there
    spacing = np.array([2.0, 1.5, 1.5])
    for r in (2.0, 4.0, 8.0):
        want = ndimage.distance_transform_edt(~x, sampling=spacing) > r
        np.testing.assert_array_equal(_distance_above(~x, r, spacing), want)


@pytest.mark.parametrize("shape", [(512 // 8, 40, 30), (61, 41, 31), (66, 45, 33)])
def test_upsample_nearest_repeats_crops_and_extends_the_last_block(shape):
    rng = np.random.default_rng(0)
    m = rng.random((21, 13, 10)) > 0.5
    step = (3, 3, 3)
    idx = np.ix_(*[np.minimum(np.arange(s) // t, n - 1) for s, t, n in zip(shape, step, m.shape)])
    np.testing.assert_array_equal(upsample_nearest(m, step, shape), m[idx])


def test_the_threaded_steps_match_one_thread(threads):
    rng = np.random.default_rng(5)
    vol = ndimage.gaussian_filter(rng.normal(size=(50, 46, 40)), 2).astype(np.float32)
    vol = (vol - vol.min()) / (vol.max() - vol.min())
    mask = np.zeros(vol.shape, bool)
    mask[5:45, 6:40, 4:36] = True
    out = {}
    for n in (1, 2, 3):
        threads(n)
        det = LoGBlobDetector(radii_mm=(1.5, 3.5, 7.0, 14.0), pyramid_sigma_vox=2.0, top_k=20)
        out[n] = (_block_mean(vol, (2, 3, 1)), median_filter(vol, (3, 5, 3), slab=4),
                  det.detect(vol, mask, (1.0, 1.0, 1.0), np.eye(4)).to_dict(),
                  LesionDetector(top_k=12).detect(vol, mask, (1.0, 1.0, 1.0), np.eye(4)).to_dict())
    for n in (2, 3):
        np.testing.assert_array_equal(out[n][0], out[1][0])
        np.testing.assert_array_equal(out[n][1], out[1][1])
        for k in out[1][2]:
            np.testing.assert_array_equal(out[n][2][k], out[1][2][k])
            np.testing.assert_array_equal(out[n][3][k], out[1][3][k])
    assert len(out[1][2]["score"]) > 0 and len(out[1][3]["score"]) > 0
