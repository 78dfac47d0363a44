"""Benchmark: lungcal.calibration ECE vs torchmetrics / netcal; temperature scaling vs netcal.

Run: python scripts/bench_calibration.py [--n 2000000] [--classes 10] [--repeat 5] [--threads 2]
Every method runs --repeat times under the same torch thread setting, interleaved round-robin so
that load on a shared machine hits all of them alike; the median time is reported, with ratios
(peer time / lungcal time) and the value differences. The torchmetrics value gap is explained
by a live check (its float32 binning and float32 per-bin sums are replayed).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from netcal.metrics import ECE as NetcalECE
from netcal.scaling import TemperatureScaling
from torchmetrics.functional.classification import multiclass_calibration_error

from lungcal.calibration.metrics import _bin_index, ece
from lungcal.calibration.scaling import TemperatureScaler


def median_times(fns: dict, repeat: int) -> tuple[dict, dict]:
    """Run every fn ``repeat`` times, round-robin; -> ({name: median seconds}, {name: result})."""
    times = {k: [] for k in fns}
    out = {}
    for _ in range(repeat):
        for k, fn in fns.items():
            t = time.perf_counter()
            out[k] = fn()
            times[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) for k, v in times.items()}, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=2_000_000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--n-bins", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ts-n", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    z = rng.normal(size=(args.n, args.classes)).astype(np.float32) * 3
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = np.where(rng.uniform(size=args.n) < 0.7, p.argmax(1), rng.integers(0, args.classes, args.n))
    pt, yt = torch.from_numpy(p), torch.from_numpy(y)
    print(f"ECE on {args.n:,} x {args.classes} float32 probabilities, {args.n_bins} bins "
          f"(median of {args.repeat}, {args.threads} torch threads for every method)")
    t, v = median_times({
        "lungcal": lambda: ece(p, y, args.n_bins),
        "torchmetrics": lambda: multiclass_calibration_error(pt, yt, args.classes,
                                                             n_bins=args.n_bins).item(),
        "netcal": lambda: float(NetcalECE(bins=args.n_bins).measure(p, y)),
    }, args.repeat)
    for k in ("lungcal", "torchmetrics", "netcal"):
        extra = "" if k == "lungcal" else (f"   ratio x{t[k] / t['lungcal']:.2f}"
                                            f"   |diff|={abs(v[k] - v['lungcal']):.2e}")
        print(f"  {k:12s} {t[k] * 1e3:9.1f} ms   ece={v[k]:.9f}{extra}")
    goal = t["torchmetrics"] / t["lungcal"] >= 2 and t["netcal"] / t["lungcal"] >= 10
    print(f"  speed goal (>=2x torchmetrics, >=10x netcal) met: {goal}")
    print(f"  equal to netcal to 1e-6: {abs(v['lungcal'] - v['netcal']) <= 1e-6}")
    # why torchmetrics differs: replay its float32 binning and float32 per-bin sums on our bins
    conf32, pred = pt.max(dim=1)
    ours_bin = torch.from_numpy(_bin_index(conf32.numpy(), args.n_bins))
    tm_edges = torch.linspace(0, 1, args.n_bins + 1, dtype=torch.float32)
    tm_bin = torch.bucketize(conf32, tm_edges, right=True) - 1
    moved = int((tm_bin != ours_bin).sum())
    nb = args.n_bins
    cnt = torch.zeros(nb, dtype=torch.float32).scatter_add_(0, ours_bin, torch.ones_like(conf32))
    s_conf = torch.zeros(nb, dtype=torch.float32).scatter_add_(0, ours_bin, conf32)
    s_hit = torch.zeros(nb, dtype=torch.float32).scatter_add_(0, ours_bin, (pred == yt).float())
    nz = cnt > 0
    replay = float(((s_conf[nz] / cnt[nz] - s_hit[nz] / cnt[nz]).abs() * cnt[nz]).sum() / cnt.sum())
    print(f"  torchmetrics gap {abs(v['torchmetrics'] - v['lungcal']):.2e}: it casts confidences to "
          f"float32 and sums bins in float32; {moved} samples change bin, and our bins summed in "
          f"float32 give {replay:.9f} (|diff to torchmetrics|={abs(replay - v['torchmetrics']):.1e})")
    keep = p.max(1) < 1.0  # torchmetrics puts confidence == 1.0 into an extra bin (by design)
    if not keep.all():
        print(f"  ({int((~keep).sum())} rows have confidence == 1.0, scored by torchmetrics in an "
              f"extra bin; see lungcal.calibration.metrics.ece)")

    g = torch.Generator().manual_seed(0)
    zl = torch.randn(args.ts_n, args.classes, generator=g, dtype=torch.float64) * 3
    yl = torch.multinomial(torch.softmax(zl / 2.0, 1), 1, generator=g)[:, 0]
    probs = torch.softmax(zl, 1).numpy()
    print(f"\nTemperature scaling fit on {args.ts_n:,} x {args.classes} logits (T* = 2.0, "
          f"median of {args.repeat})")

    def netcal_fit():
        m = TemperatureScaling()
        m.fit(probs, yl.numpy())
        return m

    t, v = median_times({"lungcal": lambda: TemperatureScaler().fit(zl, yl), "netcal": netcal_fit},
                        args.repeat)
    ts, t_net = v["lungcal"], 1.0 / float(np.ravel(v["netcal"].temperature)[0])
    print(f"  lungcal  {t['lungcal'] * 1e3:9.1f} ms   T={ts.temperature:.6f}  ({ts.method})")
    print(f"  netcal   {t['netcal'] * 1e3:9.1f} ms   T={t_net:.6f}   ratio x{t['netcal'] / t['lungcal']:.1f}"
          f"   |dT|/T={abs(ts.temperature - t_net) / t_net:.1e}")


if __name__ == "__main__":
    main()
