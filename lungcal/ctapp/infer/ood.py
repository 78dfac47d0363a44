"""Per CT: is it the model's kind of data? A probability that knows when it is out of its depth.

``lungcal predict`` places each CT against what the model was trained on, with what its stage-1 run logged:

- **acquisition**: the CT's slice thickness, slice spacing, pixel size, HU of air, noise and edge width (the
  series checks measure them, :attr:`lungcal.ct.qc.QCReport.acquisition`) against everything the training
  split held (its ``data/acquisition.json``, widened by the estimators' tolerance;
  :func:`lungcal.ct.acquisition.outside_training`);
- **embedding**: the CT's pooled bag embedding against the validation cases' (``data/site_reference.npz``):
  its distance to its 5th nearest validation case beyond the 99th percentile of theirs, cross-fitted
  (:class:`lungcal.calibration.shift.EmbeddingRange`; a validation split under about 99 cases is too small for
  that level, and the embedding is then not checked).

After a site's labelled recalibration (``lungcal recalibrate``), the site's own calibration CTs join the
reference: ``predict --site`` widens the acquisition range by theirs and fits the embedding range on the
validation cases and theirs together (:meth:`TrainingRange.joined`; the recalibration run logs both as the
stage-1 run does). Without that, every CT of a site of another scanner stays outside the training range after
the site was recalibrated for it, and every one would be referred. The new CTs of one call are also checked as a
whole against those calibration CTs (:func:`batch_check`, the site check's statistics), so that a scanner change
since the recalibration is seen, not only the verdict stored then.

Either makes the CT *flagged*: its record's ``out_of_distribution`` block says why, and it is referred
(:data:`lungcal.ctapp.evaluate.cases.OOD_REASON`). What could not be checked (a checkpoint instead of a run,
a run logged before these artifacts, series checks off, too small a validation split) is said in the block
(``checked``, ``not_checked``), and nothing is flagged for it. This is the per-CT half of ``lungcal
site-check`` (which tests a whole site), computed here because ``ctapp/infer`` may not import ``ctapp/site``.

A model whose stage-1 run was trained on the synthetic demo cohort (tag ``lungcal.dataset = synthetic``)
says so on every answer (:func:`demo_notice`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lungcal.calibration.shift import EmbeddingRange
from lungcal.ct.acquisition import AcquisitionStats, join_summaries, outside_training
from lungcal.ctapp.evaluate.cases import DEMO_NOTICE, OOD_REASON
from lungcal.ctapp.evaluate.reports import binary_scores, flat_features
from lungcal.ctapp.evaluate.site_assessment import MIN_SITE_CTS, SCANNER_SHIFT, Reference, acquisition_checks, assess
from lungcal.errors import DataError
from lungcal.tracking import TAG_DATASET, run_acquisition_summary, run_site_reference

__all__ = ["SYNTHETIC_DATASET", "TrainingRange", "demo_notice", "batch_check", "batch_lines"]

#: the ``lungcal.dataset`` tag of a model trained on the synthetic demo cohort
SYNTHETIC_DATASET = "synthetic"


def demo_notice(run) -> str | None:
    """:data:`DEMO_NOTICE` when ``run`` (a stage-1 MLflow run) was trained on the synthetic cohort, else None."""
    if run is None:
        return None
    return DEMO_NOTICE if str(run.data.tags.get(TAG_DATASET, "")).startswith(SYNTHETIC_DATASET) else None


@dataclass
class TrainingRange:
    """What a stage-1 run knows of its training data, to place one CT against (module doc).

    ``summary``: the training split's acquisition summary (None: not logged); ``embedding``: the validation
    cases' embedding range (None: not possible); ``notes``: why a part cannot be checked; ``reference``: what
    the range holds, in words; ``features``: the embeddings ``embedding`` was fitted on.
    """

    summary: Mapping[str, Any] | None = None
    embedding: EmbeddingRange | None = None
    notes: dict[str, str] = field(default_factory=dict)
    #: what the range holds, in words (the training data, and a site's calibration CTs once joined)
    reference: list[str] = field(default_factory=lambda: ["the training data"])
    #: the reference embeddings the range was fitted on (kept so that a site's can join them)
    features: np.ndarray | None = None

    @classmethod
    def from_run(cls, tracking_uri: str, run, site_run=None, site: str | None = None) -> TrainingRange:
        """The range of a stage-1 run (``None``: a checkpoint file, nothing to compare with); with ``site_run``
        (the site's ``lungcal recalibrate`` run), joined by the site's calibration CTs (:meth:`joined`)."""
        if run is None:
            why = "the model is a checkpoint file, not an MLflow run: its training data is unknown"
            return cls(notes={"acquisition": why, "embedding": why})
        run_id = run.info.run_id
        notes = {}
        summary = run_acquisition_summary(tracking_uri, run_id)
        if summary is None:
            notes["acquisition"] = "the model's run logged no acquisition summary of its training data"
        ref = run_site_reference(tracking_uri, run_id)
        feats = None
        if ref is None or ref.get("features") is None:
            notes["embedding"] = "the model's run logged no validation embeddings (data/site_reference.npz)"
        else:
            feats = flat_features(ref["features"])
        out = cls(summary, None, notes, features=feats)._fit("validation split")
        if site_run is None:
            return out
        site_id = site_run.info.run_id
        site_ref = run_site_reference(tracking_uri, site_id)
        return out.joined(run_acquisition_summary(tracking_uri, site_id),
                          None if site_ref is None or site_ref.get("features") is None
                          else flat_features(site_ref["features"]), site or site_id)

    def _fit(self, what: str) -> TrainingRange:
        """Fit the embedding range on :attr:`features` (a note instead where too few)."""
        self.embedding = None
        if self.features is None:
            return self
        try:
            self.embedding = EmbeddingRange(self.features)
        except DataError as exc:
            self.notes["embedding"] = f"too small a {what} for an embedding range: {exc.message}"
            return self
        if not math.isfinite(self.embedding.threshold):
            self.embedding = None  # too few cases for the range's level: nothing could ever be flagged
            self.notes["embedding"] = (f"too small a {what} for an embedding range: {len(self.features)} cases, "
                                       "too few for its 99th percentile")
        else:
            self.notes.pop("embedding", None)
        return self

    def joined(self, site_summary: Mapping[str, Any] | None, site_features: np.ndarray | None,
               site: str) -> TrainingRange:
        """This range with a site's calibration CTs joined (module doc): the acquisition range widened by the
        site's summary (:func:`lungcal.ct.acquisition.join_summaries`), the embedding range refitted on the
        reference's and the site's embeddings together. What the site's run did not log is left as it was."""
        summary = self.summary
        parts = []
        if summary is not None and site_summary is not None:
            summary = join_summaries(summary, site_summary)
            parts.append(f"{int(site_summary.get('n_measured', 0))} CTs' acquisition")
        feats = self.features
        if feats is not None and site_features is not None and site_features.shape[1:] == feats.shape[1:]:
            feats = np.concatenate([feats, np.asarray(site_features, float)])
            parts.append(f"{len(site_features)} CTs' embeddings")
        if not parts:
            return self
        out = TrainingRange(summary, self.embedding, dict(self.notes),
                            [*self.reference, f"site {site}'s calibration CTs ({', '.join(parts)})"], feats)
        return out._fit("validation split and site calibration CTs") if feats is not self.features else out

    def block(self, stats: AcquisitionStats | None, features: np.ndarray | None) -> dict[str, Any]:
        """The ``out_of_distribution`` block of one CT: ``flagged``, ``reason``, ``acquisition_outside`` (the
        fields outside the training data, each with its value and range; None when not checked),
        ``embedding_distance`` and ``embedding_threshold`` (None when not checked), ``checked`` (per part) and
        ``not_checked`` (per part, why)."""
        notes = dict(self.notes)
        outside = None
        if self.summary is not None:
            if stats is None:
                notes["acquisition"] = "this CT's acquisition was not measured (series checks off or not measurable)"
            else:
                outside = outside_training(self.summary, stats)
        distance = threshold = None
        if self.embedding is not None:
            if features is None:
                notes["embedding"] = "the network gave no embedding for this CT"
            else:
                distance = float(self.embedding.distance(np.asarray(features, float).reshape(1, -1))[0])
                threshold = float(self.embedding.threshold)
        flagged = bool(outside) or (distance is not None and threshold is not None and distance > threshold)
        checked = {"acquisition": outside is not None, "embedding": distance is not None}
        out: dict[str, Any] = {"flagged": flagged, "reason": OOD_REASON if flagged else None,
                               "acquisition_outside": outside, "embedding_distance": distance,
                               "embedding_threshold": threshold, "checked": checked, "not_checked": notes,
                               "reference": " and ".join(self.reference)}
        if not any(checked.values()):
            out["note"] = "the check was not possible: " + "; ".join(notes.values())
        return out


def batch_check(tracking_uri: str, site_run, site: str, logits: np.ndarray, features: np.ndarray | None,
                stats: Sequence[AcquisitionStats | None]) -> dict[str, Any]:
    """The new CTs of one ``predict --site`` call, as a whole, against the site's own calibration CTs (what its
    ``lungcal recalibrate`` run logged): the site check's statistics and verdict
    (:func:`lungcal.ctapp.evaluate.site_assessment.assess`). A ``scanner_shift`` here means these CTs are not
    like the ones the site's calibrator and threshold were fitted on, whatever the stored check said then.

    Returns ``{"verdict", "reasons", "n", "effect"}``, or ``{"verdict": None, "note"}`` when it cannot be said
    (fewer than :data:`MIN_SITE_CTS` CTs, a recalibration that logged no calibration CTs, too small a reference).
    """
    n = int(len(logits))
    ref = run_site_reference(tracking_uri, site_run.info.run_id)
    if ref is None or ref.get("scores") is None or ref.get("labels") is None:
        return {"verdict": None, "n": n, "note": f"site {site}'s recalibration logged no calibration CTs (run "
                                                  "lungcal recalibrate again to log them)"}
    if n < MIN_SITE_CTS:
        return {"verdict": None, "n": n, "note": f"{n} CT(s), too few to compare with site {site}'s calibration "
                                                  f"CTs (a check needs {MIN_SITE_CTS})"}
    reference = Reference(np.asarray(ref["scores"], float), np.asarray(ref["labels"]).astype(int),
                          None if ref.get("features") is None else flat_features(ref["features"]),
                          f"site {site}'s calibration CTs")
    try:
        reference.check()
    except DataError as exc:
        return {"verdict": None, "n": n, "note": exc.message}
    acq = acquisition_checks(run_acquisition_summary(tracking_uri, site_run.info.run_id), stats)
    found = assess(reference, binary_scores(logits), features if reference.features is not None else None, acq)
    return {"verdict": found["verdict"], "reasons": found["reasons"], "n": n, "effect": found["effect"]}


def batch_lines(check: Mapping[str, Any] | None, site: str | None) -> list[str]:
    """The printed lines of :func:`batch_check` (none without a site)."""
    if check is None:
        return []
    if check["verdict"] is None:
        return [f"  site check    not run on these CTs: {check['note']}"]
    why = f" ({check['reasons'][0]})" if check.get("reasons") else ""
    out = [f"  site check    these {check['n']} CTs against site {site}'s calibration CTs: {check['verdict']}{why}"]
    if check["verdict"] == SCANNER_SHIFT:
        out.append(f"  WARNING       these CTs differ from the ones site {site} was recalibrated on: its calibrator "
                   "and threshold may not hold for them; recalibrate on labelled CTs like these (lungcal recalibrate)")
    return out
