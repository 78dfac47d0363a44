"""What counting missed cancers as integers changed in ``lungcal recalibrate --miss-rate`` (issue 45 item 3).

Until 2026-12-06 :mod:`lungcal.calibration.guarantee` chose the threshold through MAPIE's
``BinaryClassificationController`` (recall at 1 - alpha, fixed-sequence testing), which computes ``1 - recall``
in floating point and takes ``ceil(n * risk)`` inside its binomial tail: one miss of 40 cancers counted as
two. This script measures, with the controller called exactly as that code called it:

1. the misses certified per count of calibration cancers (``--n-min``..``--n-max``), before (MAPIE) and after
   (the exact binomial tail on integer counts, :func:`lungcal.calibration.guarantee.misses_allowed`), at
   alpha, delta in {0.05, 0.1}; and conformal risk control's for comparison;
2. the guarantee over calibration draws on the known population of ``tests/calibration/test_guarantee.py``
   (cancers' p ~ Beta(5, 2), others ~ Beta(2, 5), prevalence 0.3, 400 calibration CTs, 200 draws, seed 7):
   how often the true missed-cancer rate stayed at most alpha, its median, and the mean threshold, for
   MAPIE, the exact LTT and CRC.

    python experiments/threshold_counts.py [--n-min 22 --n-max 200]
"""
from __future__ import annotations

import argparse
import warnings

import numpy as np
from mapie.risk_control import BinaryClassificationController
from scipy import stats

from lungcal.calibration.guarantee import CRC, missed_cancer_threshold, misses_allowed

LEVELS = ((0.1, 0.1), (0.05, 0.1), (0.1, 0.05), (0.05, 0.05))
CANCER, OTHER = stats.beta(5, 2), stats.beta(2, 5)


def mapie_threshold(p: np.ndarray, y: np.ndarray, alpha: float, delta: float) -> float:
    """The threshold the former ``missed_cancer_threshold`` chose (MAPIE 1.6, the same call)."""
    grid = np.unique(np.concatenate([[0.0], p[y == 1]]))
    ctl = BinaryClassificationController(
        predict_function=lambda q: np.column_stack([1.0 - np.asarray(q), np.asarray(q)]), risk="recall",
        target_level=1.0 - alpha, confidence_level=1.0 - delta, best_predict_param_choice="predicted_positive_fraction",
        list_predict_params=grid, fwer_method="fixed_sequence")
    with warnings.catch_warnings():  # too few cancers at these levels: MAPIE warns, and certifies none
        warnings.simplefilter("ignore", UserWarning)
        ctl.calibrate(p, y)
    return -1.0 if ctl.best_predict_param is None else float(ctl.best_predict_param)


def mapie_misses(n: int, alpha: float, delta: float, seed: int = 0) -> int:
    """The misses MAPIE certified among ``n`` cancers with distinct scores (-1: none certified)."""
    rng = np.random.default_rng(seed)
    cancers = np.sort(rng.uniform(0.3, 1.0, n))
    p = np.r_[cancers, rng.uniform(0.0, 0.3, 2 * n)]
    y = np.r_[np.ones(n, int), np.zeros(2 * n, int)]
    t = mapie_threshold(p, y, alpha, delta)
    return -1 if t < 0 else int((cancers < t).sum())


def count_table(n_min: int, n_max: int) -> list[dict]:
    """Per level: how many cancer counts in [n_min, n_max] gained a certifiable miss, and which."""
    out = []
    for alpha, delta in LEVELS:
        before = {n: mapie_misses(n, alpha, delta) for n in range(n_min, n_max + 1)}
        after = {n: misses_allowed(n, alpha, delta) for n in before}
        gained = [n for n in before if after[n] > before[n]]
        lost = [n for n in before if after[n] < before[n]]
        out.append({"alpha": alpha, "delta": delta, "counts": len(before), "gained": gained, "lost": lost,
                    "most_gained": max((after[n] - before[n] for n in before), default=0),
                    "zero_instead_of_one": [n for n in gained if before[n] == 0 and after[n] == 1]})
    return out


def draws_table(draws: int = 200, n: int = 400, seed: int = 7) -> list[dict]:
    """The guarantee over calibration draws of the Beta population, per method and level."""
    rows = []
    for alpha, delta in ((0.1, 0.1), (0.05, 0.2)):
        rng = np.random.default_rng(seed)
        thr: dict[str, list[float]] = {"MAPIE (before)": [], "exact LTT": [], "CRC": []}
        for _ in range(draws):
            y = (rng.random(n) < 0.3).astype(int)
            p = np.where(y == 1, CANCER.rvs(n, random_state=rng), OTHER.rvs(n, random_state=rng))
            thr["MAPIE (before)"].append(mapie_threshold(p, y, alpha, delta))
            thr["exact LTT"].append(missed_cancer_threshold(p, y, alpha=alpha, delta=delta).threshold)
            thr["CRC"].append(missed_cancer_threshold(p, y, alpha=alpha, delta=None, guarantee=CRC).threshold)
        for name, ts in thr.items():
            rates = CANCER.cdf(np.asarray(ts))
            rows.append({"alpha": alpha, "delta": delta, "method": name, "held": float(np.mean(rates <= alpha)),
                         "mean_rate": float(rates.mean()), "median_rate": float(np.median(rates)),
                         "mean_threshold": float(np.mean(ts))})
    return rows


def _ranges(ns: list[int]) -> str:
    if not ns:
        return "none"
    parts, start = [], ns[0]
    for a, b in zip(ns, [*ns[1:], -1]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-min", type=int, default=22)
    ap.add_argument("--n-max", type=int, default=200)
    ap.add_argument("--draws", type=int, default=200)
    args = ap.parse_args(argv)
    print(f"certified misses, cancers {args.n_min}-{args.n_max}: MAPIE (float count) against the exact tail")
    print("| alpha | delta | counts | gained a miss | most gained | lost | 0 certified instead of 1 |")
    print("|---|---|---|---|---|---|---|")
    for r in count_table(args.n_min, args.n_max):
        print(f"| {r['alpha']:g} | {r['delta']:g} | {r['counts']} | {len(r['gained'])} ({_ranges(r['gained'])}) | "
              f"{r['most_gained']} | {len(r['lost'])} | {_ranges(r['zero_instead_of_one'])} |")
    print(f"\nthe guarantee over {args.draws} calibration draws (Beta population, 400 CTs, seed 7)")
    print("| alpha | delta | method | held (rate <= alpha) | mean true rate | median true rate | mean threshold |")
    print("|---|---|---|---|---|---|---|")
    for r in draws_table(args.draws):
        print(f"| {r['alpha']:g} | {r['delta']:g} | {r['method']} | {100 * r['held']:.1f} % | {r['mean_rate']:.4f} | "
              f"{r['median_rate']:.4f} | {r['mean_threshold']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
