"""Linked-run look-ups: find a stage-1 run, its checkpoint artifact, its training data's acquisition summary,
and the post-hoc runs linked to it.

Stage-2 runs carry ``lungcal.parent_run`` = the stage-1 run id (:mod:`lungcal.tracking.names`);
these helpers follow that link through :class:`mlflow.tracking.MlflowClient`.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from lungcal.errors import ConfigError
from lungcal.tracking.names import (
    ACQUISITION_ARTIFACT,
    CT_EXPERIMENT,
    GUARANTEE_ARTIFACT,
    REFERENCE_CALIBRATOR,
    SELECTION_ARTIFACT,
    SITE_REFERENCE_ARTIFACT,
    TAG_CALIBRATOR,
    TAG_PARENT,
    TAG_RECALIBRATION,
    TAG_SITE,
    TAG_STAGE2,
    THRESHOLD_METRIC,
    calibrator_artifact,
)

__all__ = ["find_stage1_run", "artifact_checkpoint", "linked_runs", "linked_temperature", "linked_calibrator_run",
           "linked_calibrator", "linked_guarantee", "add_run_metrics", "run_acquisition_summary",
           "run_site_reference", "run_selection"]


def find_stage1_run(tracking_uri: str, run_id: str | None = None, experiment: str = CT_EXPERIMENT):
    """The stage-1 run ``run_id``, or the latest FINISHED stage-1 run of ``experiment``.

    Raises:
        ConfigError: when there is no such run.
    """
    client = MlflowClient(tracking_uri)
    if run_id:
        try:
            return client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"no MLflow run {run_id!r} in {tracking_uri}", field="stage1_run_id",
                              fix="copy a stage-1 run id from `mlflow ui` or leave it null for the latest") from exc
    exp = client.get_experiment_by_name(experiment)
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], filter_string=f"attributes.status = 'FINISHED' and tags.`{TAG_STAGE2}` = 'none'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise ConfigError(f"no finished stage-1 run in experiment {experiment!r} of {tracking_uri}",
                          field="stage1_run_id",
                          fix="run a stage-1 bundle first (python -m monai.bundle run --config_file "
                              "bundles/nlst_focal.json), or pass --stage1_run_id / --checkpoint")
    return runs[0]


def artifact_checkpoint(tracking_uri: str, run, artifact: str = "checkpoint/best.pt") -> Path:
    """Download (or locate, for a local store) a run's checkpoint artifact."""
    try:
        return Path(MlflowClient(tracking_uri).download_artifacts(run.info.run_id, artifact))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"run {run.info.run_id} has no {artifact} artifact", field="stage1_run_id",
                          fix="pick a FINISHED run of a stage-1 bundle (bundles/nlst_*.json)") from exc


def _has_artifact(client: MlflowClient, run_id: str, path: str) -> bool:
    """Whether the run holds the artifact ``folder/name`` (listed, not downloaded)."""
    folder, name = path.rsplit("/", 1)
    return name in {Path(f.path).name for f in client.list_artifacts(run_id, folder)}


def run_acquisition_summary(tracking_uri: str, run_id: str) -> dict[str, Any] | None:
    """The acquisition summary of a stage-1 run's training split (its ``data/acquisition.json``), or ``None``
    for a run that logged none (runs made before issue 32, CIFAR runs).

    The layout is :func:`lungcal.ct.acquisition.summarize_acquisitions`' (``version``, ``n``, ``fields`` with
    per-field ``n``, ``mean``, ``sd``, ``min``, ``max`` and ``quantiles``, ``profiles``, ``kernels``) plus
    ``split`` and ``measured``; :func:`lungcal.ct.acquisition.summary_quantiles` reads one field's CDF.

    Raises:
        ConfigError: no run ``run_id`` in the store.
    """
    client = MlflowClient(tracking_uri)
    try:
        client.get_run(run_id)
    except Exception as exc:  # noqa: BLE001 - MLflow raises its own exception types
        raise ConfigError(f"no MLflow run {run_id!r} in {tracking_uri}", field="run",
                          fix="copy a stage-1 run id from `mlflow ui` (with --tracking-uri for another store)") from exc
    if not _has_artifact(client, run_id, ACQUISITION_ARTIFACT):
        return None
    return json.loads(Path(client.download_artifacts(run_id, ACQUISITION_ARTIFACT)).read_text())


def run_site_reference(tracking_uri: str, run_id: str) -> dict[str, Any] | None:
    """What a stage-1 run's network made of its validation split (its ``data/site_reference.npz``: ``scores``,
    ``labels``, ``features``), or ``None`` for a run that logged none (runs made before site checks)."""
    client = MlflowClient(tracking_uri)
    if not _has_artifact(client, run_id, SITE_REFERENCE_ARTIFACT):
        return None
    with np.load(client.download_artifacts(run_id, SITE_REFERENCE_ARTIFACT)) as z:
        return {k: z[k] for k in z.files}


def run_selection(tracking_uri: str, run_id: str) -> dict[str, Any] | None:
    """Which CTs made a stage-1 run's checkpoint (its ``data/selection.json``: ``selected_by``, the pseudonyms of
    ``train`` and ``val``), or ``None`` for a run that logged none (runs made before 2026-12-06, CIFAR runs)."""
    client = MlflowClient(tracking_uri)
    if not _has_artifact(client, run_id, SELECTION_ARTIFACT):
        return None
    return json.loads(Path(client.download_artifacts(run_id, SELECTION_ARTIFACT)).read_text())


