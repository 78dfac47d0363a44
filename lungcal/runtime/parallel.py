"""CPU numerics on several threads: slabs of a volume mapped over a thread pool.

scipy.ndimage's filters and numpy's ufuncs release the GIL on large arrays, so one CT's detector
and preprocessing can use the cores a single process has, with threads (no copies, no pickling).
How many: :func:`cpu_threads`, which is torch's thread count, the one knob a run already sets
(``OMP_NUM_THREADS``, ``torch.set_num_threads``). The bag cache's worker processes set it to 1
(:mod:`lungcal.candidates.cache`), so a cohort's bag pass stays one thread a worker and does not
oversubscribe the cores; one CT in one process (``lungcal predict``, ``scripts/bench_ct.py``) gets
them all.

Every helper here splits its work so that each output element is computed by the same arithmetic
as the one-thread call, so results are bit-identical whatever the thread count (the tests compare
them).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
from scipy import ndimage

__all__ = ["cpu_threads", "gaussian_filter_", "map_ordered", "map_slabs", "spans"]

T = TypeVar("T")


def cpu_threads() -> int:
    """Threads the CPU numerics of one process may use: ``torch.get_num_threads()`` (at least 1)."""
    return max(1, int(torch.get_num_threads()))


def spans(n: int, parts: int) -> list[tuple[int, int]]:
    """``[a, b)`` ranges that cut ``range(n)`` into at most ``parts`` near-equal, non-empty pieces."""
    parts = max(1, min(int(parts), int(n)))
    edges = np.linspace(0, n, parts + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


#: one pool per thread count, kept for the process's life (a detection maps a few hundred slabs; a pool
#: made per call cost 5 % of it); emptied in a forked child, whose copies of the threads do not run
_POOLS: dict[int, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()
_IN_POOL = threading.local()


def _after_fork_in_child() -> None:
    global _LOCK
    _POOLS.clear()
    _LOCK = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(threads: int) -> ThreadPoolExecutor:
    with _LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lungcal",
                                                        initializer=setattr, initargs=(_IN_POOL, "on", True))
        return pool


def map_ordered(fn: Callable[..., T], items: Sequence, threads: int | None = None) -> list[T]:
    """``[fn(*item) for item in items]``, on up to ``threads`` threads (default :func:`cpu_threads`),
    in the items' order; one thread, one item, or a call from inside a pool thread (no nesting, so no
    deadlock) runs in the caller's thread. An exception in ``fn`` is raised here."""
    threads = cpu_threads() if threads is None else max(1, int(threads))
    if threads == 1 or len(items) <= 1 or getattr(_IN_POOL, "on", False):
        return [fn(*item) for item in items]
    return list(_pool(threads).map(lambda item: fn(*item), items))


def map_slabs(fn: Callable[[int, int], T], n: int) -> list[T]:
    """``fn(a, b)`` for slabs ``[a, b)`` of ``range(n)``, two a thread (:func:`cpu_threads`), in order: the
    usual cut of an axis whose slabs need no halo (copies, element-wise work)."""
    return map_ordered(fn, spans(n, 2 * cpu_threads()))


def gaussian_filter_(vol: np.ndarray, sigma: float | Sequence[float] | np.ndarray, *, mode: str = "nearest",
                     truncate: float = 4.0, threads: int | None = None) -> np.ndarray:
    """``scipy.ndimage.gaussian_filter(vol, sigma, output=vol, mode=mode, truncate=truncate)`` in place
    on a 3D float array, on up to ``threads`` threads; bit-identical to it.

    The Gaussian is separable and scipy filters axis by axis, line by line (each line through a buffer,
    so in place is safe). Here the lines of one axis are cut between threads along another axis: the
    first axis's lines in pieces of the second axis, the others' in pieces of the first. Each line is
    filtered by the same 1D call as in ``gaussian_filter``, so no halo is needed and every value is the
    same.
    """
    if vol.ndim != 3:
        raise ValueError(f"expected a 3D volume, got shape {vol.shape}")
    sig = [float(s) for s in np.broadcast_to(np.asarray(sigma, np.float64), (3,))]
    threads = cpu_threads() if threads is None else max(1, int(threads))
    for axis in range(3):
        if sig[axis] <= 1e-15:  # as gaussian_filter: an axis of no width is left alone
            continue
        cut = 1 if axis == 0 else 0

        def run(a: int, b: int, axis: int = axis, cut: int = cut) -> None:
            piece = vol[(slice(None),) * cut + (slice(a, b),)]
            ndimage.gaussian_filter1d(piece, sig[axis], axis=axis, output=piece, mode=mode, truncate=truncate)

        map_ordered(run, spans(vol.shape[cut], threads), threads)
    return vol
