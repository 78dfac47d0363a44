"""One scored CT as a clinician reads it: its record, the referral rule, the printed line.

A scoring path (:func:`lungcal.ctapp.infer.scoring.score_rows`, or a stage-1 run's test split) gives
calibrated probabilities, attention and candidates; :func:`case_record` turns CT ``i`` into the record
written as ``cases/<pseudonym>.json``:

- ``probability``: calibrated p(cancer); ``confidence`` = max(p, 1 - p);
- ``uncertainty``: the predictive entropy of ``probability`` (nats) always; with member probabilities
  (MC-dropout passes or ensemble members), their mutual information, standard deviation and 10-90 %
  interval; without them these are ``null``;
- ``referral``: the :class:`ReferralRule` and its verdict for this CT;
- ``decision``: with a site whose recalibration stored a decision threshold (``lungcal recalibrate
  --miss-rate``, :mod:`lungcal.calibration.guarantee`), ``{"positive": p >= threshold (sent on for
  work-up), "threshold", "statement" (the guarantee in one sentence), "covered" (false for a CT flagged
  outside the model's reference, whose statement then says the guarantee does not cover it), "alpha",
  "delta", "n_cancers"}`` (:func:`decision_block`); else ``null``;
- ``candidates``: the ``top_k`` most attended candidates, most attended first: attention, centre in RAS
  mm (MONAI world) and LPS mm (DICOM patient coordinates, what a PACS viewer shows), radius and
  detector score.
- ``out_of_distribution``: whether the CT lies outside the model's training data (its acquisition outside
  everything the training split held, or its embedding beyond the validation cases' range;
  :mod:`lungcal.ctapp.infer.ood`); a flagged CT is **referred** whatever its confidence, with the reason
  :data:`OOD_REASON`. ``null`` where the scoring path does not check (a stage-1 run's test split);
- ``notice``: a sentence every answer carries (a demo model: :data:`DEMO_NOTICE`), else ``null``.

Referral (``referral.refer``, with ``referral.reasons``) is true when the CT is outside the training data, or
by the rule (one of):

- ``--refer-below C``: refer when confidence < C;
- else the *validation rule*: the calibrator run that is applied (the stage-1 run's post-hoc run, or
  the site's ``lungcal recalibrate`` run) stores :data:`REFERRAL_METRIC`, the confidence of the least
  confident case kept when the 10 % least confident cases of its validation split are referred
  (:func:`referral_threshold`, calibrated probabilities); refer when confidence < it;
- else (a checkpoint, an explicit temperature, or a run stored before the metric existed): no rule;
  ``refer`` is ``null``.

Training (the post-hoc runs store the rule), inference and site recalibration all use it, so it lives
below them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lungcal.calibration.guarantee import MissedCancerGuarantee
from lungcal.calibration.selective import (
    REFERRAL_COVERAGE,
    REFERRAL_METRIC,
    confidence,
    mutual_information,
    predictive_entropy,
)
from lungcal.errors import ConfigError

__all__ = ["ReferralRule", "WORK_UP", "NO_WORK_UP", "OOD_REASON", "DEMO_NOTICE",
           "position_text", "uncertainty_fields", "decision_block", "case_record", "answer_line", "ood_summary"]

#: the printed verdicts of a decision threshold
WORK_UP = "work-up"
NO_WORK_UP = "no work-up (below the guaranteed threshold)"
#: what the printed line adds to the decision of a CT outside the model's reference
NOT_COVERED = "not covered by the guarantee: outside the reference"
#: the referral reason of a CT outside the model's training data
OOD_REASON = "outside the model's training data"
#: what every answer of a model trained on the synthetic demo cohort says
DEMO_NOTICE = "demo model trained on synthetic phantoms: not a clinical estimate"


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


def decision_block(p1: float, guarantee: MissedCancerGuarantee | None,
                   ood: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``decision`` of one CT under a site's guaranteed threshold (``None`` without one).

    ``covered``: whether the guarantee speaks for this CT. It was certified on the site's labelled CTs, which
    lay inside the model's reference; a CT flagged outside it (``ood``, :mod:`lungcal.ctapp.infer.ood`) is not
    exchangeable with them, so its decision is still given, but its ``statement`` says the guarantee does not
    cover it."""
    if guarantee is None:
        return None
    covered = not (ood and ood.get("flagged"))
    statement = guarantee.statement()
    if not covered:
        assert ood is not None
        why = ood_summary(ood, ranges=False)
        statement = (f"NOT COVERED by the guarantee: this CT lies outside {ood.get('reference') or 'the training data'}"
                     f"{f' ({why})' if why else ''}, and the guarantee speaks only for CTs like those it was "
                     f"certified on ({statement})")
    return {"positive": bool(guarantee.decide([p1])[0]), "threshold": guarantee.threshold,
            "statement": statement, "covered": covered, "alpha": guarantee.alpha, "delta": guarantee.delta,
            "n_cancers": guarantee.n_cancers}


def _lps(ras: Sequence[float]) -> list[float]:
    return [-float(ras[0]), -float(ras[1]), float(ras[2])]


