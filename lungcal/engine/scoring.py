"""Scoring CTs with a stage-1 model: the one code path of ``lungcal predict`` and ``bundles/inference.json``.

:func:`score_rows` builds (or reuses) the bags, runs the network, applies the calibrator and
returns the calibrated probability, attention and candidates of every CT; :func:`case_record`
turns one CT into the record written as ``cases/<pseudonym>.json``:

- ``probability``: calibrated p(cancer); ``confidence`` = max(p, 1 - p);
- ``uncertainty``: the predictive entropy of ``probability`` (nats) always; when the predict
  function returns member probabilities (``samples``, ``(M, N, C)``: MC-dropout passes or ensemble
  members, issue 18 item 1), each member goes through the same calibrator (on its log
  probabilities) and the record adds their mutual information (the epistemic part), standard
  deviation and 10-90 % interval; without them these are ``null``;
- ``referral``: the :class:`ReferralRule` and its verdict for this CT;
- ``candidates``: the ``top_k`` most attended candidates, most attended first: attention, centre
  in RAS mm (MONAI world) and LPS mm (DICOM patient coordinates, what a PACS viewer shows), radius
  and detector score.

Referral rule (documented, one of):

- ``--refer-below C``: refer when confidence < C;
- else the *validation rule*: the calibrator run that is applied (the stage-1 run's post-hoc run,
  or the site's ``lungcal recalibrate`` run) stores :data:`REFERRAL_METRIC`, the confidence of the
  least confident case kept when the 10 % least confident cases of its validation split are
  referred (:func:`referral_threshold`, calibrated probabilities); refer when confidence < it;
- else (a checkpoint, an explicit temperature, or a run stored before the metric existed): no
  rule; ``refer`` is ``null``.
"""
from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lungcal.calibration.selective import mutual_information, predictive_entropy
from lungcal.candidates.cache import build_bags
from lungcal.engine.bagset import BagSet
from lungcal.engine.cohort import load_split
from lungcal.engine.predict import predict
from lungcal.engine.site_calibrator import calibrated_probs
from lungcal.errors import ConfigError
from lungcal.paths import atomic_write, atomic_write_text

__all__ = ["REFERRAL_COVERAGE", "REFERRAL_METRIC", "MEMBER_SAMPLES", "ReferralRule", "referral_threshold",
           "confidence", "position_text", "score_rows", "uncertainty_fields", "case_record", "write_outputs",
           "answer_line"]

#: share of validation cases kept by the validation referral rule (the 10 % least confident are referred)
REFERRAL_COVERAGE = 0.9
#: the metric a calibrator run stores: the confidence below which its validation cases were referred
REFERRAL_METRIC = "val/referral_threshold_cov90"
#: the key of MC-dropout / ensemble member probabilities ``(M, N, C)`` in a predict function's output
MEMBER_SAMPLES = "samples"
PREDICTION_COLUMNS = ("subject", "probability", "temperature", "top_candidate", "top_attention", "calibrator",
                      "confidence", "referred", "entropy", "mutual_information", "probability_sd")


def confidence(p1) -> np.ndarray:
    """``max(p, 1 - p)`` of binary p(y=1), float64."""
    p = np.asarray(p1, dtype=np.float64)
    return np.maximum(p, 1.0 - p)


def referral_threshold(probs, coverage: float = REFERRAL_COVERAGE) -> float:
    """The confidence of the least confident case kept when the ``1 - coverage`` least confident are referred.

    ``probs`` is ``(N, 2)`` or ``(N,)`` calibrated p(y=1); ``round(coverage * N)`` cases (at least
    one) are kept, as :func:`lungcal.calibration.selective.metrics_at_coverage` keeps them; a new
    case is referred when its confidence is below the returned value.
    """
    p = np.asarray(probs, dtype=np.float64)
    p1 = p[:, 1] if p.ndim == 2 else p
    if p1.size == 0:
        raise ConfigError("no cases to set a referral threshold on", field="coverage", fix="pass a non-empty split")
    if not 0.0 < float(coverage) <= 1.0:
        raise ConfigError(f"coverage must be in (0, 1], got {coverage!r}", field="coverage",
                          fix="pass the share of cases to keep, e.g. 0.9")
    conf = np.sort(confidence(p1))[::-1]
    k = max(1, int(round(float(coverage) * conf.size)))
    return float(conf[k - 1])


