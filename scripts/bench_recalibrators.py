"""Fit time of each recalibrator on the logits of 300 CTs (a site's validation split), with peers.

    python scripts/bench_recalibrators.py [--n 300] [--repeats 30]

Prints the median wall time of ``fit`` per calibrator of :data:`lungcal.calibration.scaling.CALIBRATORS`,
of ``select_calibrator`` (``--method auto``: 5-fold CV over ts/platt/isotonic plus the refit), of
the prior adjustment and of the EM prevalence estimate, next to scikit-learn's logistic regression
(Platt's peer) and isotonic regression (isotonic's peer) measured in the same run. The logits are
synthetic (a screening-like prevalence of 0.11, AUC about 0.75); only the time is measured.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression

from lungcal.calibration.prior import adjust_to_prior, estimate_prior_em
from lungcal.calibration.scaling import CALIBRATORS, make_calibrator, select_calibrator


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    y = (rng.random(args.n) < 0.11).astype(int)
    z = np.stack([np.zeros(args.n), rng.normal(np.where(y == 1, 0.9, -0.5), 1.0)], 1)
    zt, yt = torch.tensor(z, dtype=torch.float32), torch.tensor(y)
    p = torch.softmax(zt.double(), 1).numpy()
    rows = [(name, _median_ms(lambda n=name: make_calibrator(n).fit(zt, yt), args.repeats)) for name in CALIBRATORS]
    rows.append(("auto (select_calibrator)", _median_ms(lambda: select_calibrator(zt, yt), max(3, args.repeats // 5))))
    rows.append(("prior adjustment", _median_ms(lambda: adjust_to_prior(p, 0.4, 0.11), args.repeats)))
    rows.append(("EM prevalence estimate", _median_ms(lambda: estimate_prior_em(p, 0.4), args.repeats)))
    s = (z[:, 1] - z[:, 0])[:, None]
    peers = {"platt": _median_ms(lambda: LogisticRegression(C=np.inf).fit(s, y), args.repeats),
             "isotonic": _median_ms(lambda: IsotonicRegression(out_of_bounds="clip").fit(p[:, 1], y), args.repeats)}
    print(f"fit time on the logits of {args.n} CTs (median of {args.repeats}, 1 thread)")
    for name, ms in rows:
        peer = f"   sklearn {peers[name]:.2f} ms (ratio {ms / peers[name]:.2f})" if name in peers else ""
        print(f"  {name:<26} {ms:8.2f} ms{peer}")


if __name__ == "__main__":
    main()
