"""Detector evaluation on a cohort with LUNA16-style annotations (CPM, FROC, timing).

``annotations.csv`` follows LUNA16 (``coordX, coordY, coordZ`` in ITK/LPS world mm,
``diameter_mm``) and is linked to datalist rows by the ``ct`` column (the synthetic cohort and
importers write it; both sides carry pseudonyms only). When ``rasX, rasY, rasZ`` columns are
present they are used directly; otherwise LPS is flipped to RAS (``x, y -> -x, -y``), the frame of
MONAI's affines after ``Orientationd("RAS")``.
"""
from __future__ import annotations

import csv
import os
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from lungcal.candidates.cache import BagParams
from lungcal.candidates.froc import LUNA16_FP_RATES, cpm, froc_curve
from lungcal.ct.transforms import preprocess_ct
from lungcal.errors import DataError

__all__ = ["read_annotations", "read_nodule_truth", "evaluate_detector"]


def _read_rows(path: str | os.PathLike, key: str, extra: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """``{key: (M, 4 + len(extra)) float rows: rasX, rasY, rasZ, diameter_mm, *extra}``."""
    out: dict[str, list] = defaultdict(list)
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or ())
        need = {key, "diameter_mm", *extra} | ({"rasX", "rasY", "rasZ"} if "rasX" in cols
                                              else {"coordX", "coordY", "coordZ"})
        if not need <= cols:
            raise DataError(f"annotations lack columns {sorted(need - cols)}", file=path, field=key,
                            fix="write LUNA16 columns coordX,coordY,coordZ,diameter_mm plus the row key"
                                + (f" and {', '.join(extra)}" if extra else ""))
        for r in reader:
            if "rasX" in cols:
                c = (float(r["rasX"]), float(r["rasY"]), float(r["rasZ"]))
            else:
                c = (-float(r["coordX"]), -float(r["coordY"]), float(r["coordZ"]))
            out[r[key]].append((*c, float(r["diameter_mm"]), *(float(r[e]) for e in extra)))
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def read_annotations(path: str | os.PathLike, key: str = "ct") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{ct: (centres_ras (M, 3), diameters_mm (M,))}`` from a LUNA16-style annotations CSV."""
    return {k: (v[:, :3], v[:, 3]) for k, v in _read_rows(path, key).items()}


def read_nodule_truth(path: str | os.PathLike, key: str = "ct") -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``{ct: (centres_ras (M, 3), diameters_mm (M,), malignant (M,) bool)}``: annotations with a ``malignant``
    column (0/1), as the synthetic cohort writes them."""
    return {k: (v[:, :3], v[:, 3], v[:, 4] > 0.5) for k, v in _read_rows(path, key, ("malignant",)).items()}


def evaluate_detector(rows: Sequence[Mapping[str, Any]], annotations: Mapping[str, tuple[np.ndarray, np.ndarray]],
                      params: BagParams | Mapping[str, Any] | None = None, key: str = "ct",
                      progress: bool = True) -> dict[str, Any]:
    """Run preprocessing + detection on ``rows`` and score the candidates against ``annotations``.

    Returns ``{"cpm", "sensitivities" (at the LUNA16 FP rates), "max_sensitivity", "n_scans",
    "n_nodules", "seconds_per_ct_preprocess", "seconds_per_ct_detect"}``.
    """

    params = BagParams.from_any(params)
    det = params.make_detector()
    preds, scores, gts, diams = [], [], [], []
    t_pre = t_det = 0.0
    for r in tqdm(rows, desc="detect", unit="CT", disable=not progress):
        t0 = time.perf_counter()
        out = preprocess_ct(r["image"], **params.preprocess_kwargs())
        t1 = time.perf_counter()
        image = out["image"]
        affine = np.asarray(image.affine, np.float64)
        c = det.detect(image, out["lung_mask"], np.linalg.norm(affine[:3, :3], axis=0), affine)
        t_det += time.perf_counter() - t1
        t_pre += t1 - t0
        preds.append(c.world)
        scores.append(c.score)
        g, d = annotations.get(str(r.get(key)), (np.zeros((0, 3)), np.zeros(0)))
        gts.append(g)
        diams.append(d)
    value, sens = cpm(preds, scores, gts, diams, return_sensitivities=True)
    _, curve_sens, _ = froc_curve(preds, scores, gts, diams)
    n = max(len(rows), 1)
    return {"cpm": value, "sensitivities": dict(zip(LUNA16_FP_RATES, sens.tolist())),
            "max_sensitivity": float(curve_sens.max()), "n_scans": len(rows),
            "n_nodules": int(sum(len(d) for d in diams)),
            "seconds_per_ct_preprocess": t_pre / n, "seconds_per_ct_detect": t_det / n}
