"""Scoring new CTs: the run step of ``bundles/inference.json`` and ``lungcal predict``, one code path.

The model is a stage-1 run or checkpoint (:func:`lungcal.ctapp.model.checkpoint.load_stage1`); with a
run, the calibrator of its linked post-hoc run is applied: the reference one fitted by the stage-1
bundle (TS by default) or, with ``site``, whatever ``lungcal recalibrate`` stored at that site (TS,
Platt, isotonic, ... or a prior adjustment; :mod:`lungcal.ctapp.evaluate.calibrators`). When that site's
recalibration also stored a decision threshold with a missed-cancer guarantee (``--miss-rate``), each CT
is called positive (work-up) or not by it, and its record states the guarantee (``decision``).

Order of work:

1. inputs (:func:`lungcal.ctapp.data.inputs.read_inputs`: a folder is read as ``lungcal qc`` reads it;
   masks, label maps and other files are skipped and listed by name), model, calibrator, referral
   rule: a user error here (no CT, unknown run, unknown site) stops the command in one line before
   any file is written or any MLflow run opened;
2. the local key ``inputs.csv`` (pseudonym -> input path, and what became of each; never logged) is
   written at once, so a refused CT's pseudonym can always be looked up;
3. each CT is checked (series checks) and its bag built, one at a time: a CT that fails a check, or
   cannot be read, or is too small (:mod:`lungcal.ct.extent`), is *refused* with its reason, and the
   others go on;
4. only when at least one CT is left does one MLflow run open (tag ``lungcal.inference``, linked to the
   model's run by ``lungcal.parent_run``; ``lungcal.outcome`` ``complete``, ``partial`` or, should it
   break off, ``failed``): the inputs count and settings (params), ``qc.csv``, ``predictions.csv`` and
   the gallery (the most confident calls each way and the referred CTs,
   ``gallery/<group>/<pseudonym>.png``). The output folder gets ``predictions.csv``,
   ``candidates/<pseudonym>.csv``, ``cases/<pseudonym>.json`` + ``.png``
   (:mod:`lungcal.ctapp.infer.scoring`, :mod:`lungcal.ctapp.evaluate.pictures`), ``qc.csv`` and
   ``inputs.csv``.

Each scored CT is also placed against the model's training data (:mod:`lungcal.ctapp.infer.ood`): one whose
acquisition or embedding lies outside it is flagged (``out_of_distribution`` in its JSON, the line and the
picture) and referred. A model trained on the synthetic demo cohort says so on every answer (``notice``).
A site's stored *prior adjustment* is applied only if its recalibration's site check allowed it
(:func:`lungcal.ctapp.evaluate.calibrators.prior_guard`): refused (exit code 2) after a ``scanner_shift``
verdict, with a warning on every run when the recalibration was forced.

When some CTs were refused, :meth:`InferenceRun.run` raises :class:`PartlyRefused` (a ``DataError``:
one line, exit code 2) after everything else is written; when every CT was refused it raises a
``DataError`` and opens no run.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.candidates.cache import BagParams, build_entry, masker_from_config
from lungcal.ct.qc import QCReport
from lungcal.ctapp.data.bagbuild import LocalRunner
from lungcal.ctapp.data.cohort import resolve_output_dir
from lungcal.ctapp.data.inputs import CT_SUFFIXES, KEY_FILE, input_rows, read_inputs, write_key
from lungcal.ctapp.data.series_qc import log_warnings, qc_csv_rows, screen, write_qc_csv
from lungcal.ctapp.evaluate.calibrators import (
    prior_guard,
    reference_calibrator,
    site_calibrator,
    site_guarantee,
    temperature_calibrator,
)
from lungcal.ctapp.evaluate.cases import ReferralRule, answer_line, case_record
from lungcal.ctapp.evaluate.pictures import gallery_selection, write_pictures
from lungcal.ctapp.infer.ood import TrainingRange, batch_check, batch_lines, demo_notice
from lungcal.ctapp.infer.scoring import score_rows, write_outputs
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.ctapp.model.predict import predict
from lungcal.errors import ConfigError, DataError
from lungcal.runtime import resolve_device
from lungcal.runtime.exit_hook import find_lungcal_error
from lungcal.runtime.settings import typed_arguments
from lungcal.tracking import (
    CT_EXPERIMENT,
    TAG_DATASET,
    TAG_FORCED,
    TAG_INFERENCE,
    TAG_MODEL,
    TAG_OUTCOME,
    TAG_SITE,
    TAG_STAGE1,
    RunTracker,
    default_tracking_uri,
    file_digest,
    linked_calibrator_run,
)

__all__ = ["CT_SUFFIXES", "InferenceRun", "PartlyRefused"]

logger = logging.getLogger(__name__)


class PartlyRefused(DataError):
    """Some CTs were refused, the others scored and written: raised by :meth:`InferenceRun.run` after
    the outputs and the MLflow run are complete, so that the exit code (2) says so; ``result`` holds
    what ``run()`` returns otherwise."""

    def __init__(self, message: str, *, result: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.result = result


def _qc_refusal(report: QCReport | None) -> str | None:
    """Why a CT is refused by its series checks (the first failed check, its value and the others), or None."""
    if report is None or not report.failed:
        return None
    first, rest = report.failed[0], report.failed[1:]
    also = f"; also failed: {', '.join(c.name for c in rest)}" if rest else ""
    return f"series check '{first.name}' failed: {first.reason} (measured: {first.value}{also})"


def _build_refusal(exc: BaseException, image: str) -> str:
    """Why a CT's bag could not be built, without its path (the key ``inputs.csv`` holds it)."""
    err = find_lungcal_error(exc)
    text = err.message if err is not None else f"{type(exc).__name__}: {exc}"
    p = Path(image)
    for s in sorted({image, str(p.absolute()), p.name}, key=len, reverse=True):
        if len(s) >= 4:
            text = text.replace(s, "<image>")
    return text.rstrip(".")


