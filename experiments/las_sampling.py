"""CT LAS: do the class-balanced batches or the smoothing move the calibration intercept? (issues 36
item 4, 47 item 4)

Three LAS runs (``bundles/nlst_las.json``) retrain the head of one stage-1 model:

- as shipped (``balanced_sampling: true``, MiSLAS's class-balanced batches, plus the label smoothing);
- without the balanced batches (``--balanced_sampling false``: the smoothing alone);
- without the smoothing (``--smooth_head 0 --smooth_tail 0``: ε 0, the balanced batches alone).

All score the same test CTs; the table gives each run's test ECE, calibration intercept and slope, O/E,
AUC and mean predicted probability, and the paired differences of each control against the shipped
run, with bootstrap CIs on the same CTs.

    python experiments/las_sampling.py --stage1-run-id <id> --output-dir runs/scanner_mix
    python experiments/las_sampling.py --las-run-ids <shipped> <no-balance> <no-smoothing> --output-dir runs/scanner_mix

By the prior-shift arithmetic, class-balanced batches teach the head a cancer prior of 0.5; at a
training prevalence pi they move the intercept by logit(pi) - logit(0.5) = logit(pi) (-0.41 on the
demo, pi = 0.4). Dropping them should move the intercept back by about that much; what stays is the
smoothing's.
"""
from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.calibration.metrics import calibration_report, paired_bootstrap_diff

METRICS = ("ece", "cal_intercept", "cal_slope", "oe_ratio", "auc")


#: the arms: a name, and the command-line overrides of ``bundles/nlst_las.json`` that make it
ARMS = {
    "as shipped (balanced batches + smoothing)": [],
    "smoothing alone (balanced_sampling false)": ["--balanced_sampling", "false"],
    "balanced batches alone (smoothing ε 0)": ["--smooth_head", "0.0", "--smooth_tail", "0.0"],
}


def run_las(stage1: str, output_dir: Path, overrides: list[str]) -> str:
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/nlst_las.json",
           "--stage1_run_id", stage1, "--output_dir", str(output_dir), *overrides]
    print(" ".join(cmd), flush=True)
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    print(text[-2000:], flush=True)
    found = re.findall(r"([0-9a-f]{32}) \(LAS\)", text)
    if not found:
        raise SystemExit("no run id in the LAS output")
    return found[0]


def test_predictions(client: MlflowClient, run_id: str) -> dict[str, tuple[int, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, "predictions/test_predictions.csv", tmp)
        with open(path, newline="") as fh:
            return {r["subject"]: (int(r["label"]), float(r["probability"])) for r in csv.DictReader(fh)}


def compare(uri: str, *run_ids: str, n_bootstrap: int = 2000) -> str:
    """The table of the runs ``run_ids`` (in the order of :data:`ARMS`; the first is the shipped
    one), each control paired against the first on the same test CTs."""
    names = list(ARMS)[: len(run_ids)]
    if len(run_ids) < 2 or len(run_ids) > len(ARMS):
        raise SystemExit(f"give 2 to {len(ARMS)} LAS run ids, the shipped one first")
    client = MlflowClient(uri)
    preds = [test_predictions(client, r) for r in run_ids]
    subjects = sorted(set.intersection(*(set(p) for p in preds)))
    if any(len(subjects) != len(p) for p in preds):
        raise SystemExit("the LAS runs did not score the same test CTs")
    labels = np.array([preds[0][s][0] for s in subjects])
    probs = [np.array([p[s][1] for s in subjects]) for p in preds]
    two = lambda p: np.stack([1 - p, p], axis=1)  # noqa: E731
    lines = [f"test CTs: {len(subjects)}, cancers {int(labels.sum())} (prevalence {labels.mean():.3f})", "",
             "| LAS run | " + " | ".join(METRICS) + " | mean p |", "|---" * (len(METRICS) + 2) + "|"]
    for name, p in zip(names, probs):
        rep = calibration_report(two(p), labels, n_bins=10, n_bootstrap=n_bootstrap, seed=0)
        cells = [f"{rep[m]:.3f} [{rep[m + '_ci_low']:.3f}, {rep[m + '_ci_high']:.3f}]" for m in METRICS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {p.mean():.3f} |")
    for name, p in zip(names[1:], probs[1:]):
        diffs = []
        for m in METRICS:
            d = paired_bootstrap_diff(m, two(p), two(probs[0]), labels, n_bootstrap=n_bootstrap, n_bins=10)
            diffs.append(f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]")
        lines.append(f"| difference ({name.split(' (')[0]} − as shipped) | " + " | ".join(diffs)
                     + f" | {p.mean() - probs[0].mean():+.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", type=Path, required=True, help="the stage-1 run's output_dir (its MLflow store)")
    p.add_argument("--stage1-run-id", help="train the LAS runs of every arm on this stage-1 model")
    p.add_argument("--las-run-ids", nargs="+", metavar="ID",
                   help="compare finished LAS runs, in the order: shipped, no balanced batches, no smoothing")
    p.add_argument("--n-bootstrap", type=int, default=2000)
    args = p.parse_args()
    out = args.output_dir.absolute()
    if args.las_run_ids:
        ids = list(args.las_run_ids)
    elif args.stage1_run_id:
        ids = [run_las(args.stage1_run_id, out, overrides) for overrides in ARMS.values()]
    else:
        raise SystemExit("give --stage1-run-id or --las-run-ids")
    print("LAS runs: " + ", ".join(f"{n}: {i}" for n, i in zip(ARMS, ids)), flush=True)
    print(compare(f"sqlite:///{out / 'mlflow.db'}", *ids, n_bootstrap=args.n_bootstrap))


if __name__ == "__main__":
    main()
