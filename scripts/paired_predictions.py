"""Paired bootstrap of two runs' test predictions on the same CTs: ΔAUC and ΔECE (A - B) with 95% CIs.

Reads two ``test_predictions.csv`` files (the stage-1 run's ``predictions/`` artifact: ``subject``,
``label``, ``probability`` of cancer), checks that they hold the same CTs with the same labels, and
resamples the CTs jointly (:func:`lungcal.calibration.paired_bootstrap_diff`, 2000 resamples, 10 bins):

    python scripts/paired_predictions.py runs/mlartifacts/<run A>/artifacts/predictions/test_predictions.csv \\
        runs/mlartifacts/<run B>/artifacts/predictions/test_predictions.csv
"""
from __future__ import annotations

import csv
import sys

import numpy as np

from lungcal.calibration import paired_bootstrap_diff


def _read(path: str) -> dict[str, dict]:
    with open(path, newline="") as fh:
        return {r["subject"]: r for r in csv.DictReader(fh)}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = (_read(p) for p in argv)
    if sorted(a) != sorted(b):
        print("the two files do not hold the same CTs", file=sys.stderr)
        return 2
    keys = sorted(a)
    y = np.array([int(a[k]["label"]) for k in keys])
    if any(int(b[k]["label"]) != y[i] for i, k in enumerate(keys)):
        print("the two files disagree on a label", file=sys.stderr)
        return 2
    probs = [np.array([float(rows[k]["probability"]) for k in keys]) for rows in (a, b)]
    pa, pb = (np.stack([1 - p, p], 1) for p in probs)
    for metric in ("auc", "ece"):
        d = paired_bootstrap_diff(metric, pa, pb, y, n_bootstrap=2000, seed=0, n_bins=10)
        print(f"{metric}: A - B = {d['diff']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]  (n = {len(y)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