class InferenceRun:
    """Calibrated probabilities, referral and pictures for new CTs, as one MLflow run.

    Args:
        inputs: one CT (NIfTI/MHD/NRRD file or DICOM series folder), a folder of CTs, or a datalist
            JSON whose rows need only ``image`` (:func:`lungcal.ctapp.data.inputs.input_rows`).
        stage1_run_id / checkpoint: the model (default: latest finished stage-1 run).
        temperature: overrides the temperature (1.0 = uncalibrated) when set.
        site: apply the calibrator ``lungcal recalibrate`` stored for this site (any kind), and its
            decision threshold when it stored one (``--miss-rate``).
        output: the output folder (default ``<output_dir>/inference/<timestamp>``).
        output_dir, tracking_uri, device, num_workers, batch_size: as for the stage-1 bundles.
        qc: series-check thresholds (the bundle's ``qc`` section); a CT that fails a check is
            refused (its pseudonym, the check and the measured value are printed; the others are
            scored); warnings are logged. ``None`` checks nothing.
        refer_below: refer a CT whose confidence max(p, 1-p) is below this; default: the applied
            calibrator run's validation rule (:class:`lungcal.ctapp.evaluate.cases.ReferralRule`).
        pictures: write ``cases/<pseudonym>.png`` per CT and log the gallery.
        top_k: candidates per CT in its record and picture.
        mode: the ``lungcal.inference`` tag (``bundle`` or ``predict``).
        predict_fn: ``predict(network, loader, device)``; one that also returns ``samples`` (M, N, C)
            member probabilities (MC dropout, an ensemble) fills the uncertainty fields.
    """

    @typed_arguments  # the bundle's switch (pictures) arrives here: parsed once, by annotation
    def __init__(self, inputs: str | None = None, stage1_run_id: str | None = None, checkpoint: str | None = None,
                 temperature: float | None = None, output: str | None = None,
                 output_dir: str | os.PathLike | None = None, tracking_uri: str | None = None,
                 device: str | None = "auto", num_workers: int = 2, batch_size: int = 16,
                 site: str | None = None, qc: Any = None, refer_below: float | None = None, pictures: bool = True,
                 top_k: int = 3, mode: str = "bundle", predict_fn: Callable = predict) -> None:
        if not inputs:
            raise ConfigError("no inputs given", field="inputs", fix="pass --inputs <datalist.json or folder of CTs>")
        self.output_dir = resolve_output_dir(output_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.output_dir)
        self.stage1_run_id, self.checkpoint = stage1_run_id, checkpoint
        self.inputs = Path(str(inputs)).expanduser()
        self.temperature = temperature
        self.site = str(site) if site else None
        self.output = Path(output) if output else self.output_dir / "inference" / time.strftime("%Y%m%d-%H%M%S")
        self.device = resolve_device(device)
        self.num_workers, self.batch_size = int(num_workers), int(batch_size)
        self.qc = qc
        self.rule = ReferralRule.given(refer_below) if refer_below is not None else None
        self.pictures, self.top_k, self.mode = pictures, int(top_k), str(mode)
        self.predict_fn = predict_fn

    def rows(self) -> list[dict]:
        """Rows of the inputs (:func:`lungcal.ctapp.data.inputs.input_rows`)."""
        return input_rows(self.inputs)

    def refusals(self, rows: list[dict], reports: list[QCReport | None], bag_params: Any) -> dict[int, str]:
        """Why each refused row (by index) is refused: a failed series check, else its bag could not be
        built (unreadable, too small, no lungs). The bags of the others are built into the cache
        (where :func:`score_rows` finds them), ``num_workers`` processes at a time; one CT's failure
        never stops the others. A ``ConfigError`` (the same for every CT) is raised."""
        refused = {i: why for i, why in enumerate(map(_qc_refusal, reports)) if why is not None}
        todo = [i for i in range(len(rows)) if i not in refused]
        params = BagParams.from_any(bag_params)
        root = self.output_dir / "cache" / "bags"
        root.mkdir(parents=True, exist_ok=True)
        tasks = [(str(rows[i]["image"]), params, str(root), "content", None) for i in todo]
        for j, _, exc in LocalRunner(self.num_workers).run(build_entry, tasks):
            if exc is None:
                continue
            if isinstance(exc, ConfigError):
                raise exc
            refused[todo[j]] = _build_refusal(exc, str(rows[todo[j]]["image"]))
        return dict(sorted(refused.items()))

    def resolve_calibrator(self, run):
        """The explicit temperature, else the site's stored calibrator (``site``), else the run's
        reference calibrator; ``None`` (plain softmax) when there is none."""
        if self.temperature is not None:
            return temperature_calibrator(float(self.temperature))
        if run is None:
            if self.site:
                raise ConfigError("--site needs the model as an MLflow run", field="site",
                                  fix="pass --stage1_run_id, or --temperature <T> with a checkpoint")
            return None
        if self.site:
            cal = site_calibrator(self.tracking_uri, run, self.site)
            if cal is None:
                raise ConfigError(f"run {run.info.run_id} has no finished run recalibrated at site {self.site!r}",
                                  field="site",
                                  fix=f"run `lungcal recalibrate --model {run.info.run_id} --datalist <site.json>` "
                                      "first, or drop --site to use the reference calibrator")
            return cal
        cal = reference_calibrator(self.tracking_uri, run)
        if cal is None:
            logger.warning("no finished calibrator run linked to %s: probabilities are uncalibrated", run.info.run_id)
        return cal

    def resolve_temperature(self, run) -> float:
        """The temperature that :meth:`resolve_calibrator` applies (nan when it is not a TS)."""
        cal = self.resolve_calibrator(run)
        return 1.0 if cal is None else float(getattr(cal, "temperature", float("nan")))

    def resolve_decision(self, run):
        """The site's guaranteed decision threshold (:func:`site_guarantee`), from the run whose calibrator
        :meth:`resolve_calibrator` applies; ``None`` without ``site``, with an explicit temperature (the
        threshold belongs to the site calibrator's probabilities), or when the site's run stored none."""
        if not self.site or run is None or self.temperature is not None:
            return None
        return site_guarantee(self.tracking_uri, run, self.site)

    def check_prior(self, run, cal) -> tuple[str | None, str | None]:
        """Whether the site's stored calibrator may be applied (:func:`prior_guard`, on the site's recalibration
        run): ``(warning line or None, the overridden verdict of a forced run or None)``; raises ConfigError
        for a prior adjustment whose site check found ``scanner_shift`` and was not forced."""
        if not self.site or run is None or self.temperature is not None:
            return None, None
        recal = linked_calibrator_run(self.tracking_uri, run, site=self.site)
        warning = prior_guard(cal, recal, self.site)
        forced = recal.data.tags.get(TAG_FORCED) if warning is not None and recal is not None else None
        return warning, forced

    def resolve_rule(self, run) -> ReferralRule:
        """``refer_below`` when given, else the validation rule of the applied calibrator's run, else none."""
        if self.rule is not None:
            return self.rule
        if self.temperature is not None or run is None:
            return ReferralRule(None)
        return ReferralRule.from_run(linked_calibrator_run(self.tracking_uri, run, site=self.site))

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Score every CT that is not refused; write the outputs; log the MLflow run; print one line per
        CT, then the refused and the skipped ones. Raises :class:`PartlyRefused` at the end when some
        CT was refused, a ``DataError`` (no run) when all were."""
        found = read_inputs(self.inputs)
        all_rows = found.rows
        stage1 = load_stage1(self.stage1_run_id, self.tracking_uri, checkpoint=self.checkpoint, device=self.device)
        cal = self.resolve_calibrator(stage1.run)
        temp = 1.0 if cal is None else float(getattr(cal, "temperature", float("nan")))
        cal_name = "none" if cal is None else str(cal.name)
        rule = self.resolve_rule(stage1.run)
        decision = self.resolve_decision(stage1.run)
        prior_warning, forced = self.check_prior(stage1.run, cal)
        if prior_warning:
            print(f"  {prior_warning}", flush=True)
        notice = demo_notice(stage1.run)
        # a site's recalibration joins its calibration CTs to the range (lungcal.ctapp.infer.ood)
        site_run = (linked_calibrator_run(self.tracking_uri, stage1.run, site=self.site)
                    if self.site and stage1.run is not None and self.temperature is None else None)
        training = TrainingRange.from_run(self.tracking_uri, stage1.run, site_run, self.site)
        # the key first: whatever happens to a CT from here on, its pseudonym can be looked up
        key = write_key(all_rows, self.output, skipped=found.skipped, source=self.inputs)
        for name, why in found.skipped:
            print(f"  skipped {name}: {why}", flush=True)
        all_reports: list[QCReport | None] = [None] * len(all_rows)
        if self.qc is not None:  # a series that fails a check is refused; warnings are logged
            stored = BagParams.from_any(stage1.bag_params).preprocess.get("masker")  # None: the default
            masker = masker_from_config(stored) if stored else None
            all_reports = screen(all_rows, self.qc, self.output_dir / "cache" / "qc", masker=masker,
                                 num_workers=self.num_workers)
            log_warnings(all_rows, all_reports)
        refused = self.refusals(all_rows, all_reports, stage1.bag_params)
        names = [str(r["subject"]) for r in all_rows]
        status = {names[i]: f"refused: {why}" for i, why in refused.items()}
        write_key(all_rows, self.output, status, found.skipped, self.inputs)
        qc_path = write_qc_csv(self.output / "qc.csv", qc_csv_rows(all_rows, all_reports))
        refused_lines = [f"{names[i]}  refused: {why}" for i, why in refused.items()]
        keep = [i for i in range(len(all_rows)) if i not in refused]
        if not keep:
            print("\n".join(refused_lines), flush=True)
            first = next(iter(refused))
            raise DataError(f"no CT scored: {len(refused)} of {len(all_rows)} refused (first: {names[first]}: "
                            f"{refused[first]})",
                            file=self.output / KEY_FILE,
                            fix=f"each refused CT is listed above; {KEY_FILE} maps its pseudonym to its file "
                                "(`lungcal qc` shows every series check)")
        rows = [all_rows[i] for i in keep]
        reports = [all_reports[i] for i in keep]
        if stage1.run_id:
            model_id = stage1.run_id
        else:
            path = self.checkpoint or self.stage1_run_id
            assert path is not None  # no run: the weights came from this file
            model_id = f"checkpoint:{file_digest(path)}"
        tags = {TAG_INFERENCE: self.mode, TAG_MODEL: model_id, TAG_STAGE1: stage1.stage1_name(TAG_STAGE1),
                TAG_SITE: self.site or "reference", TAG_DATASET: "inference"}
        if forced:
            tags[TAG_FORCED] = forced
        with RunTracker(self._experiment(stage1.run), f"{self.mode}-{time.strftime('%Y%m%d-%H%M%S')}",
                        tracking_uri=self.tracking_uri, tags=tags, parent_run_id=stage1.run_id) as tracker:
            try:
                tracker.log_params({"n_inputs": len(all_rows), "n_refused": len(refused),
                                    "n_skipped": len(found.skipped), "calibrator": cal_name,
                                    "site": self.site or "reference", "temperature": temp, "referral": rule.as_dict(),
                                    "decision": None if decision is None else decision.as_dict(),
                                    "pictures": self.pictures, "top_k": self.top_k, "qc": self.qc is not None,
                                    "bag_params": stage1.bag_params, "demo_model": notice is not None,
                                    "ood_checks": {k: k not in training.notes for k in ("acquisition", "embedding")}})
                scores = score_rows(stage1.network, rows, stage1.bag_params, cal,
                                    cache_dir=self.output_dir / "cache" / "bags", device=self.device,
                                    batch_size=self.batch_size, num_workers=self.num_workers,
                                    predict_fn=self.predict_fn)
                model = {"run_id": stage1.run_id, "site": self.site, "calibrator": cal_name,
                         "mlflow_run": tracker.run_id}
                feats = scores.get("features")
                feats = None if feats is None else np.asarray(feats).reshape(len(rows), -1)
                oods = [training.block(None if rep is None else rep.acquisition, None if feats is None else feats[i])
                        for i, rep in enumerate(reports)]
                batch = None if site_run is None else batch_check(
                    self.tracking_uri, site_run, str(self.site), np.asarray(scores["logits"]), feats,
                    [None if rep is None else rep.acquisition for rep in reports])
                cases = [case_record(scores, i, rule, calibrator=cal_name, top_k=self.top_k, model=model,
                                     qc=reports[i], decision=decision, ood=oods[i], notice=notice)
                         for i in range(len(rows))]
                paths = write_outputs(self.output, scores, cases, temp)
                status.update({str(r["subject"]): "scored" for r in rows})
                key = write_key(all_rows, self.output, status, found.skipped, self.inputs)  # local only: paths
                if self.pictures:
                    self._pictures(rows, cases)
                tracker.log_artifact(paths["predictions"])
                tracker.log_artifact(qc_path)
                gallery = gallery_selection(cases) if self.pictures else {}
                for group, members in gallery.items():
                    for name in members:
                        tracker.log_artifact(self.output / "cases" / f"{name}.png", f"gallery/{group}")
                referred = [c["referral"]["refer"] for c in cases]
                metrics = {"n_scored": len(cases), "n_refused": len(refused),
                           "mean_probability": float(np.mean(scores["probs"][:, 1]))}
                if rule.threshold is not None or any(referred):
                    metrics["n_referred"] = sum(bool(r) for r in referred)
                if rule.threshold is not None:
                    metrics["referral_threshold"] = rule.threshold
                metrics["n_outside_training"] = sum(bool(o["flagged"]) for o in oods)
                if batch is not None:
                    tracker.set_tags({"lungcal.site_check_new_cts": batch["verdict"] or "not_run"})
                if decision is not None:
                    metrics.update(n_work_up=sum(bool(c["decision"]["positive"]) for c in cases),
                                   n_not_covered=sum(not c["decision"]["covered"] for c in cases),
                                   decision_threshold=decision.threshold)
                tracker.log_metrics(metrics)
                tracker.set_tags({TAG_OUTCOME: "partial" if refused else "complete"})
            except BaseException:  # the run ends FAILED: say so, so it is never read as a result
                tracker.set_tags({TAG_OUTCOME: "failed"})
                raise
            run_id = tracker.run_id
        lines = [answer_line(c) for c in cases]
        n_all = len(all_rows)
        print("\n".join([f"== lungcal {'predict' if self.mode == 'predict' else 'inference'} ==", *lines,
                         *refused_lines,
                         f"  {len(rows)} of {n_all} CT(s) scored" + (f", {len(refused)} refused" if refused else "")
                         + (f", {len(found.skipped)} other file(s) skipped" if found.skipped else "")
                         + f"; calibrator {cal!r}; {rule.describe()}",
                         *([f"  decision at site {self.site}: {decision.statement()}"] if decision else []),
                         *self._ood_lines(oods),
                         *batch_lines(batch, self.site),
                         *([f"  {prior_warning}"] if prior_warning else []),
                         *([f"  NOTE: {notice}"] if notice else []),
                         f"  written to {self.output} (cases/<pseudonym>.json + .png, predictions.csv)",
                         f"  {KEY_FILE} there maps each pseudonym to its input file: kept local, never logged",
                         f"  MLflow run {run_id}"]), flush=True)
        result = {"output": str(self.output), "temperature": temp, "calibrator": cal_name,
                  "probabilities": scores["probs"][:, 1].tolist(), "cases": cases, "run_id": run_id,
                  "key": str(key), "referral": rule.as_dict(),
                  "decision": None if decision is None else decision.as_dict(), "site_check_new_cts": batch,
                  "refused": {names[i]: why for i, why in refused.items()}, "skipped": list(found.skipped)}
        if refused:
            first = next(iter(refused))
            raise PartlyRefused(f"{len(refused)} of {n_all} CT(s) refused (first: {names[first]}: {refused[first]}); "
                                f"the {len(rows)} other(s) are scored and written to {self.output}",
                                file=self.output / KEY_FILE, result=result,
                                fix=f"each refused CT is listed above; {KEY_FILE} maps its pseudonym to its file")
        return result

    @staticmethod
    def _ood_lines(oods: list[dict[str, Any]]) -> list[str]:
        """The summary of the out-of-distribution checks: how many were flagged (and referred), what was not checked."""
        n = sum(bool(o["flagged"]) for o in oods)
        lines = [f"  {n} of {len(oods)} CT(s) outside the model's training data (acquisition or embedding): referred"]
        skipped = {k: v for o in oods for k, v in o["not_checked"].items()}
        lines += [f"  not checked: {k}: {v}" for k, v in sorted(skipped.items())]
        return lines

    def _experiment(self, run) -> str:
        if run is None:
            return CT_EXPERIMENT
        exp = MlflowClient(self.tracking_uri).get_experiment(run.info.experiment_id)
        return exp.name if exp is not None else CT_EXPERIMENT

    def _pictures(self, rows: list[dict], cases: list[dict]) -> None:
        write_pictures(rows, cases, self.output / "cases")
