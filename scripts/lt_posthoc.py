"""Why one temperature may not calibrate a long-tailed model on a balanced test set: post-hoc fixes side by side.

A CIFAR-10-LT model is trained on a long-tailed class prior and tested on balanced classes, so its
miscalibration has two parts: a *scale* error that one temperature can fix (over- or
under-confidence everywhere), and a *prior* error, a per-class bias toward the head classes, that
no single temperature can. TS picks the temperature that minimises validation NLL; where both parts
are present, that temperature trades one against the other. This script fits, on the stage-1
run's validation logits (balanced, like test), and scores on its test logits:

- ``none``: the model as trained;
- ``ts``: temperature scaling (NLL-optimal T, what the bundles log);
- ``ts-ece``: the single temperature with the lowest *validation* ECE (a grid over T), the most any
  one temperature can do for ECE;
- ``prior``: logit adjustment for the label shift, ``z - log(pi_train)`` (Menon et al. 2021), with
  ``pi_train`` the run's training class counts and a uniform test prior; no fitting;
- ``prior+ts``: that adjustment, then TS fitted on validation;
- ``vector``: vector scaling (a scale and a bias per class), fitted on validation;

each with ACC, ECE and NLL, and the paired-bootstrap difference of ECE and ACC against ``none`` on
the same test images. ``--compare RUN_ID`` adds the test predictions of other runs on the same
images (the LAS run on this stage 1: LAS retrains the head, vector scaling is the post-hoc fix of
the same per-class scale and bias), and their paired difference against vector scaling.

    python scripts/lt_posthoc.py --run-id <stage-1 run id> [--compare <its LAS run id>] --tracking-uri sqlite:///runs/mlflow.db
    python scripts/lt_posthoc.py --experiment cifar10lt     # every stage-1 run of the store, each with its LAS runs

Reads the run's logged ``predictions/{val,test}.npz`` and its ``class_counts`` param; writes nothing.

References:
    Menon, Jayasumana, Rawat, Jain, Veit, Kumar. "Long-tail learning via logit adjustment." ICLR 2021.
    https://arxiv.org/abs/2007.07314
    Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks." ICML 2017.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import numpy as np
import torch

from lungcal.calibration.metrics import calibration_report, ece, paired_bootstrap_diff
from lungcal.calibration.scaling import make_calibrator
from lungcal.engine.evaluate.reports import probabilities as softmax  # row softmax in float64
from lungcal.tracking.names import TAG_PARENT, TAG_STAGE2
from lungcal.tracking.tracker import default_tracking_uri, open_store

METHODS = ("none", "ts", "ts-ece", "prior", "prior+ts", "vector")


def ece_optimal_temperature(logits: np.ndarray, labels: np.ndarray, n_bins: int = 15,
                            grid: np.ndarray | None = None) -> float:
    """The temperature on ``grid`` with the lowest ECE. The default grid spans TS's own bounds,
    [0.01, 100], with 481 log-spaced values (120 per decade: neighbours 2% apart)."""
    grid = np.geomspace(0.01, 100.0, 481) if grid is None else np.asarray(grid, np.float64)
    scores = [ece(softmax(logits / t), labels, n_bins=n_bins) for t in grid]
    return float(grid[int(np.argmin(scores))])


def posthoc_probs(val_logits: np.ndarray, val_labels: np.ndarray, test_logits: np.ndarray,
                  class_counts: np.ndarray, n_bins: int = 15) -> dict[str, tuple[np.ndarray, dict]]:
    """``{method: (test probabilities, fitted values)}`` for every entry of :data:`METHODS`.

    Everything is fitted on the validation logits; the test logits are only transformed.
    """
    counts = np.asarray(class_counts, np.float64)
    if counts.ndim != 1 or counts.shape[0] != val_logits.shape[1] or (counts <= 0).any():
        raise ValueError(f"class_counts must hold one positive count per class ({val_logits.shape[1]}), "
                         f"got {counts.tolist()}")
    log_prior = np.log(counts / counts.sum())

    def ts(z_val: np.ndarray) -> float:
        return float(make_calibrator("ts").fit(torch.as_tensor(z_val), torch.as_tensor(val_labels)).temperature)

    t_nll = ts(val_logits)
    t_ece = ece_optimal_temperature(val_logits, val_labels, n_bins=n_bins)
    t_prior = ts(val_logits - log_prior)
    vector = make_calibrator("vector").fit(torch.as_tensor(val_logits), torch.as_tensor(val_labels))
    return {
        "none": (softmax(test_logits), {}),
        "ts": (softmax(test_logits / t_nll), {"T": t_nll}),
        "ts-ece": (softmax(test_logits / t_ece), {"T": t_ece}),
        "prior": (softmax(test_logits - log_prior), {}),
        "prior+ts": (softmax((test_logits - log_prior) / t_prior), {"T": t_prior}),
        "vector": (np.asarray(vector.predict_proba(torch.as_tensor(test_logits)), np.float64), {}),
    }


def _ci(d: dict, scale: float = 100.0) -> str:
    if d["diff"] == d["ci_low"] == d["ci_high"] == 0:
        return "0 (same argmax)"
    text = f"{scale * d['diff']:+.2f} [{scale * d['ci_low']:+.2f}, {scale * d['ci_high']:+.2f}]"
    return text + ("" if d["ci_low"] > 0 or d["ci_high"] < 0 else ", not significant")


def _load(client, run_id: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    local = Path(client.download_artifacts(run_id, f"predictions/{split}.npz"))
    with np.load(local, allow_pickle=False) as z:
        return np.asarray(z["logits"], np.float64), np.asarray(z["labels"], np.int64)


def print_table(client, run_id: str, compare: list[str], n_bins: int = 15, n_bootstrap: int = 1000) -> bool:
    """Print the table of one stage-1 run (and the ``compare`` runs' rows); False if it is not a CIFAR run."""
    run = client.get_run(run_id)
    if "class_counts" not in run.data.params:
        print(f"run {run_id} has no class_counts param: not a CIFAR stage-1 run", file=sys.stderr)
        return False
    counts = np.asarray(ast.literal_eval(run.data.params["class_counts"]), np.float64)
    (zv, yv), (zt, yt) = _load(client, run_id, "val"), _load(client, run_id, "test")
    fits = posthoc_probs(zv, yv, zt, counts, n_bins=n_bins)
    base = fits["none"][0]

    def diff(metric: str, a: np.ndarray, b: np.ndarray) -> str:
        return _ci(paired_bootstrap_diff(metric, a, b, yt, n_bootstrap=n_bootstrap, n_bins=n_bins))

    def row(name: str, fit: str, probs: np.ndarray, diffs: list[str]) -> str:
        r = calibration_report(probs, yt, n_bins=n_bins, n_bootstrap=n_bootstrap)
        return (f"| {name} | {fit} | {100 * r['acc']:.2f} | {100 * r['ece']:.2f} [{100 * r['ece_ci_low']:.2f}, "
                f"{100 * r['ece_ci_high']:.2f}] | {100 * r['mean_confidence']:.2f} | {r['nll']:.3f} | "
                f"{diffs[0]} | {diffs[1]} |")

    print(f"stage-1 run {run_id} ({run.data.params.get('method')}, {run.data.params.get('dataset')}); "
          f"fitted on val ({len(yv)}), scored on test ({len(yt)}); training class counts "
          f"{counts.astype(int).tolist()}. ACC, ECE ({n_bins} bins), mean confidence in %; "
          f"paired differences against none in pp, 95% paired-bootstrap CIs.\n")
    print("| post-hoc | fitted | ACC | ECE | mean conf. | NLL | ΔECE vs none | ΔACC vs none |")
    print("|---|---|---|---|---|---|---|---|")
    for name in METHODS:
        probs, fitted = fits[name]
        fit = ", ".join(f"{k} {v:.3f}" for k, v in fitted.items()) or "—"
        print(row(name, fit, probs, ["", ""] if name == "none" else [diff(m, probs, base) for m in ("ece", "acc")]))
    notes = []
    for other in compare:
        name = client.get_run(other).info.run_name or other
        z, y = _load(client, other, "test")
        if not np.array_equal(y, yt):
            print(f"run {other} was not scored on the same test images: left out", file=sys.stderr)
            continue
        probs = softmax(z)
        print(row(f"run {name}", "—", probs, [diff(m, probs, base) for m in ("ece", "acc")]))
        notes.append(f"vector − {name} (pp): " + "; ".join(
            f"Δ{m.upper()} " + diff(m, fits["vector"][0], probs) for m in ("ece", "acc")))
    for note in notes:
        print("\n" + note)
    return True


def stage1_runs(client, experiment: str) -> list[tuple[str, list[str]]]:
    """``[(stage-1 run id, [its LAS run ids])]`` of the finished CIFAR stage-1 runs of ``experiment``."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} in this tracking store")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time ASC"], max_results=1000)
    las = [r for r in runs if r.data.tags.get(TAG_STAGE2) == "las"]
    return [(r.info.run_id, [x.info.run_id for x in las if x.data.tags.get(TAG_PARENT) == r.info.run_id])
            for r in runs if r.data.tags.get(TAG_STAGE2) == "none" and "class_counts" in r.data.params]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-id", help="a CIFAR stage-1 MLflow run (its stage2 tag: none)")
    which.add_argument("--experiment", help="every finished stage-1 run of this experiment (e.g. cifar10lt), "
                                            "each compared with its LAS runs")
    ap.add_argument("--tracking-uri", default=None, help="default: the project's runs/mlflow.db")
    ap.add_argument("--n-bins", type=int, default=15)
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    ap.add_argument("--compare", nargs="*", default=[], metavar="RUN_ID",
                    help="with --run-id: other runs scored on the same test images (e.g. the LAS run on this "
                         "stage 1): a row each, and their paired difference against vector scaling")
    args = ap.parse_args(argv)
    client = open_store(args.tracking_uri or default_tracking_uri())
    jobs = [(args.run_id, args.compare)] if args.run_id else stage1_runs(client, args.experiment)
    if not jobs:
        print(f"no finished CIFAR stage-1 run in experiment {args.experiment!r}", file=sys.stderr)
        return 1
    ok = True
    for i, (run_id, compare) in enumerate(jobs):
        if i:
            print()
        ok = print_table(client, run_id, compare, n_bins=args.n_bins, n_bootstrap=args.n_bootstrap) and ok
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
