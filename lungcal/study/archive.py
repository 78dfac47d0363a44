"""Results that survive the run store: a run's test predictions, archived beside the table they make.

A verdict of ``docs/results.md`` rests on runs whose MLflow store lives on one machine; when the machine goes,
the numbers can no longer be checked. :func:`archive_run` writes what recomputes them into one compressed file
(``np.savez_compressed``, about 0.3-0.5 MB for a CIFAR run's 10,000 x 10 probabilities, a few kB for a CT run):

- ``labels`` of the split, in the run's order, and either ``logits`` (float32: a CIFAR run, whose report was
  computed in float64 from its logits, by a softmax or, for a post-hoc run, by its calibrator, whose JSON state
  the archive keeps: the probabilities are then recomputed as the run computed them, where float32
  probabilities tie, near 0 and 1 above all, and move the AUC) or ``probs`` (float32, ``(N, C)`` or ``(N,)``
  p(cancer): a CT run); no subject identifiers (a CT run's subjects are replaced by the SHA-256 of their
  ordered list, ``cases_sha256``, which is enough to tell whether two archives score the same cases);
- ``meta`` (JSON): the run id, experiment, name, its ``lungcal.*`` tags and the commit it ran
  (``mlflow.source.git.commit``, when it recorded one), every param (the resolved config, with the data's
  hashes: a CT run's ``datalist`` SHA-256, a CIFAR run's pixel SHA-256), and the split's metrics as logged.

:func:`recompute` runs :func:`lungcal.calibration.metrics.calibration_report` on the archived predictions with the
run's own ``n_bins``, ``n_bootstrap`` and ``seed``; :func:`check_archive` compares that with the metrics the run
logged. ``lungcal archive RUN ... --out DIR`` writes archives, ``lungcal archive --check DIR`` checks every archive
in a folder (exit 1 on a mismatch), and ``tests/study/test_archive.py`` runs the check on the committed ones.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.calibration.calibrators.base import calibrated_probs
from lungcal.calibration.calibrators.registry import calibrator_from_json
from lungcal.calibration.metrics import calibration_report
from lungcal.errors import DataError
from lungcal.study.differences import load_predictions, study_bins
from lungcal.tracking.names import (
    MLFLOW_GIT_COMMIT,
    TAG_DATASET,
    TAG_STAGE1,
    TAG_STAGE2,
    calibrator_artifact,
    predictions_artifacts,
)

__all__ = ["Archive", "archive_run", "load_archive", "recompute", "check_archive", "archive_name"]

#: a recomputed metric matches the logged one within this (far below the 1e-4 the tables print: ECE and accuracy
#: to 0.01 %)
TOLERANCE = 1e-6
#: the logged metrics :func:`check_archive` compares (their CIs too)
CHECKED = ("acc", "auc", "ece", "mce", "brier", "nll", "mean_confidence")


@dataclass(frozen=True)
class Archive:
    probs: np.ndarray
    labels: np.ndarray
    meta: dict[str, Any]


def archive_name(meta: Mapping[str, Any]) -> str:
    """``<experiment>_<stage1>_<stage2>_seed<seed>_<run id[:8]>.npz``."""
    tags, params = meta.get("tags", {}), meta.get("params", {})
    parts = [meta.get("experiment") or tags.get(TAG_DATASET, "run"), tags.get(TAG_STAGE1, "stage1"),
             tags.get(TAG_STAGE2, "none"), f"seed{params.get('seed', 'x')}", str(meta["run_id"])[:8]]
    return "_".join(str(p).replace("/", "-").replace("+", "-") for p in parts) + ".npz"


def _probs_of(logits: np.ndarray, calibrator: str | None) -> np.ndarray:
    """float64 probabilities of stored logits, by the run's calibrator (its JSON) or a softmax."""
    return calibrated_probs(None if calibrator is None else calibrator_from_json(calibrator), logits)


def _logits_behind(client: MlflowClient, run_id: str, split: str, probs: np.ndarray, stage2: str | None
                   ) -> tuple[np.ndarray, str | None] | None:
    """The run's stored float32 logits and its calibrator's JSON (None: a softmax) when they give its stored
    probabilities, else None."""
    calibrator = None
    if stage2 and stage2 != "none":
        try:
            calibrator = Path(client.download_artifacts(run_id, calibrator_artifact(stage2))).read_text()
        except Exception:  # noqa: BLE001 - a run without a calibrator (LAS retrains the head)
            calibrator = None
    for name in predictions_artifacts(split, "npz"):
        try:
            with np.load(client.download_artifacts(run_id, name), allow_pickle=False) as z:
                logits = np.asarray(z["logits"], np.float32) if "logits" in z.files else None
        except Exception:  # noqa: BLE001 - the run did not log this name
            continue
        if logits is None or logits.shape != np.shape(probs):
            return None
        for cal in dict.fromkeys((calibrator, None)):
            if np.allclose(_probs_of(logits, cal).astype(np.float32), probs, rtol=0, atol=1e-6):
                return logits, cal
        return None
    return None


