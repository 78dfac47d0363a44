"""The MMD permutation test's statistic and a whole site assessment, timed against a plain baseline.

    python scripts/bench_shift.py [--repeats 5]

The kernel MMD^2 of a batch of 64 permutations (:func:`lungcal.calibration.shift._mmd2`, a quadratic form,
one matrix product) against the plain block means it replaced (three gathered ``n x n`` blocks per
permutation, written out here), at a site check's sizes (a matched reference subsample of 60-150 cases and
a site of 30-120 CTs); then one :func:`lungcal.ctapp.evaluate.site_assessment.assess` with embeddings (1000
permutations, 20 subsamples), the function that ``lungcal site-check``, ``predict --site`` and ``lungcal
monitor`` call, with either statistic (both under the test's one-BLAS-thread limit). Synthetic Gaussian
embeddings; only the time is measured.
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import numpy as np

from lungcal.calibration import shift
from lungcal.ctapp.evaluate.site_assessment import Reference, assess


def block_means(kernel: np.ndarray, nx: int, order: np.ndarray) -> np.ndarray:
    """The plain baseline: the three block means of the pooled kernel matrix, per permutation."""
    x, y = order[..., :nx], order[..., nx:]
    kxx = kernel[x[..., :, None], x[..., None, :]].mean(axis=(-2, -1))
    kyy = kernel[y[..., :, None], y[..., None, :]].mean(axis=(-2, -1))
    kxy = kernel[x[..., :, None], y[..., None, :]].mean(axis=(-2, -1))
    return kxx + kyy - 2 * kxy


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| pooled cases (reference + site) | block means, ms | quadratic form, ms | ratio | max difference |")
    print("|---|---|---|---|---|")
    for nx, ny in ((60, 30), (100, 60), (150, 120)):
        n = nx + ny
        x = rng.normal(size=(n, 8))
        kernel = np.exp(-((x[:, None] - x[None]) ** 2).sum(-1) / 8)
        order = np.stack([rng.permutation(n) for _ in range(64)])
        t_old = _median_s(lambda k=kernel, m=nx, o=order: block_means(k, m, o), args.repeats)
        t_new = _median_s(lambda k=kernel, m=nx, o=order: shift._mmd2(k, m, o), args.repeats)
        diff = float(np.abs(block_means(kernel, nx, order) - shift._mmd2(kernel, nx, order)).max())
        print(f"| {nx} + {ny} | {1000 * t_old:.2f} | {1000 * t_new:.2f} | {t_old / t_new:.1f} | {diff:.1e} |")
    ref = Reference(rng.random(200), (rng.random(200) < 0.4).astype(int), rng.normal(size=(200, 64)), "bench")
    print("\n| site CTs | assess with block means, s | assess, s | ratio | same verdict and p-values |")
    print("|---|---|---|---|---|")
    for n in (30, 60, 120):
        s, f = rng.random(n), rng.normal(size=(n, 64))
        new = assess(ref, s, f, {})
        t_new = _median_s(lambda s=s, f=f: assess(ref, s, f, {}), max(1, args.repeats // 2))
        with mock.patch.object(shift, "_mmd2", block_means):
            old = assess(ref, s, f, {})
            t_old = _median_s(lambda s=s, f=f: assess(ref, s, f, {}), max(1, args.repeats // 2))
        same = old["verdict"] == new["verdict"] and all(
            old["tests"][k]["pvalue"] == new["tests"][k]["pvalue"] for k in new["tests"])
        print(f"| {n} | {t_old:.2f} | {t_new:.2f} | {t_old / t_new:.1f} | {same} |")


if __name__ == "__main__":
    main()