def linked_runs(tracking_uri: str, run, stage2: str | None = None, finished: bool = True) -> list:
    """Runs linked to ``run`` by ``lungcal.parent_run`` (newest first), optionally of one stage 2."""
    clauses = [f"tags.`{TAG_PARENT}` = '{run.info.run_id}'"]
    if stage2:
        clauses.append(f"tags.`{TAG_STAGE2}` = '{stage2}'")
    if finished:
        clauses.append("attributes.status = 'FINISHED'")
    return MlflowClient(tracking_uri).search_runs([run.info.experiment_id], filter_string=" and ".join(clauses),
                                                  order_by=["attributes.start_time DESC"])


def linked_temperature(tracking_uri: str, run, site: str | None = None) -> float | None:
    """The temperature of a stage-1 run's latest finished, linked TS run, or ``None``.

    Args:
        tracking_uri: the MLflow store that holds ``run``.
        run: the stage-1 :class:`mlflow.entities.Run`.
        site: ``None`` for the *reference* temperature, the one the stage-1 bundle fitted on its
            own validation split; a site name for the one ``lungcal recalibrate`` fitted on that
            site's validation split (its run carries ``lungcal.site = site`` and
            ``lungcal.recalibration = local``).
    """
    for r in linked_runs(tracking_uri, run, stage2="ts"):
        local = r.data.tags.get(TAG_RECALIBRATION) == "local"
        match = (not local) if site is None else (local and r.data.tags.get(TAG_SITE) == site)
        if match and "temperature" in r.data.metrics:
            return float(r.data.metrics["temperature"])
    return None


def _site_match(r, site: str | None) -> bool:
    local = r.data.tags.get(TAG_RECALIBRATION) == "local"
    return (not local) if site is None else (local and r.data.tags.get(TAG_SITE) == site)


def linked_calibrator_run(tracking_uri: str, run, site: str | None = None, prefer: str = REFERENCE_CALIBRATOR):
    """The newest finished run linked to ``run`` that stored a calibrator (tag ``lungcal.calibrator``), or ``None``.

    ``site=None``: a *reference* calibrator, fitted by the stage-1 bundle's post-hoc step on its
    own validation split; of several, the newest ``prefer`` one (``ts`` by default), else the
    newest. ``site="name"``: the one ``lungcal recalibrate`` fitted at that site (``lungcal.site``
    = name and ``lungcal.recalibration = local``), whatever its kind.
    """
    runs = [r for r in linked_runs(tracking_uri, run) if r.data.tags.get(TAG_CALIBRATOR) and _site_match(r, site)]
    if site is None:
        runs = sorted(runs, key=lambda r: r.data.tags[TAG_CALIBRATOR] != prefer)  # stable: newest first kept
    return runs[0] if runs else None


def linked_calibrator(tracking_uri: str, run, site: str | None = None,
                      load: Callable[[str], Any] | None = None) -> tuple[str, Any] | None:
    """``(name, calibrator)`` stored by :func:`linked_calibrator_run`'s run, or ``None``.

    The run's artifact ``calibrator/<name>.json`` is downloaded and turned into the calibrator by
    ``load(text)``. ``lungcal.tracking`` may not import ``lungcal.calibration`` (independent
    layers), so the CT application passes its loader (:func:`lungcal.ctapp.evaluate.calibrators.load_calibrator`);
    without one the parsed JSON state is returned.
    """
    found = linked_calibrator_run(tracking_uri, run, site=site)
    if found is None:
        return None
    name = found.data.tags[TAG_CALIBRATOR]
    try:
        path = MlflowClient(tracking_uri).download_artifacts(found.info.run_id, calibrator_artifact(name))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"run {found.info.run_id} is tagged {TAG_CALIBRATOR}={name} but has no "
                          f"{calibrator_artifact(name)} artifact", field="site" if site else "stage1_run_id",
                          fix="refit it (rerun `lungcal recalibrate` or the stage-1 bundle)") from exc
    text = Path(path).read_text()
    return name, (load(text) if load is not None else json.loads(text))


def linked_guarantee(tracking_uri: str, run, site: str) -> dict[str, Any] | None:
    """The decision guarantee ``lungcal recalibrate --miss-rate`` stored at ``site`` (:data:`GUARANTEE_ARTIFACT`,
    parsed), or ``None``.

    It is read from the run :func:`linked_calibrator_run` finds for the site, the one whose calibrator
    ``--site`` applies, so the threshold always belongs to the probabilities it is applied to; when that
    run was recalibrated without ``--miss-rate`` (no :data:`THRESHOLD_METRIC`) there is none.
    """
    found = linked_calibrator_run(tracking_uri, run, site=site)
    if found is None or THRESHOLD_METRIC not in found.data.metrics:
        return None
    try:
        path = MlflowClient(tracking_uri).download_artifacts(found.info.run_id, GUARANTEE_ARTIFACT)
        return json.loads(Path(path).read_text())
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"run {found.info.run_id} logged {THRESHOLD_METRIC} but has no readable "
                          f"{GUARANTEE_ARTIFACT} artifact", field="site",
                          fix="rerun `lungcal recalibrate ... --miss-rate ALPHA` for this site") from exc


def add_run_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float]) -> None:
    """Log metrics on an existing (possibly finished) run, e.g. a stage-1 run's ``val/prevalence``
    logged by its post-hoc step."""
    ts = int(time.time() * 1000)
    MlflowClient(tracking_uri).log_batch(run_id, metrics=[Metric(k, float(v), ts, 0) for k, v in metrics.items()])
