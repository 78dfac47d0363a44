"""The run step of ``bundles/inference.json``: calibrated probabilities for new CTs, with a candidates table.

The model is a stage-1 run or checkpoint (:func:`lungcal.engine.checkpoint.load_stage1`); with a
run, the calibrator of its linked post-hoc run is applied: the reference one fitted by the stage-1
bundle (TS by default) or, with ``site``, whatever ``lungcal recalibrate`` stored at that site (TS,
Platt, isotonic, ... or a prior adjustment; :mod:`lungcal.engine.site_calibrator`).
"""
from __future__ import annotations

import csv
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from lungcal.candidates.cache import BagParams, build_bags, masker_from_config
from lungcal.data.manifest import load_manifest
from lungcal.engine.bagset import BagSet
from lungcal.engine.checkpoint import load_stage1
from lungcal.engine.cohort import load_split, resolve_output_dir
from lungcal.engine.predict import predict
from lungcal.engine.series_qc import log_warnings, refuse_failed, screen
from lungcal.engine.site_calibrator import (
    calibrated_probs,
    reference_calibrator,
    site_calibrator,
    temperature_calibrator,
)
from lungcal.errors import ConfigError, DataError
from lungcal.paths import atomic_write
from lungcal.runtime import resolve_device
from lungcal.tracking import default_tracking_uri

__all__ = ["CT_SUFFIXES", "InferenceRun"]

logger = logging.getLogger(__name__)

CT_SUFFIXES = (".nii", ".nii.gz", ".mha", ".mhd", ".nrrd")


class InferenceRun:
    """Calibrated probabilities for new CTs, with a candidates table per CT.

    Args:
        inputs: a datalist JSON, or a folder of CTs (each NIfTI/MHD/NRRD file or DICOM series
            folder directly inside it is one CT).
        stage1_run_id / checkpoint: the model (default: latest finished stage-1 run).
        temperature: overrides the temperature (1.0 = uncalibrated) when set.
        site: apply the calibrator ``lungcal recalibrate`` stored for this site (any kind).
        output: folder for ``predictions.csv`` and ``candidates/<subject>.csv``
            (default ``<output_dir>/inference/<timestamp>``).
        output_dir, tracking_uri, device, num_workers, batch_size: as for the stage-1 bundles.
        qc: series-check thresholds (the bundle's ``qc`` section); a CT that fails a check is
            refused (``DataError`` naming its pseudonym, the check and the measured value) before
            anything is written; warnings are logged. ``None`` checks nothing.
    """

    def __init__(self, inputs: str | None = None, stage1_run_id: str | None = None, checkpoint: str | None = None,
                 temperature: float | None = None, output: str | None = None,
                 output_dir: str | os.PathLike | None = None, tracking_uri: str | None = None,
                 device: str | None = "auto", num_workers: int = 2, batch_size: int = 16,
                 site: str | None = None, qc: Any = None) -> None:
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

    def rows(self) -> list[dict]:
        """Datalist rows of the inputs; a folder's CTs get pseudonyms by position (file names may carry identifiers)."""
        if self.inputs.is_file():
            return load_manifest(self.inputs)
        if not self.inputs.is_dir():
            raise DataError("inputs not found", file=self.inputs, field="inputs",
                            fix="pass a datalist JSON or a folder of CTs")
        items = sorted(p for p in self.inputs.iterdir() if not p.name.startswith("."))
        cts = [p for p in items if p.is_dir() or p.name.lower().endswith(CT_SUFFIXES)]
        if not cts:
            raise DataError("no CT found in the folder", file=self.inputs, field="inputs",
                            fix="put one NIfTI/MHD/NRRD file or DICOM series folder per CT in it")
        return [{"image": str(p), "label": -1, "subject": f"ct{i:04d}", "site": "inference", "split": "test"}
                for i, p in enumerate(cts)]

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

    def run(self) -> dict[str, Any]:
        """Write ``predictions.csv`` (subject, probability, temperature) and per-CT candidate tables."""
        rows = self.rows()
        stage1 = load_stage1(self.stage1_run_id, self.tracking_uri, checkpoint=self.checkpoint, device=self.device)
        cal = self.resolve_calibrator(stage1.run)
        temp = 1.0 if cal is None else float(getattr(cal, "temperature", float("nan")))
        cal_name = "none" if cal is None else str(cal.name)
        for r in rows:
            r.setdefault("label", -1)
        if self.qc is not None:  # scoring refuses a series that fails a check; warnings are logged
            stored = BagParams.from_any(stage1.bag_params).preprocess.get("masker")  # None: the default
            masker = masker_from_config(stored) if stored else None
            reports = screen(rows, self.qc, self.output_dir / "cache" / "qc", masker=masker,
                             num_workers=self.num_workers)
            log_warnings(rows, reports)
            refuse_failed(rows, reports)
        built = build_bags(rows, stage1.bag_params, self.output_dir / "cache" / "bags", num_workers=self.num_workers)
        split = load_split(built)
        labels = torch.zeros(len(built), dtype=torch.long)
        loader = torch.utils.data.DataLoader(BagSet(split["bags"], split["mask"], labels), batch_size=self.batch_size,
                                             shuffle=False)
        out = predict(stage1.network, loader, self.device)
        p = calibrated_probs(cal, out["logits"])[:, 1]
        self._write(split, out["attention"], p, temp, cal_name)
        print(f"== lungcal inference ==\n  {len(rows)} CT(s), calibrator {cal!r}\n  written to {self.output}",
              flush=True)
        return {"output": str(self.output), "temperature": temp, "calibrator": cal_name, "probabilities": p.tolist()}

    def _write(self, split, attention: torch.Tensor, p, temp: float, cal_name: str = "ts") -> None:
        with atomic_write(self.output / "predictions.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["subject", "probability", "temperature", "top_candidate", "top_attention", "calibrator"])
            for i, subj in enumerate(split["subjects"]):
                att = attention[i].numpy()
                j = int(att.argmax())
                w.writerow([subj, f"{p[i]:.6f}", "" if temp != temp else f"{temp:.4f}", j, f"{att[j]:.6f}", cal_name])
        for i, subj in enumerate(split["subjects"]):
            c, att = split["candidates"][i], attention[i].numpy()
            with atomic_write(self.output / "candidates" / f"{subj}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["slot", "x_mm", "y_mm", "z_mm", "radius_mm", "score", "attention"])
                for j in range(len(c["score"])):
                    w.writerow([j, *(f"{v:.2f}" for v in c["world"][j]), f"{c['radius_mm'][j]:.2f}",
                                f"{c['score'][j]:.4f}", f"{att[j]:.6f}"])