def archive_run(client: MlflowClient, run_id: str, out_dir: str | Path, split: str = "test") -> Path:
    """Archive ``run_id``'s ``split`` predictions, params, tags and logged metrics under ``out_dir``."""
    run = client.get_run(run_id)
    found = load_predictions(client, run_id, split)
    if found is None:
        raise DataError(f"run {run_id} logged no {split} predictions", field="run",
                        fix="archive a finished stage-1, post-hoc or LAS run, which logs predictions/<split>_*")
    cases, probs, labels = found
    experiment = client.get_experiment(run.info.experiment_id).name
    prefix = f"{split}/"
    meta = {
        "run_id": run_id, "experiment": experiment, "run_name": run.info.run_name, "split": split,
        "tags": {k: v for k, v in run.data.tags.items() if k.startswith("lungcal.") and ".owner." not in k
                 or k == MLFLOW_GIT_COMMIT},
        "params": dict(run.data.params),
        "metrics": {k[len(prefix):]: v for k, v in run.data.metrics.items() if k.startswith(prefix)},
        "cases_sha256": hashlib.sha256("\n".join(cases).encode()).hexdigest(),
    }
    behind = _logits_behind(client, run_id, split, probs, run.data.tags.get(TAG_STAGE2)) if np.ndim(probs) == 2 \
        else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / archive_name(meta)
    y = np.asarray(labels, np.int16)
    if behind is not None:
        meta["calibrator"] = behind[1]
        np.savez_compressed(path, logits=behind[0], labels=y, meta=np.array(json.dumps(meta, sort_keys=True)))
    else:
        np.savez_compressed(path, probs=np.asarray(probs, np.float32), labels=y,
                            meta=np.array(json.dumps(meta, sort_keys=True)))
    return path


def load_archive(path: str | Path) -> Archive:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            probs = _probs_of(z["logits"], meta.get("calibrator")) if "logits" in z.files \
                else np.asarray(z["probs"], np.float64)
            return Archive(probs, np.asarray(z["labels"], np.int64), meta)
    except (OSError, KeyError, ValueError) as exc:
        raise DataError(f"not a run archive ({exc})", file=path, fix="write one with lungcal archive RUN --out DIR") \
            from exc


def _param(params: Mapping[str, str], name: str, default: Any) -> Any:
    """A param by its name or as the last part of a dotted one (``evaluation.n_bins``)."""
    for key in (name, *sorted(k for k in params if k.endswith("." + name))):
        if key in params and params[key] not in ("", "None", "null"):
            return type(default)(float(params[key])) if isinstance(default, (int, float)) else params[key]
    return default


def recompute(archive: Archive) -> dict[str, Any]:
    """The split's report from the archived predictions, with the run's ``n_bins``, ``n_bootstrap`` and ``seed``
    (their defaults: the study's bins for its dataset, 1000 and 0)."""
    params, tags = archive.meta.get("params", {}), archive.meta.get("tags", {})
    n_bins = _param(params, "n_bins", study_bins(tags.get(TAG_DATASET, archive.meta.get("experiment", ""))))
    return calibration_report(archive.probs, archive.labels, n_bins=n_bins,
                              n_bootstrap=_param(params, "n_bootstrap", 1000), seed=_param(params, "seed", 0))


def check_archive(path: str | Path, keys: Iterable[str] = CHECKED, tolerance: float = TOLERANCE) -> list[str]:
    """The mismatches (``"ece: logged 0.1234, recomputed 0.1240"``) between what the run logged and what its
    archive recomputes; empty when every logged metric of ``keys`` (and its CI) is reproduced. A metric the run
    did not log is skipped; an archive whose run logged none of them is a mismatch."""
    archive = load_archive(path)
    logged, again = archive.meta.get("metrics", {}), recompute(archive)
    out, compared = [], 0
    for key in keys:
        for k in (key, f"{key}_ci_low", f"{key}_ci_high"):
            if k not in logged or k not in again:
                continue
            a, b = float(logged[k]), float(again[k])
            compared += 1
            if not (math.isclose(a, b, rel_tol=0, abs_tol=tolerance) or (math.isnan(a) and math.isnan(b))):
                out.append(f"{k}: logged {a:.6g}, recomputed {b:.6g}")
    if compared == 0:
        out.append(f"no logged {archive.meta.get('split', 'test')} metric to compare")
    return out