@dataclass(frozen=True)
class ReferralRule:
    """Refer a CT when its confidence is below ``threshold`` (``None``: no rule, nothing is flagged).

    ``source``: ``"validation"`` (the applied calibrator run's :data:`REFERRAL_METRIC`),
    ``"refer_below"`` (given by the user) or ``"none"``.
    """

    threshold: float | None
    source: str = "none"
    coverage: float | None = None

    @classmethod
    def given(cls, refer_below: float) -> ReferralRule:
        c = float(refer_below)
        if not 0.5 <= c <= 1.0:
            raise ConfigError(f"--refer-below must be a confidence in [0.5, 1], got {refer_below!r}",
                              field="refer_below",
                              fix="pass e.g. 0.7 to refer CTs whose p(cancer) lies between 0.3 and 0.7")
        return cls(c, "refer_below")

    @classmethod
    def from_run(cls, run) -> ReferralRule:
        """The validation rule stored on a calibrator run, or no rule."""
        return cls.from_threshold(None if run is None else run.data.metrics.get(REFERRAL_METRIC))

    @classmethod
    def from_threshold(cls, t: float | None) -> ReferralRule:
        """The rule of a validation threshold (:func:`referral_threshold`), or no rule when ``t`` is None or nan."""
        if t is None or not math.isfinite(float(t)):
            return cls(None)
        return cls(float(t), "validation", REFERRAL_COVERAGE)

    def refer(self, conf: float) -> bool | None:
        return None if self.threshold is None else bool(float(conf) < self.threshold)

    def describe(self) -> str:
        if self.threshold is None:
            return ("no referral rule: the model's calibrator run stores no validation threshold "
                    "(pass --refer-below C to refer CTs whose confidence max(p, 1-p) is below C)")
        if self.source == "validation":
            pct = round(100 * (1 - (self.coverage or REFERRAL_COVERAGE)))
            return (f"refer when confidence max(p, 1-p) < {self.threshold:.3f}: the {pct}% least confident cases "
                    "of the calibrator's validation split fall below it")
        return f"refer when confidence max(p, 1-p) < {self.threshold:.3f} (--refer-below)"

    def as_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "source": self.source, "coverage": self.coverage, "rule": self.describe()}


