"""Benchmark: lungcal.calibration ECE vs torchmetrics / netcal; temperature scaling vs netcal.

Run: python scripts/bench_calibration.py [--n 2000000] [--classes 10] [--repeat 3]
Prints times (best of --repeat), ratios and the value differences.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from lungcal.calibration.metrics import ece
from lungcal.calibration.scaling import TemperatureScaler


def best_time(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=2_000_000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--n-bins", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ts-n", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from netcal.metrics import ECE as NetcalECE
    from netcal.scaling import TemperatureScaling
    from torchmetrics.functional.classification import multiclass_calibration_error

    rng = np.random.default_rng(0)
    z = rng.normal(size=(args.n, args.classes)).astype(np.float32) * 3
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = np.where(rng.uniform(size=args.n) < 0.7, p.argmax(1), rng.integers(0, args.classes, args.n))
    pt, yt = torch.from_numpy(p), torch.from_numpy(y)
    print(f"ECE on {args.n:,} x {args.classes} float32 probabilities, {args.n_bins} bins "
          f"(best of {args.repeat}, {args.threads} torch threads)")
    t_ours, v_ours = best_time(lambda: ece(p, y, args.n_bins), args.repeat)
    t_tm, v_tm = best_time(lambda: multiclass_calibration_error(
        pt, yt, args.classes, n_bins=args.n_bins).item(), args.repeat)
    keep = p.max(1) < 1.0  # torchmetrics puts confidence == 1.0 into an extra bin (by design)
    v_tm64 = multiclass_calibration_error(pt[keep].double(), yt[keep], args.classes,
                                          n_bins=args.n_bins).item()
    v_ours_keep = ece(p[keep], y[keep], args.n_bins)
    t_nc, v_nc = best_time(lambda: NetcalECE(bins=args.n_bins).measure(p, y), 1)
    print(f"  lungcal      {t_ours * 1e3:9.1f} ms   ece={v_ours:.9f}")
    print(f"  torchmetrics {t_tm * 1e3:9.1f} ms   ece={v_tm:.9f}   speed-up x{t_tm / t_ours:.1f}"
          f"   |diff|={abs(v_ours - v_tm):.2e}")
    print(f"  netcal       {t_nc * 1e3:9.1f} ms   ece={v_nc:.9f}   speed-up x{t_nc / t_ours:.1f}"
          f"   |diff|={abs(v_ours - v_nc):.2e}")
    print(f"  {int((~keep).sum())} rows have confidence == 1.0; without them, torchmetrics (float64) "
          f"ece={v_tm64:.9f} vs lungcal {v_ours_keep:.9f}   |diff|={abs(v_ours_keep - v_tm64):.2e}")
    ok = abs(v_ours - v_nc) <= 1e-6 and abs(v_ours_keep - v_tm64) <= 1e-6
    print(f"  values equal to 1e-6: {ok}")

    g = torch.Generator().manual_seed(0)
    zl = torch.randn(args.ts_n, args.classes, generator=g, dtype=torch.float64) * 3
    yl = torch.multinomial(torch.softmax(zl / 2.0, 1), 1, generator=g)[:, 0]
    probs = torch.softmax(zl, 1).numpy()
    print(f"\nTemperature scaling fit on {args.ts_n:,} x {args.classes} logits (T* = 2.0)")
    t_ts, ts = best_time(lambda: TemperatureScaler().fit(zl, yl), args.repeat)

    def netcal_fit():
        m = TemperatureScaling()
        m.fit(probs, yl.numpy())
        return m

    t_nts, nts = best_time(netcal_fit, args.repeat)
    t_net = 1.0 / float(np.ravel(nts.temperature)[0])
    print(f"  lungcal  {t_ts * 1e3:9.1f} ms   T={ts.temperature:.5f}  ({ts.method})")
    print(f"  netcal   {t_nts * 1e3:9.1f} ms   T={t_net:.5f}   speed-up x{t_nts / t_ts:.1f}")


if __name__ == "__main__":
    main()
