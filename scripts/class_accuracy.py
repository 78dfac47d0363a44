"""Per-class and many / medium / few test accuracy of the finished runs of a CIFAR experiment, with CIs.

Where a long-tailed model loses accuracy matters: in the head classes it trained on most, or in
the tail. This reads each finished run's logged ``predictions/{split}.npz`` (probs and labels)
from MLflow, and prints per run:

- the accuracy of each class;
- the mean per-class accuracy of three groups of classes, MiSLAS's index ranges for CIFAR-10-LT
  (many: classes 0-2, 4,500-1,796 training images; medium: 3-6, 1,077-232; few: 7-9, 139-50);
- 95% percentile-bootstrap CIs of the group accuracies, resampling test images.

    python scripts/class_accuracy.py --experiment cifar10lt --tracking-uri sqlite:///runs/mlflow.db

Runs without predictions (a crashed or still-running stage 1) are skipped with a note.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from lungcal.study.differences import load_predictions
from lungcal.tracking.tracker import default_tracking_uri, open_store

# MiSLAS's head / medium / tail class-index ranges for CIFAR-10-LT (config/cifar10/*.yaml).
GROUPS: dict[str, tuple[int, ...]] = {"many": (0, 1, 2), "medium": (3, 4, 5, 6), "few": (7, 8, 9)}


def group_accuracy(pred: np.ndarray, labels: np.ndarray, groups: Mapping[str, Sequence[int]] = GROUPS,
                   n_bootstrap: int = 1000, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per group: the mean over its classes of the per-class accuracy, with a 95% bootstrap CI.

    Args:
        pred: ``(N,)`` predicted class indices.
        labels: ``(N,)`` true class indices.
        groups: ``{name: class indices}``; each class must occur in ``labels``.
        n_bootstrap: resamples of the N test images (0: no CI).

    Returns:
        ``{name: {"acc", "ci_low", "ci_high"}}`` (fractions).
    """
    pred, labels = np.asarray(pred, np.int64), np.asarray(labels, np.int64)
    if pred.shape != labels.shape or pred.ndim != 1:
        raise ValueError(f"pred and labels must be 1-D and of one length, got {pred.shape} and {labels.shape}")
    n_classes = int(max(labels.max(), max(max(g) for g in groups.values()))) + 1
    missing = sorted({c for g in groups.values() for c in g} - set(np.unique(labels).tolist()))
    if missing:
        raise ValueError(f"classes {missing} have no test images, so their accuracy is undefined")
    hit = (pred == labels).astype(np.float64)

    def per_class(idx: np.ndarray) -> np.ndarray:
        y = labels[idx]
        return np.bincount(y, hit[idx], n_classes) / np.maximum(np.bincount(y, minlength=n_classes), 1)

    point = per_class(np.arange(len(labels)))
    rng = np.random.default_rng(seed)
    reps = np.array([per_class(rng.integers(0, len(labels), len(labels))) for _ in range(int(n_bootstrap))])
    out = {}
    for name, classes in groups.items():
        cls = list(classes)
        lo = hi = float("nan")
        if len(reps):
            lo, hi = (float(v) for v in np.percentile(reps[:, cls].mean(1), [2.5, 97.5]))
        out[name] = {"acc": float(point[cls].mean()), "ci_low": lo, "ci_high": hi}
    out["per_class"] = {str(c): float(a) for c, a in enumerate(point)}
    return out


def _finished_runs(client, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment {experiment!r} in this tracking store")
    return client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time ASC"], max_results=1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", default="cifar10lt")
    ap.add_argument("--tracking-uri", default=None, help="default: the project's runs/mlflow.db")
    ap.add_argument("--split", default="test")
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    args = ap.parse_args(argv)
    client = open_store(args.tracking_uri or default_tracking_uri())
    rows, classes, n_classes = [], [], 0
    for run in _finished_runs(client, args.experiment):
        name = run.info.run_name or run.info.run_id
        loaded = load_predictions(client, run.info.run_id, args.split)
        if loaded is None or np.ndim(loaded[1]) != 2:
            print(f"skipped {name}: no multi-class predictions/{args.split}.npz", file=sys.stderr)
            continue
        _, probs, labels = loaded
        pred = probs.argmax(1)
        g = group_accuracy(pred, labels, n_bootstrap=args.n_bootstrap)
        acc = 100 * float((pred == labels).mean())
        cells = [f"{100 * g[k]['acc']:.2f} [{100 * g[k]['ci_low']:.2f}, {100 * g[k]['ci_high']:.2f}]" for k in GROUPS]
        rows.append(f"| {name} | {len(labels)} | {acc:.2f} | " + " | ".join(cells) + " |")
        classes.append(f"| {name} | " + " | ".join(f"{100 * a:.1f}" for a in g["per_class"].values()) + " |")
        n_classes = max(n_classes, len(g["per_class"]))
    if not rows:
        print(f"no finished run of {args.experiment!r} logged predictions/{args.split}.npz", file=sys.stderr)
        return 1
    print(f"Accuracy on {args.split} by class group (mean per-class accuracy, %, 95% bootstrap CI):\n")
    print("| run | n | ACC | " + " | ".join(f"{k} ({min(v)}-{max(v)})" for k, v in GROUPS.items()) + " |")
    print("|---|---|---|" + "---|" * len(GROUPS))
    print("\n".join(rows))
    print("\nPer-class accuracy, %:\n")
    print("| run | " + " | ".join(str(c) for c in range(n_classes)) + " |")
    print("|---|" + "---|" * n_classes)
    print("\n".join(classes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