def score_rows(network, rows: Sequence[Mapping[str, Any]], bag_params, calibrator, *, cache_dir: str | os.PathLike,
               device=None, batch_size: int = 16, num_workers: int = 0,
               predict_fn=predict) -> dict[str, Any]:
    """Bags, predictions and calibrated probabilities of ``rows`` (one CT each, in order).

    ``predict_fn(network, loader, device)`` returns ``logits`` and ``attention`` (and optionally
    ``samples``, see the module doc); :func:`lungcal.engine.predict.predict` by default.

    Returns:
        ``{"subjects", "rows", "logits" (N, C), "probs" (N, C) calibrated, "attention" (N, K),
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
    return {"subjects": split["subjects"], "rows": list(rows), "logits": logits,
            "probs": calibrated_probs(calibrator, logits), "attention": _numpy(out["attention"]),
            "candidates": split["candidates"], "member_probs": member_probs}


def uncertainty_fields(p1: float, member_p1: np.ndarray | None = None, method: str = "MC samples") -> dict[str, Any]:
    """The ``uncertainty`` of one CT: entropy always; mutual information, sd and interval with member samples."""
    fields: dict[str, Any] = {"entropy": float(predictive_entropy(np.array([p1]))[0]), "mutual_information": None,
                              "probability_sd": None, "interval": None, "samples": 0, "method": None}
    if member_p1 is not None and np.size(member_p1):
        m = np.asarray(member_p1, dtype=np.float64).reshape(-1)
        fields.update(mutual_information=float(mutual_information(m[:, None])[0]), probability_sd=float(m.std()),
                      interval=[float(np.quantile(m, 0.1)), float(np.quantile(m, 0.9))], samples=int(m.size),
                      method=method)
    return fields


def _lps(ras: Sequence[float]) -> list[float]:
    return [-float(ras[0]), -float(ras[1]), float(ras[2])]


def case_record(scores: Mapping[str, Any], i: int, rule: ReferralRule, *, calibrator: str, top_k: int = 3,
                model: Mapping[str, Any] | None = None, qc=None, label: int | None = None) -> dict[str, Any]:
    """The record of CT ``i`` of :func:`score_rows` (see the module doc).

    ``label``: the known outcome (1 cancer, 0 none) of a CT of a labelled split (a stage-1 run's test
    split); recorded as ``"label"`` and shown on the picture. New patients have none: the key is left out.
    """
    p1 = float(scores["probs"][i, 1])
    conf = float(confidence(p1))
    members = scores.get("member_probs")
    att = np.asarray(scores["attention"][i], dtype=np.float64)
    c = scores["candidates"][i]
    n = min(len(c["score"]), att.shape[0])
    order = [int(j) for j in np.argsort(-att[:n], kind="stable")[:top_k]]
    cands = [{"rank": r + 1, "slot": j, "attention": float(att[j]),
              "ras_mm": [round(float(v), 2) for v in c["world"][j]],
              "lps_mm": [round(v, 2) for v in _lps(c["world"][j])],
              "radius_mm": round(float(c["radius_mm"][j]), 2), "detector_score": float(c["score"][j])}
             for r, j in enumerate(order)]
    record = {
        "pseudonym": scores["subjects"][i],
        "probability": p1,
        "confidence": conf,
        "calibrator": calibrator,
        "uncertainty": uncertainty_fields(p1, None if members is None else members[:, i, 1]),
        "referral": {"refer": rule.refer(conf), "confidence": conf, "threshold": rule.threshold,
                     "source": rule.source, "rule": rule.describe()},
        "candidates": cands,
        "n_candidates": int(n),
        "qc": None if qc is None else {"verdict": qc.verdict, "warnings": [w.name for w in qc.warnings]},
        "model": dict(model or {}),
        "coordinates": "ras_mm: RAS world mm (x to the patient's right, y anterior, z superior); "
                       "lps_mm: DICOM patient coordinates (x to the left, y posterior, z superior)",
    }
    if label is not None:
        record["label"] = int(label)
    return record


def write_outputs(folder: str | os.PathLike, scores: Mapping[str, Any], cases: Sequence[Mapping[str, Any]],
                  temperature: float) -> dict[str, Path]:
    """``predictions.csv`` (one row per CT), ``candidates/<pseudonym>.csv`` (every candidate) and
    ``cases/<pseudonym>.json``; all atomic. Returns their paths (``predictions``, ``cases``)."""
    folder = Path(folder)
    pred = folder / "predictions.csv"
    with atomic_write(pred, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(PREDICTION_COLUMNS)
        for i, case in enumerate(cases):
            att = np.asarray(scores["attention"][i])
            j = int(att.argmax()) if att.size else -1
            unc, ref = case["uncertainty"], case["referral"]
            w.writerow([case["pseudonym"], f"{case['probability']:.6f}",
                        "" if temperature != temperature else f"{temperature:.4f}", j,
                        f"{att[j]:.6f}" if j >= 0 else "", case["calibrator"], f"{case['confidence']:.6f}",
                        "" if ref["refer"] is None else int(ref["refer"]), f"{unc['entropy']:.6f}",
                        _fmt(unc["mutual_information"]), _fmt(unc["probability_sd"])])
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


def position_text(ras_mm: Sequence[float]) -> str:
    """``"R 45  P 12  I 130 mm"``: RAS world mm as patient directions (the side each coordinate points to)."""
    x, y, z = (float(v) for v in ras_mm)
    return (f"{'R' if x >= 0 else 'L'} {abs(x):.0f}  {'A' if y >= 0 else 'P'} {abs(y):.0f}  "
            f"{'S' if z >= 0 else 'I'} {abs(z):.0f} mm")


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _fmt(v) -> str:
    return "" if v is None else f"{float(v):.6f}"


def answer_line(case: Mapping[str, Any]) -> str:
    """One line per CT: pseudonym, probability (+ interval), referral, the most attended candidate."""
    unc, ref = case["uncertainty"], case["referral"]
    iv = unc.get("interval")
    p = f"p(cancer) {case['probability']:.2f}" + (f" [{iv[0]:.2f}-{iv[1]:.2f}]" if iv else "")
    verdict = ("referral: no rule" if ref["refer"] is None else
               f"REFER (confidence {ref['confidence']:.3f} < {ref['threshold']:.3f})" if ref["refer"] else
               f"not referred (confidence {ref['confidence']:.3f})")
    top = case["candidates"][0] if case["candidates"] else None
    where = "no candidate" if top is None else f"top candidate {position_text(top['ras_mm'])}, attention " \
        f"{top['attention']:.2f}"
    return f"{case['pseudonym']}  {p}  {verdict}  {where}"