def ood_summary(ood: Mapping[str, Any] | None, ranges: bool = True) -> str:
    """What put a flagged CT outside the training data, in a few words (``pixel_mm 0.703 (training 4.9-5.1)``,
    ``embedding distance 3.1 > 1.2``; without the training ranges when not ``ranges``); empty when not flagged."""
    if not ood or not ood.get("flagged"):
        return ""
    parts = [f"{a['field']} {float(a['value']):.3g}"
             + (f" (training {float(a['low']):.3g}-{float(a['high']):.3g})" if ranges else "")
             for a in ood.get("acquisition_outside") or []]
    d, t = ood.get("embedding_distance"), ood.get("embedding_threshold")
    if d is not None and t is not None and d > t:
        parts.append(f"embedding distance {d:.3g} > {t:.3g}")
    return ", ".join(parts)


def case_record(scores: Mapping[str, Any], i: int, rule: ReferralRule, *, calibrator: str, top_k: int = 3,
                model: Mapping[str, Any] | None = None, qc=None, label: int | None = None,
                decision: MissedCancerGuarantee | None = None, ood: Mapping[str, Any] | None = None,
                notice: str | None = None) -> dict[str, Any]:
    """The record of CT ``i`` of :func:`score_rows` (see the module doc).

    ``decision``: the site's guaranteed threshold (:func:`lungcal.ctapp.evaluate.calibrators.site_guarantee`),
    applied to this CT's calibrated probability; ``None`` records ``"decision": null``.

    ``label``: the known outcome (1 cancer, 0 none) of a CT of a labelled split (a stage-1 run's test
    split); recorded as ``"label"`` and shown on the picture. New patients have none: the key is left out.

    ``ood``: this CT's ``out_of_distribution`` block (:meth:`lungcal.ctapp.infer.ood.TrainingRange.block`); a
    flagged CT is referred with :data:`OOD_REASON`. ``notice``: a sentence the answer carries (:data:`DEMO_NOTICE`).
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
    refer = rule.refer(conf)
    reasons = [f"confidence {conf:.3f} < {rule.threshold:.3f}"] if refer else []
    if ood is not None and ood.get("flagged"):  # out of its depth: referred whatever its confidence
        refer = True
        reasons.append(OOD_REASON)
    record = {
        "pseudonym": scores["subjects"][i],
        "probability": p1,
        "confidence": conf,
        "calibrator": calibrator,
        "uncertainty": uncertainty_fields(p1, None if members is None else members[:, i, 1]),
        "referral": {"refer": refer, "confidence": conf, "threshold": rule.threshold,
                     "source": rule.source, "rule": rule.describe(), "reasons": reasons},
        "decision": decision_block(p1, decision, ood),
        "candidates": cands,
        "n_candidates": int(n),
        "qc": None if qc is None else {"verdict": qc.verdict, "warnings": [w.name for w in qc.warnings]},
        "out_of_distribution": None if ood is None else dict(ood),
        "notice": notice,
        "model": dict(model or {}),
        "coordinates": "ras_mm: RAS world mm (x to the patient's right, y anterior, z superior); "
                       "lps_mm: DICOM patient coordinates (x to the left, y posterior, z superior)",
    }
    if label is not None:
        record["label"] = int(label)
    return record


def position_text(ras_mm: Sequence[float]) -> str:
    """``"R 45  P 12  I 130 mm"``: RAS world mm as patient directions (the side each coordinate points to)."""
    x, y, z = (float(v) for v in ras_mm)
    return (f"{'R' if x >= 0 else 'L'} {abs(x):.0f}  {'A' if y >= 0 else 'P'} {abs(y):.0f}  "
            f"{'S' if z >= 0 else 'I'} {abs(z):.0f} mm")


def answer_line(case: Mapping[str, Any]) -> str:
    """One line per CT: pseudonym, probability (+ interval), referral (and why: low confidence, outside the
    training data), the site's decision (when it has a guaranteed threshold), the most attended candidate, the
    notice (a demo model)."""
    unc, ref = case["uncertainty"], case["referral"]
    iv = unc.get("interval")
    p = f"p(cancer) {case['probability']:.2f}" + (f" [{iv[0]:.2f}-{iv[1]:.2f}]" if iv else "")
    reasons = list(ref.get("reasons") or [])
    if ref["refer"] and not reasons:  # a record made before reasons were kept
        reasons = [f"confidence {ref['confidence']:.3f} < {ref['threshold']:.3f}"]
    ood = ood_summary(case.get("out_of_distribution"))
    why = "; ".join(f"{r}: {ood}" if r == OOD_REASON and ood else r for r in reasons)
    verdict = ("referral: no rule" if ref["refer"] is None else f"REFER ({why})" if ref["refer"] else
               f"not referred (confidence {ref['confidence']:.3f})")
    decision = case.get("decision")
    if decision is not None:
        verdict += f"  {WORK_UP if decision['positive'] else NO_WORK_UP}"
        if decision.get("covered") is False:
            verdict += f" ({NOT_COVERED})"
    top = case["candidates"][0] if case["candidates"] else None
    where = "no candidate" if top is None else f"top candidate {position_text(top['ras_mm'])}, attention " \
        f"{top['attention']:.2f}"
    notice = f"  [{case['notice']}]" if case.get("notice") else ""
    return f"{case['pseudonym']}  {p}  {verdict}  {where}{notice}"
