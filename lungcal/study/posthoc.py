"""Report section ``posthoc``: the post-hoc fixes of each CIFAR stage-1 run side by side, against its LAS runs.

Why one temperature may not calibrate a long-tailed model on a balanced test set
(:mod:`lungcal.calibration.posthoc`): for each stage-1 configuration of the report whose run logged
its ``class_counts`` and ``predictions/{val,test}_predictions.npz`` (the CIFAR runs), every fix of
:data:`~lungcal.calibration.posthoc.POSTHOC_METHODS` is fitted on the validation logits and scored
on the test logits: ACC, ECE with its CI, mean confidence and NLL, and the paired-bootstrap
difference of ECE and ACC against ``none`` on the same test images. The finished LAS runs on that
stage-1 run (LAS retrains the head; vector scaling is the post-hoc fix of the same per-class scale
and bias) add a row each, and their paired difference against vector scaling.
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lungcal.calibration.metrics import calibration_report, paired_bootstrap_diff
from lungcal.calibration.posthoc import POSTHOC_METHODS, posthoc_probs
from lungcal.calibration.scaling import probabilities
from lungcal.study.differences import format_diff, study_bins
from lungcal.study.sections import Config
from lungcal.tracking.names import TAG_PARENT, TAG_STAGE2, predictions_artifacts

__all__ = ["load_logits", "las_runs", "posthoc_lines"]


def load_logits(client, run_id: str, split: str) -> tuple[np.ndarray, np.ndarray] | None:
    """``(logits (N, C) float64, labels)`` from a run's ``predictions/{split}_predictions.npz``, or ``None``."""
    for name in predictions_artifacts(split, "npz"):
        try:
            local = Path(client.download_artifacts(run_id, name))
            break
        except Exception:  # noqa: BLE001 - the run did not log them under this name
            continue
    else:
        return None
    with np.load(local, allow_pickle=False) as z:
        if "logits" not in z:
            return None
        return np.asarray(z["logits"], np.float64), np.asarray(z["labels"], np.int64)


def las_runs(client, run) -> list:
    """The finished LAS runs whose parent is ``run`` (oldest first)."""
    return client.search_runs([run.info.experiment_id],
                              filter_string=f"tags.`{TAG_PARENT}` = '{run.info.run_id}' and "
                                            f"tags.`{TAG_STAGE2}` = 'las' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time ASC"], max_results=1000)


def _diff(d: dict) -> str:
    if d["diff"] == d["ci_low"] == d["ci_high"] == 0:
        return "0 (same argmax)"
    return format_diff(d, percent=True)


def _table(client, cfg: Config, split: str, n_bootstrap: int) -> list[str] | None:
    """The lines of one stage-1 run's table, or ``None`` when it is not a CIFAR stage-1 run with logits."""
    run = client.get_run(cfg.run_id)
    if "class_counts" not in run.data.params:
        return None
    val, test = load_logits(client, cfg.run_id, "val"), load_logits(client, cfg.run_id, split)
    if val is None or test is None:
        return None
    counts = np.asarray(ast.literal_eval(run.data.params["class_counts"]), np.float64)
    n_bins = study_bins(cfg.dataset)
    (zv, yv), (zt, yt) = val, test
    fits = posthoc_probs(zv, yv, zt, counts, n_bins=n_bins)
    base = fits["none"][0]

    def diffs(a: np.ndarray, b: np.ndarray) -> list[str]:
        return [_diff(paired_bootstrap_diff(m, a, b, yt, n_bootstrap=n_bootstrap, n_bins=n_bins))
                for m in ("ece", "acc")]

    def row(name: str, fitted: str, probs: np.ndarray, cells: list[str]) -> str:
        r = calibration_report(probs, yt, n_bins=n_bins, n_bootstrap=n_bootstrap)
        return (f"| {name} | {fitted} | {100 * r['acc']:.2f} | {100 * r['ece']:.2f} [{100 * r['ece_ci_low']:.2f}, "
                f"{100 * r['ece_ci_high']:.2f}] | {100 * r['mean_confidence']:.2f} | {r['nll']:.3f} | "
                f"{cells[0]} | {cells[1]} |")

    lines = [f"### {cfg.dataset}: {cfg.label} (run {cfg.run_id})", "",
             f"Fitted on val ({len(yv)}), scored on {split} ({len(yt)}); training class counts "
             f"{counts.astype(int).tolist()}. ACC, ECE ({n_bins} bins), mean confidence in %; paired differences "
             "against none in pp, 95% paired-bootstrap CIs.", "",
             "| post-hoc | fitted | ACC | ECE | mean conf. | NLL | ΔECE vs none | ΔACC vs none |",
             "|---|---|---|---|---|---|---|---|"]
    for name in POSTHOC_METHODS:
        probs, fitted = fits[name]
        text = ", ".join(f"{k} {v:.3f}" for k, v in fitted.items()) or "—"
        lines.append(row(name, text, probs, ["", ""] if name == "none" else diffs(probs, base)))
    notes = []
    for las in las_runs(client, run):
        name = las.info.run_name or las.info.run_id
        found = load_logits(client, las.info.run_id, split)
        if found is None or not np.array_equal(found[1], yt):
            notes.append(f"LAS run {name} was not scored on the same {split} images: left out.")
            continue
        probs = probabilities(found[0])
        lines.append(row(f"LAS: {name}", "—", probs, diffs(probs, base)))
        ece_d, acc_d = diffs(fits["vector"][0], probs)
        notes.append(f"vector − LAS {name} (pp): ΔECE {ece_d}; ΔACC {acc_d}.")
    return lines + ([""] + notes if notes else []) + [""]


def posthoc_lines(client, configs: Sequence[Config], split: str = "test", n_bootstrap: int = 1000) -> list[str]:
    """Markdown lines of the section: a table per stage-1 configuration (``stage2 == "none"``)."""
    lines = [f"## Post-hoc fixes side by side ({split})", "",
             "TS (NLL-optimal T), ts-ece (the single T with the lowest validation ECE), prior (logit adjustment "
             "z − log π_train, nothing fitted), prior+ts, vector (a scale and a bias per class): fitted on the "
             "stage-1 run's validation logits, scored on its test logits; the LAS runs on that stage-1 run beside "
             "them.", ""]
    tables = [t for t in (_table(client, c, split, n_bootstrap) for c in configs if c.stage2 == "none") if t]
    return lines + ([line for t in tables for line in t] if tables else
                    ["No stage-1 run with class_counts and predictions/{val,test}_predictions.npz "
                     "(CIFAR runs log them).", ""])
