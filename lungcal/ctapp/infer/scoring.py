"""Scoring CTs with a stage-1 model: the one code path of ``lungcal predict``, ``bundles/inference.json`` and
``lungcal recalibrate``.

:func:`score_rows` builds (or reuses) the bags, runs the network, applies the calibrator and returns the
calibrated probability, attention and candidates of every CT; :func:`write_outputs` writes what
``predict`` leaves behind. The per-CT record, the referral rule and the printed line are
:mod:`lungcal.ctapp.evaluate.cases`.
"""
from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lungcal.calibration.scaling import calibrated_probs
from lungcal.candidates.cache import build_bags
from lungcal.ctapp.data.bagset import BagSet
from lungcal.ctapp.data.cohort import load_split
from lungcal.ctapp.model.predict import predict
from lungcal.paths import atomic_write, atomic_write_text

__all__ = ["MEMBER_SAMPLES", "score_rows", "write_outputs"]

#: the key of MC-dropout / ensemble member probabilities ``(M, N, C)`` in a predict function's output
MEMBER_SAMPLES = "samples"
PREDICTION_COLUMNS = ("subject", "probability", "temperature", "top_candidate", "top_attention", "calibrator",
                      "confidence", "referred", "entropy", "mutual_information", "probability_sd", "work_up",
                      "outside_training")


def score_rows(network, rows: Sequence[Mapping[str, Any]], bag_params, calibrator, *, cache_dir: str | os.PathLike,
               device=None, batch_size: int = 16, num_workers: int = 0,
               predict_fn=predict) -> dict[str, Any]:
    """Bags, predictions and calibrated probabilities of ``rows`` (one CT each, in order).

    ``predict_fn(network, loader, device)`` returns ``logits`` and ``attention`` (and optionally
    ``samples``, see the module doc); :func:`lungcal.ctapp.model.predict.predict` by default.

    Returns:
        ``{"subjects", "rows", "labels" (the rows' labels; unlabelled rows read as 0), "logits" (N, C),
        "probs" (N, C) calibrated, "attention" (N, K), "features" (N, D) the pooled bag embeddings (None when
        ``predict_fn`` gives none),
        "candidates" (per CT: ``world`` RAS mm, ``radius_mm``, ``score``), "member_probs" ((M, N, C)
        calibrated, or None)}``.
    """
    built = build_bags(list(rows), bag_params, cache_dir, num_workers=num_workers)
    split = load_split(built)
    labels = torch.zeros(len(built), dtype=torch.long)
    loader = torch.utils.data.DataLoader(BagSet(split["bags"], split["mask"], labels), batch_size=batch_size,
                                         shuffle=False)
    out = predict_fn(network, loader, device)
    logits = _numpy(out["logits"])
    samples = out.get(MEMBER_SAMPLES)
    member_probs = None
    if samples is not None and len(samples):  # each member's probabilities, through the same calibrator
        member_probs = np.stack([calibrated_probs(calibrator, np.log(np.clip(_numpy(s), 1e-300, None)))
                                 for s in samples])
    return {"subjects": split["subjects"], "rows": list(rows), "labels": split["labels"], "logits": logits,
            "probs": calibrated_probs(calibrator, logits), "attention": _numpy(out["attention"]),
            "features": _numpy(out["features"]) if "features" in out else None,
            "candidates": split["candidates"], "member_probs": member_probs}


def write_outputs(folder: str | os.PathLike, scores: Mapping[str, Any], cases: Sequence[Mapping[str, Any]],
                  temperature: float) -> dict[str, Path]:
    """``predictions.csv`` (one row per CT; ``outside_training``: 1 flagged, 0 not, empty when it could not be
    checked), ``candidates/<pseudonym>.csv`` (every candidate) and ``cases/<pseudonym>.json``; all atomic.
    Returns their paths (``predictions``, ``cases``)."""
    folder = Path(folder)
    pred = folder / "predictions.csv"
    with atomic_write(pred, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(PREDICTION_COLUMNS)
        for i, case in enumerate(cases):
            att = np.asarray(scores["attention"][i])
            j = int(att.argmax()) if att.size else -1
            unc, ref, dec = case["uncertainty"], case["referral"], case.get("decision")
            w.writerow([case["pseudonym"], f"{case['probability']:.6f}",
                        "" if temperature != temperature else f"{temperature:.4f}", j,
                        f"{att[j]:.6f}" if j >= 0 else "", case["calibrator"], f"{case['confidence']:.6f}",
                        "" if ref["refer"] is None else int(ref["refer"]), f"{unc['entropy']:.6f}",
                        _fmt(unc["mutual_information"]), _fmt(unc["probability_sd"]),
                        "" if dec is None else int(dec["positive"]),
                        _flag(case.get("out_of_distribution"))])
    for i, case in enumerate(cases):
        c, att = scores["candidates"][i], np.asarray(scores["attention"][i])
        with atomic_write(folder / "candidates" / f"{case['pseudonym']}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["slot", "x_mm", "y_mm", "z_mm", "radius_mm", "score", "attention"])
            for j in range(len(c["score"])):
                w.writerow([j, *(f"{v:.2f}" for v in c["world"][j]), f"{c['radius_mm'][j]:.2f}",
                            f"{c['score'][j]:.4f}", f"{att[j]:.6f}"])
        atomic_write_text(folder / "cases" / f"{case['pseudonym']}.json", json.dumps(case, indent=1))
    return {"predictions": pred, "cases": folder / "cases"}


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _flag(ood: Mapping[str, Any] | None) -> str:
    return "" if not ood or not any((ood.get("checked") or {}).values()) else str(int(bool(ood["flagged"])))


def _fmt(v) -> str:
    return "" if v is None else f"{float(v):.6f}"


