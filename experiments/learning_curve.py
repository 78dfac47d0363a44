"""Learning curve of a CT cohort: training CTs against validation (and test) AUC, to pick the knee.

For each size N, a datalist that keeps the cohort's val and test splits and a stratified random N of
its train CTs (the same prevalence, nested: the 250 hold the 125) trains one stage-1 bundle as
shipped (only ``--datalist``, the seed and the run name set). Bags come from the cache of earlier
runs in the same ``--output-dir``. Prints one JSON line per size and a Markdown table at the end
(docs/results.md, "CT: the NLST-like study cohort"):

    python experiments/learning_curve.py runs/data/synthetic_study_3500/datalist.json --sizes 125 250 500 \
        --output-dir runs --bundle nlst_focal

Bags are shared through ``--output-dir``; pass ``--tracking-uri`` to keep the curve's runs out of a
grid's store (its report would take a curve run as the latest run of that configuration).
The full train split (1000 for the study cohort) is the grid's own run; add it with ``--sizes ... 1000``
or read it from the grid's report. Val AUC is ``best/val_auc`` (the checkpoint's epoch), test AUC and
ECE are the test split's with their bootstrap CIs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.data.manifest import load_manifest, save_manifest
from lungcal.tracking import default_tracking_uri

ROOT = Path(__file__).resolve().parents[1]


def subset(rows: list[dict], n: int, seed: int) -> list[dict]:
    """val + test of ``rows`` and a stratified random ``n`` of its train rows (nested in ``n``)."""
    train = [r for r in rows if r["split"] == "train"]
    rng = np.random.default_rng(seed)
    keep = []
    for label in (0, 1):
        group = [r for r in train if int(r["label"]) == label]
        order = rng.permutation(len(group))
        share = round(n * len(group) / len(train))
        keep += [group[i] for i in order[:share]]
    return [r for r in rows if r["split"] != "train"] + keep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("datalist")
    ap.add_argument("--sizes", nargs="+", type=int, required=True)
    ap.add_argument("--bundle", default="nlst_focal")
    ap.add_argument("--output-dir", default="runs")
    ap.add_argument("--seed", type=int, default=0, help="training seed and the subsampling seed")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--tracking-uri", default=None,
                    help="MLflow store for the curve's runs (default: the output folder's). Give another store when "
                         "the output folder also holds a study grid: `lungcal report` reads the most recent run of "
                         "each configuration, and a curve run is a stage-1 run on the same test split")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="bundle overrides for every size (e.g. a smoke check: --set epochs=2 n_bootstrap=50); "
                         "the curve itself runs the bundle as shipped")
    args = ap.parse_args()
    overrides = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: use KEY=VALUE, e.g. epochs=2")
        overrides += [f"--{key}", value]
    out = Path(args.output_dir).resolve()
    uri = args.tracking_uri or default_tracking_uri(out)
    rows = load_manifest(args.datalist)
    n_train = sum(r["split"] == "train" for r in rows)
    table = []
    for n in args.sizes:
        if n > n_train:
            raise SystemExit(f"--sizes {n}: the datalist has {n_train} train CTs")
        sub = subset(rows, n, args.seed)
        path = save_manifest(sub, out / "learning_curve" / f"train{n}" / "datalist.json", source="synthetic")
        name = f"lc-{args.bundle}-train{n}-seed{args.seed}"
        cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", f"bundles/{args.bundle}.json",
               "--datalist", str(path), "--output_dir", str(out), "--tracking_uri", uri, "--seed", str(args.seed),
               "--run_name", name, "--num_workers", str(args.num_workers), "--test_pictures", "none", *overrides]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
        if done.returncode:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("nlst")
        run = [r for r in client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'")
               if r.data.tags.get("lungcal.stage2") == "none"][0]
        m = run.data.metrics
        row = {"train_cts": n, "positives": sum(int(r["label"]) for r in sub if r["split"] == "train"),
               "best_epoch": int(m["best/epoch"]), "val_auc": round(m["best/val_auc"], 4),
               "test_auc": round(m["test/auc"], 4), "test_auc_ci": [round(m["test/auc_ci_low"], 4),
                                                                    round(m["test/auc_ci_high"], 4)],
               "test_ece": round(m["test/ece"], 4), "run_id": run.info.run_id}
        print(json.dumps(row), flush=True)
        table.append(row)
    print("\n| train CTs (positives) | best epoch | val AUC | test AUC [95% CI] | test ECE |\n|---|---|---|---|---|")
    for r in table:
        lo, hi = r["test_auc_ci"]
        print(f"| {r['train_cts']} ({r['positives']}) | {r['best_epoch']} | {r['val_auc']:.3f} | "
              f"{r['test_auc']:.3f} [{lo:.3f}, {hi:.3f}] | {r['test_ece']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
