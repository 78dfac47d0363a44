"""Final evaluation: calibration report with bootstrap CIs, plots and a predictions table.

Nothing here writes an identifier: rows are keyed by the subject *pseudonym* of the datalist.
"""
from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lungcal.calibration.metrics import calibration_report
from lungcal.calibration.plots import reliability_diagram, risk_coverage_plot
from lungcal.calibration.scaling import probabilities
from lungcal.calibration.selective import predictive_entropy, selective_report
from lungcal.paths import atomic_write
from lungcal.tracking.names import SITE_REFERENCE_ARTIFACT, plot_artifact, predictions_artifact

__all__ = ["probabilities", "evaluate_probs", "write_predictions", "log_split"]


def evaluate_probs(probs, labels, *, n_bins: int = 10, n_bootstrap: int = 1000, seed: int = 0) -> dict[str, Any]:
    """``lungcal.calibration.metrics.calibration_report`` on ``(N, C)`` probabilities."""
    return calibration_report(np.asarray(probs), np.asarray(labels), n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)


def write_predictions(path: str | os.PathLike, subjects: Sequence[str], labels, probs,
                      attention=None, candidates: Sequence[Mapping[str, Any]] | None = None,
                      entropy=None, mi=None) -> Path:
    """Write ``subject,label,probability[,entropy][,mi][,top_attention,top_candidate_*]`` rows (atomic).

    ``probability`` is p(cancer) (class 1); ``entropy`` / ``mi`` (nats, per CT) are the predictive
    entropy and the mutual information of MC-dropout samples or ensemble members, when given.
    ``candidates[i]`` may hold the world coordinates (``world``, mm) and ``score`` of the
    candidates of CT ``i``, aligned with the attention slots; the most attended candidate's are written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    probs = np.asarray(probs)
    p1 = probs[:, 1] if probs.ndim == 2 else probs
    att = None if attention is None else np.asarray(attention)
    extra = [(name, np.asarray(v, dtype=np.float64)) for name, v in (("entropy", entropy), ("mi", mi))
             if v is not None]
    header = ["subject", "label", "probability"] + [name for name, _ in extra]
    if att is not None:
        header += ["top_attention", "top_slot"]
        if candidates is not None:
            header += ["top_x_mm", "top_y_mm", "top_z_mm", "top_score"]
    with atomic_write(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for i, subj in enumerate(subjects):
            row = [subj, int(np.asarray(labels)[i]) if labels is not None else "", f"{p1[i]:.6f}"]
            row += [f"{v[i]:.6f}" for _, v in extra]
            if att is not None:
                j = int(np.argmax(att[i]))
                row += [f"{att[i, j]:.6f}", j]
                if candidates is not None:
                    c = candidates[i]
                    world = np.asarray(c.get("world", np.zeros((0, 3))))
                    score = np.asarray(c.get("score", np.zeros(0)))
                    if j < len(world):
                        row += [*(f"{v:.2f}" for v in world[j]), f"{score[j]:.4f}"]
                    else:
                        row += ["", "", "", ""]
            w.writerow(row)
    return path


def log_split(tracker, split: str, probs, labels, report: Mapping[str, Any], *, n_bins: int,
              subjects: Sequence[str] | None = None, attention=None, candidates=None,
              workdir: str | os.PathLike, title: str = "", mi=None) -> None:
    """Log a split's report (``{split}/{metric}``), reliability diagram and predictions CSV.

    Every CT's predictive entropy of ``probs`` goes into the CSV (column ``entropy``) and its mean
    into ``{split}/mean_entropy``; ``mi`` (per CT, from MC-dropout samples or ensemble members)
    into column ``mi`` and ``{split}/mean_mi``.

    Binary tasks also get the referral metrics of
    :func:`lungcal.calibration.selective.selective_report` (ranked by confidence; ``@`` is not
    allowed in MLflow names): ``{split}/aurc``, ``{split}/sensitivity``, ``{split}/specificity``
    (all cases, decision p1 > 0.5) and ``{split}/acc_cov90``, ``sensitivity_cov90``,
    ``specificity_cov90``, ``referred_cancer_share_cov90``, ``n_referred_cov90`` on the 90% most
    certain cases, and the risk-coverage curve ``plots/{split}_risk_coverage.png``.
    """
    tracker.log_report(split, report)
    p_arr = np.asarray(probs)
    entropy = predictive_entropy(p_arr)
    unc = {"mean_entropy": float(entropy.mean())} if entropy.size else {}
    if mi is not None and np.asarray(mi).size:
        unc["mean_mi"] = float(np.mean(mi))
    tracker.log_report(split, unc)
    if p_arr.ndim == 1 or p_arr.shape[1] == 2:
        tracker.log_report(split, selective_report(p_arr, np.asarray(labels), coverage=0.9))
        tracker.log_figure(risk_coverage_plot(p_arr, np.asarray(labels), title=f"{title} {split}".strip()),
                           plot_artifact(split, "risk_coverage"))
    fig = reliability_diagram(np.asarray(probs), np.asarray(labels), n_bins=n_bins,
                              title=f"{title} {split}".strip())
    tracker.log_figure(fig, plot_artifact(split, "reliability"))
    if subjects is not None:
        name = predictions_artifact(split, "csv")
        p = write_predictions(Path(workdir) / Path(name).name, subjects, labels, probs, attention,
                              candidates, entropy=entropy, mi=mi)
        tracker.log_artifact(p, str(Path(name).parent))


def binary_scores(logits) -> np.ndarray:
    """The one-number output of a two-class network per case: logit of class 1 minus logit of class 0."""
    z = np.asarray(logits.detach().cpu().numpy() if hasattr(logits, "detach") else logits, dtype=np.float64)
    return z[:, 1] - z[:, 0] if z.ndim == 2 and z.shape[1] == 2 else z.reshape(len(z), -1)[:, -1]


def flat_features(features) -> np.ndarray:
    """Pooled bag embeddings as one row per case ``(N, D)`` (a multi-head pooling's ``(N, H, D)`` flattened)."""
    f = np.asarray(features.detach().cpu().numpy() if hasattr(features, "detach") else features, dtype=np.float32)
    return f.reshape(len(f), -1)


def log_site_reference(tracker, logits, labels, features, workdir: str | os.PathLike) -> None:
    """Log what the network makes of its validation split as ``data/site_reference.npz`` (``scores``
    (:func:`binary_scores`), ``labels``, ``features``: the pooled bag embeddings, :func:`flat_features`; no
    identifiers): the
    source side of ``lungcal site-check``. Multi-class networks log nothing (site checks are binary)."""
    z = np.asarray(logits.detach().cpu().numpy() if hasattr(logits, "detach") else logits)
    if z.ndim != 2 or z.shape[1] != 2:
        return
    f = flat_features(features)
    path = Path(workdir) / Path(SITE_REFERENCE_ARTIFACT).name
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as fh:
        np.savez(fh, scores=binary_scores(z), labels=np.asarray(labels, dtype=np.int64), features=f)
    tracker.log_artifact(path, str(Path(SITE_REFERENCE_ARTIFACT).parent))
