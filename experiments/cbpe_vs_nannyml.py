"""Our CBPE (``lungcal.calibration.performance_estimation.cbpe_sensitivity``) against NannyML's CBPE recall on the
same data, once (issue 46 item 2). NannyML stays out of the project's environment: ``make`` runs in the project's
venv and writes the data with our estimate per chunk; ``compare`` runs in a separate venv holding NannyML (it
imports numpy, pandas and nannyml only) and prints both side by side.

The data: experiments/monitor_sites.py's score-level site (calibrated p(cancer) of the go-live posterior, its
threshold keeping 92 % of the calibration CTs' cancers): the 300 calibration CTs as NannyML's reference (labels
known), then 12 chunks of ``--n`` CTs as the analysis data (labels hidden from both estimators), the prevalence
doubled from chunk 6 (``--prevalence-from``; 0 keeps it). Both estimators get the same probabilities and calls;
neither is prior-adjusted here (the monitor adjusts a prevalence_shift chunk first).

    python experiments/cbpe_vs_nannyml.py make runs/cbpe_vs_nannyml.csv
    python3 -m venv /tmp/nanny && /tmp/nanny/bin/pip install nannyml statsmodels
    /tmp/nanny/bin/python experiments/cbpe_vs_nannyml.py compare runs/cbpe_vs_nannyml.csv
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def make(path: Path, n: int, prevalence_from: int, seed: int) -> None:
    from lungcal.calibration.performance_estimation import cbpe_sensitivity  # noqa: PLC0415 (not in the NannyML venv)

    spec = importlib.util.spec_from_file_location("monitor_sites", HERE / "monitor_sites.py")
    ms = importlib.util.module_from_spec(spec)
    sys.modules["monitor_sites"] = ms
    spec.loader.exec_module(ms)
    rng = np.random.default_rng(seed)
    _, _, p_ref, y_ref, _ = ms.population(rng, ms.N_CALIBRATION)
    t = float(np.quantile(p_ref[y_ref == 1], 0.08))
    rows = [{"set": "reference", "chunk": 0, "p": p, "pred": int(p >= t), "y": y, "threshold": t, "ours": "",
             "ours_low": "", "ours_high": "", "truth": ""} for p, y in zip(p_ref, y_ref)]
    for c in range(1, 13):
        q = 2 * ms.PREV if prevalence_from and c >= prevalence_from else ms.PREV
        _, _, p, y, _ = ms.population(rng, n, q)
        est = cbpe_sensitivity(p, t, n_draws=2000, seed=c)
        truth = float(((p >= t) & (y == 1)).sum() / max(1, y.sum()))
        rows += [{"set": "analysis", "chunk": c, "p": pi, "pred": int(pi >= t), "y": yi, "threshold": t,
                  "ours": est.sensitivity, "ours_low": est.interval[0], "ours_high": est.interval[1], "truth": truth}
                 for pi, yi in zip(p, y)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {path} (threshold {t:.4f})")


def compare(path: Path) -> None:
    import nannyml as nml  # noqa: PLC0415 (only in the NannyML venv)
    import pandas as pd  # noqa: PLC0415

    df = pd.read_csv(path)
    ref = df[df["set"] == "reference"].reset_index(drop=True)
    ana = df[df["set"] == "analysis"].reset_index(drop=True)
    n = int((ana["chunk"] == 1).sum())
    est = nml.CBPE(problem_type="classification_binary", y_pred_proba="p", y_pred="pred", y_true="y",
                   metrics=["recall"], chunk_size=n)
    est.fit(ref[["p", "pred", "y"]])
    res = est.estimate(ana[["p", "pred"]]).filter(period="analysis").to_df()
    rec = res["recall"]
    ours = ana.groupby("chunk")[["ours", "ours_low", "ours_high", "truth"]].first().reset_index()
    print(f"NannyML {nml.__version__}: CBPE recall, chunk_size {n}; reference {len(ref)} CTs "
          f"(calibration applied by NannyML: {est.needs_calibration})\n")
    print("| chunk | true sensitivity | ours (CBPE) [95 % Poisson-binomial] | NannyML recall [its band] | "
          "ours - NannyML |")
    print("|---|---|---|---|---|")
    diffs = []
    for i, r in ours.iterrows():
        v = float(rec["value"].iloc[i])
        lo, hi = float(rec["lower_confidence_boundary"].iloc[i]), float(rec["upper_confidence_boundary"].iloc[i])
        diffs.append(r["ours"] - v)
        print(f"| {int(r['chunk'])} | {r['truth']:.3f} | {r['ours']:.4f} [{r['ours_low']:.3f}, {r['ours_high']:.3f}] "
              f"| {v:.4f} [{lo:.3f}, {hi:.3f}] | {r['ours'] - v:+.2e} |")
    d = np.abs(diffs)
    print(f"\nlargest |ours - NannyML| {d.max():.2e}; mean |ours - truth| "
          f"{np.mean(np.abs(ours['ours'] - ours['truth'])):.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("make", "compare"))
    ap.add_argument("path", type=Path)
    ap.add_argument("--n", type=int, default=100, help="CTs per chunk")
    ap.add_argument("--prevalence-from", type=int, default=6)
    ap.add_argument("--seed", type=int, default=46)
    a = ap.parse_args(argv)
    make(a.path, a.n, a.prevalence_from, a.seed) if a.what == "make" else compare(a.path)


if __name__ == "__main__":
    main()
