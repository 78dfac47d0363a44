"""Local recalibration for a hospital site: temperature scaling on the site's own validation split.

A model trained elsewhere is re-checked on the site's data and recalibrated *without retraining*:
the stage-1 network is frozen, one temperature is fitted by NLL on the site's ``val`` logits only
(:class:`lungcal.calibration.scaling.TemperatureScaler`), and the site's ``test`` split is evaluated
before and after with bootstrap CIs (same resamples for both, so the two are comparable). The
test split is never used for fitting.

When the model came from a stage-1 run whose bundle also fitted a *reference* temperature (on
the reference site's validation split, its linked TS run), the site's test split is scored with
that temperature too: this is the model as shipped, and the row that shows whether the reference
calibration transfers to the site.

The result is logged as an MLflow run with ``lungcal.stage2 = ts``, the ``lungcal.site`` tag and a
``lungcal.parent_run`` link to the stage-1 run (when the model came from a run). Final metrics:
``test/{metric}`` after local TS, ``test_uncalibrated/{metric}`` before (T = 1) and, when there is
a reference temperature, ``test_reference_ts/{metric}``; plus ``temperature`` and
``reference_temperature``.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lungcal.calibration.metrics import ece_consistency_pvalue
from lungcal.calibration.scaling import TemperatureScaler
from lungcal.candidates.cache import build_bags
from lungcal.data.manifest import load_manifest, manifest_source, rows_for_split
from lungcal.engine.bagset import BagSet
from lungcal.engine.checkpoint import load_stage1
from lungcal.engine.cohort import load_split
from lungcal.engine.evaluate import evaluate_probs, log_split, probabilities
from lungcal.engine.predict import predict
from lungcal.engine.summary import with_ci
from lungcal.errors import DataError
from lungcal.paths import atomic_write_text, default_output_dir
from lungcal.tracking import (
    CT_EXPERIMENT,
    TAG_DATASET,
    TAG_RECALIBRATION,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
    file_digest,
    linked_temperature,
)

__all__ = ["recalibrate", "format_summary"]


def _site_rows(datalist: Path) -> tuple[list[dict], list[dict], str]:
    rows = load_manifest(datalist)
    val, test = rows_for_split(rows, "val"), rows_for_split(rows, "test")
    for name, part in (("val", val), ("test", test)):
        labels = {int(r["label"]) for r in part}
        if not part:
            raise DataError(f"the datalist has no '{name}' rows", file=datalist, field="split",
                            fix="import the site with validation and test splits (lungcal import-site), "
                                "then check with lungcal check-data")
        if labels != {0, 1}:
            raise DataError(f"the '{name}' split holds only label(s) {sorted(labels)}", file=datalist, field="label",
                            fix=f"the {name} split needs cancer and non-cancer CTs; "
                                "re-split the site with more subjects")
    sites = sorted({str(r.get("site")) for r in rows if r.get("site")})
    return val, test, ",".join(sites) or "unknown"


def _predict(net, rows, bag_params, cache_dir: Path, num_workers: int, batch_size: int = 16) -> dict[str, Any]:
    built = build_bags(rows, bag_params, cache_dir, num_workers=num_workers)
    split = load_split(built)
    loader = torch.utils.data.DataLoader(BagSet(split["bags"], split["mask"], split["labels"]),
                                         batch_size=batch_size, shuffle=False)
    with torch.no_grad():
        out = predict(net, loader)
    out.update(subjects=split["subjects"], candidates=split["candidates"], labels=split["labels"])
    return out


def recalibrate(model: str, datalist: str | Path, *, site: str | None = None, experiment: str = CT_EXPERIMENT,
                n_bins: int = 10, n_bootstrap: int = 1000, seed: int = 0, tracking_uri: str | None = None,
                output_dir: str | Path | None = None, num_workers: int = 0, log: bool = True) -> dict[str, Any]:
    """Fit temperature scaling on a site's validation split and evaluate its test split.

    Args:
        model: a stage-1 MLflow run id (in ``tracking_uri``) or a stage-1 checkpoint file.
        datalist: the site's datalist JSON (rows with ``val`` and ``test`` splits; train is unused).
        site: value of the ``lungcal.site`` tag (default: the datalist rows' ``site``).
        experiment: MLflow experiment for the run.
        n_bins: ECE bins (10 for CT).
        n_bootstrap: bootstrap resamples of the CIs (same seed before and after).
        seed: bootstrap seed.
        tracking_uri: MLflow URI (default: the project's SQLite store).
        output_dir: where the bag cache goes (default: the project's output folder).
        num_workers: bag-building processes (0 = in-process).
        log: record an MLflow run.

    Returns:
        ``{"before": report, "reference": report or None, "after": report, "temperature",
        "reference_temperature", "run_id", "parent_run", "site", "n_val", "n_test"}`` where the
        reports come from ``calibration_report`` (fractions); ``reference`` scores the test split
        with the stage-1 run's own (reference-site) temperature, when it has one.
    """
    datalist = Path(datalist).expanduser()
    if not datalist.is_file():
        raise DataError("datalist not found", file=datalist, field="--datalist",
                        fix="create it with `lungcal import-site`, then run `lungcal check-data`")
    out_dir = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    uri = tracking_uri or default_tracking_uri(out_dir)
    stage1 = load_stage1(str(model), uri, field="--model")
    net, run, bag_params = stage1.network, stage1.run, stage1.bag_params
    val_rows, test_rows, site_from_rows = _site_rows(datalist)
    site = site or site_from_rows
    cache = out_dir / "cache" / "bags"
    val = _predict(net, val_rows, bag_params, cache, num_workers)
    test = _predict(net, test_rows, bag_params, cache, num_workers)

    scaler = TemperatureScaler().fit(val["logits"], val["labels"])  # validation only
    temp = float(scaler.temperature)
    p_before = probabilities(test["logits"])
    p_after = probabilities(test["logits"], temp)
    before = evaluate_probs(p_before, test["labels"], n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
    after = evaluate_probs(p_after, test["labels"], n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
    ref_temp = linked_temperature(uri, run) if run is not None else None
    p_ref = probabilities(test["logits"], ref_temp) if ref_temp is not None else None
    reference = (evaluate_probs(p_ref, test["labels"], n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
                 if p_ref is not None else None)
    # is the model miscalibrated on this site? ECE is biased upwards on small splits, so each row
    # also gets its consistency-resampling p-value (small = an ECE this large is unlikely for a
    # calibrated model with these confidences)
    for rep, probs in ((before, p_before), (reference, p_ref), (after, p_after)):
        if rep is not None:
            rep["ece_pvalue"] = ece_consistency_pvalue(probs, test["labels"], n_bins=n_bins, seed=seed)[1]
    val_before = evaluate_probs(probabilities(val["logits"]), val["labels"], n_bins=n_bins, n_bootstrap=0)
    val_after = evaluate_probs(probabilities(val["logits"], temp), val["labels"], n_bins=n_bins, n_bootstrap=0)

    parent = stage1.run_id
    stage1_name = stage1.stage1_name(TAG_STAGE1)
    result = {"before": before, "reference": reference, "after": after, "temperature": temp,
              "reference_temperature": ref_temp, "run_id": None, "parent_run": parent,
              "stage1": stage1_name, "site": site, "n_val": len(val_rows), "n_test": len(test_rows),
              "tracking_uri": uri}
    if not log:
        return result
    source = manifest_source(datalist)
    tags = {TAG_DATASET: source, TAG_STAGE1: stage1_name, TAG_STAGE2: "ts", TAG_SITE: site, TAG_RECALIBRATION: "local"}
    name = f"{stage1_name}+ts@{site}-{time.strftime('%Y%m%d-%H%M%S')}"
    with RunTracker(experiment, name, tracking_uri=uri, tags=tags, parent_run_id=parent) as tr:
        params = {"stage2": "ts", "fit_split": "val", "model": parent or "checkpoint", "site": site,
                  "datalist": {"source": source, "sha256": file_digest(datalist)},
                  "n_val": len(val_rows), "n_test": len(test_rows), "n_bins": n_bins, "n_bootstrap": n_bootstrap,
                  "bag_params": bag_params, "retrained": False}
        tr.log_params(params)
        tr.log_dict(params, "config/resolved.json")
        if ref_temp is not None:
            tr.log_metrics({"reference_temperature": ref_temp})
        tr.log_metrics({"temperature": temp, "val/nll_before": val_before["nll"], "val/nll": val_after["nll"],
                        "val/ece_before": val_before["ece"], "val/ece": val_after["ece"]})
        work = out_dir / "recalibration" / tr.run_id
        log_split(tr, "test_uncalibrated", p_before, test["labels"], before, n_bins=n_bins,
                  subjects=test["subjects"], attention=test["attention"], workdir=work, title=f"{stage1_name} @ {site}")
        if reference is not None:
            log_split(tr, "test_reference_ts", p_ref, test["labels"], reference, n_bins=n_bins, workdir=work,
                      title=f"{stage1_name}+reference TS @ {site}")
        log_split(tr, "test", p_after, test["labels"], after, n_bins=n_bins, subjects=test["subjects"],
                  attention=test["attention"], workdir=work, title=f"{stage1_name}+TS @ {site}")
        state = {"temperature": temp, "stage1_run": parent, "fit_split": "val", "site": site}
        cal = atomic_write_text(work / "temperature.json", json.dumps(state))
        tr.log_artifact(cal, "calibrator")
        result["run_id"] = tr.run_id
    return result


def format_summary(res: Mapping[str, Any]) -> str:
    """A short text table: test ECE, AUC and ACC before and after TS, with 95% CIs and the ECE's
    consistency p-value."""
    b, a, r = res["before"], res["after"], res.get("reference")
    lines = [f"== lungcal recalibrate: site {res['site']} (val n={res['n_val']}, test n={res['n_test']}) ==",
             f"  temperature   {res['temperature']:.3f} (fitted on the site's val split; no retraining)"]
    if r is not None:
        lines.append(f"  reference T   {res['reference_temperature']:.3f} "
                     "(fitted by the stage-1 run on its own val split)")

    def row(name, rep):
        pv = rep.get("ece_pvalue")
        return (f"  {name:<13} {with_ci(rep, 'ece'):<24} {with_ci(rep, 'auc'):<24} {rep['acc']:<9.3f}"
                + (f"{pv:.3f}" if pv is not None else "")).rstrip()

    lines += [f"  {'':<13} {'test ECE':<24} {'test AUC':<24} {'test ACC':<9}p(calibrated)", row("uncalibrated", b)]
    if r is not None:
        lines.append(row("reference TS", r))
    lines.append(row("local TS", a))
    lines.append("  p(calibrated): consistency-resampling p-value of the ECE; small = miscalibrated on this site")
    if res.get("run_id"):
        lines.append(f"  MLflow run    {res['run_id']} (parent {res.get('parent_run') or 'checkpoint'})")
        lines.append(f"  open with     mlflow ui --backend-store-uri {res['tracking_uri']}")
    return "\n".join(lines)
