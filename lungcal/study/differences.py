"""Paired differences that carry the study's claims, from the runs' logged test predictions.

Overlapping CIs of two configurations say little: both are scored on the *same* test cases, so
the honest comparison is the paired bootstrap of the difference
(:func:`lungcal.calibration.metrics.paired_bootstrap_diff`). The differences, per dataset:

- ΔECE(TS − none) for each stage-1 method (the paper: TS lowers ECE on every dataset);
- ΔECE(LAS − none) for each stage-1 method with a LAS run (the paper: LAS raises ECE on CT; on
  CIFAR-10-LT it reports LAS on CE+Mixup only, where accuracy rises and ECE rises too, 1.72 -> 5.18);
- ΔAUC(Focal − CE) (the paper, on CT: focal discriminates slightly better; no number);
- mean confidence − accuracy of Focal+Mixup (the paper: under-confident, on balanced CIFAR-10 only).

Not every difference is a claim of the paper on every dataset: :func:`paper_says` gives what the paper
states for each (dataset, difference), and the report prints it beside ours, so that a finding of ours
(Focal+Mixup under-confident on CT, say) is never read as the paper's.

Runs are paired by seed (the ``seed`` param); each claim is reported per seed with its 95% CI and
as a mean over seeds. Predictions come from the artifacts every run logs:
``predictions/{split}_predictions.npz`` (CIFAR: ``probs``, ``labels``) or
``predictions/{split}_predictions.csv`` (CT: ``subject, label, probability``, aligned by subject).

:func:`compare_predictions` is the same paired bootstrap for any two runs or predictions files
(``lungcal compare A B``).
"""
from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.calibration.metrics import accuracy, paired_bootstrap_diff
from lungcal.errors import DataError
from lungcal.tracking.names import TAG_DATASET, TAG_STAGE1, TAG_STAGE2, predictions_artifact, predictions_artifacts
from lungcal.tracking.tracker import default_tracking_uri, open_store

__all__ = ["Claim", "paper_says", "read_predictions", "load_predictions", "predictions_of", "compare_predictions",
           "study_bins", "format_diff", "confidence_gap", "collect_claims", "render_claims"]

_CIFAR = ("cifar10", "cifar10lt")


def study_bins(dataset: str) -> int:
    """ECE bins of the study for a dataset: 15 on CIFAR, 10 on CT."""
    return 15 if dataset in _CIFAR else 10


@dataclass
class Claim:
    """One claim on one dataset: per-seed paired differences and their mean."""

    dataset: str
    name: str
    metric: str
    per_seed: dict[str, dict] = field(default_factory=dict)
    paper: str = ""  #: what the paper states for this difference on this dataset (:func:`paper_says`)

    @property
    def mean(self) -> float:
        vals = [d["diff"] for d in self.per_seed.values() if math.isfinite(d["diff"])]
        return float(np.mean(vals)) if vals else float("nan")


def read_predictions(path: str | Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``(case ids, probs (N, C) or (N,), labels)`` from a predictions file a run logs.

    ``*.npz`` (CIFAR: ``probs``, ``labels``; cases are numbered) or ``*.csv`` (CT: ``subject, label,
    probability`` of cancer; cases are the subjects).
    """
    path = Path(path)
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                probs, labels = np.asarray(z["probs"], np.float64), np.asarray(z["labels"], np.int64)
            return [str(i) for i in range(len(labels))], probs, labels
        with path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        return ([r["subject"] for r in rows], np.array([float(r["probability"]) for r in rows]),
                np.array([int(r["label"]) for r in rows]))
    except OSError as exc:
        raise DataError(f"cannot read predictions ({exc.strerror})", file=path,
                        fix="pass a run's predictions/<split>_predictions.npz or .csv") from exc
    except (KeyError, ValueError) as exc:
        raise DataError(f"not a predictions file ({exc})", file=path,
                        fix="a .npz with probs and labels, or a CSV with subject,label,probability") from exc


def load_predictions(client: MlflowClient, run_id: str, split: str = "test") -> tuple[list[str], np.ndarray,
                                                                                      np.ndarray] | None:
    """``(case ids, probs (N, C) or (N,), labels)`` from a run's logged predictions, or ``None``."""
    for name in (*predictions_artifacts(split, "npz"), predictions_artifact(split, "csv")):
        try:
            local = Path(client.download_artifacts(run_id, name))
        except Exception:  # noqa: BLE001 - the run did not log this format
            continue
        return read_predictions(local)
    return None


def predictions_of(source: str, split: str = "test", tracking_uri: str | None = None
                   ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The predictions behind ``source``: a predictions file (:func:`read_predictions`) or an MLflow run ID."""
    if Path(source).is_file():
        return read_predictions(source)
    uri = tracking_uri or default_tracking_uri()
    client = open_store(uri)
    try:
        client.get_run(source)
    except Exception as exc:  # noqa: BLE001 - MLflow raises its own exception types
        raise DataError(f"'{source}' is neither a predictions file nor a run in {uri}", field="run",
                        fix="pass a run ID (with --tracking-uri for another store) or a predictions file") from exc
    found = load_predictions(client, source, split)
    if found is None:
        raise DataError(f"run {source} logged no {predictions_artifact(split, 'npz')} or .csv",
                        field="--split", fix="choose a split the run scored, e.g. --split test")
    return found


def compare_predictions(a, b, metrics: Iterable[str] = ("auc", "ece"), n_bootstrap: int = 2000, seed: int = 0,
                        n_bins: int | None = None) -> dict:
    """Paired bootstrap of ``metric(A) - metric(B)`` for two models' predictions of the same cases.

    Args:
        a, b: ``(case ids, probs, labels)`` (:func:`read_predictions`); the two must hold the same
            cases with the same labels (matched by case id, in any order).
        metrics: names of :data:`lungcal.calibration.metrics.REPORT_METRICS` (and, binary, the clinical ones).
        n_bins: ECE bins; default the study's: 10 for binary (CT) predictions, 15 otherwise.

    Returns:
        ``{"n": cases, "n_bins": bins, "diffs": {metric: paired_bootstrap_diff(...)}}``.
    """
    ids_b = {k: i for i, k in enumerate(b[0])}
    if len(ids_b) != len(b[0]) or len(set(a[0])) != len(a[0]) or set(a[0]) != set(ids_b):
        raise DataError(f"the two predictions do not hold the same cases ({len(a[0])} and {len(b[0])}, "
                        f"{len(set(a[0]) & set(ids_b))} in common)", field="subject",
                        fix="compare two runs scored on the same split of the same datalist")
    order = np.array([ids_b[k] for k in a[0]], dtype=np.int64)
    pb, yb = b[1][order], b[2][order]
    if not np.array_equal(a[2], yb):
        raise DataError(f"the two predictions disagree on {int((a[2] != yb).sum())} labels", field="label",
                        fix="compare runs scored on the same datalist")
    bins = n_bins if n_bins is not None else (10 if np.ndim(a[1]) == 1 else 15)
    diffs = {m: paired_bootstrap_diff(m, a[1], pb, a[2], n_bootstrap=n_bootstrap, seed=seed, n_bins=bins)
             for m in metrics}
    return {"n": len(order), "n_bins": bins, "diffs": diffs}


def confidence_gap(probs, labels) -> float:
    """Mean top-label confidence minus accuracy (negative: under-confident)."""
    p = np.asarray(probs, np.float64)
    p2 = np.stack([1 - p, p], 1) if p.ndim == 1 else p
    return float(p2.max(1).mean() - accuracy(p2, labels))


def _align(a, b):
    """Restrict two ``(ids, probs, labels)`` to their common cases, in one order."""
    ids_b = {k: i for i, k in enumerate(b[0])}
    common = [(i, ids_b[k]) for i, k in enumerate(a[0]) if k in ids_b]
    ia, ib = (np.array(x, dtype=np.int64) for x in zip(*common)) if common else (np.empty(0, np.int64),) * 2
    return a[1][ia], b[1][ib], a[2][ia]


def _runs_by_config(client: MlflowClient, exp_id: str, split: str) -> dict[tuple[str, str, str, str], str]:
    """``{(dataset, stage1, stage2, seed): latest finished run id}``."""
    out: dict[tuple[str, str, str, str], str] = {}
    token = None
    while True:
        page = client.search_runs([exp_id], filter_string="attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=1000, page_token=token)
        for run in page:
            tags = run.data.tags
            if TAG_STAGE1 not in tags or f"{split}/ece" not in run.data.metrics:
                continue
            s2 = (tags.get(TAG_STAGE2) or "none").strip().lower()
            key = (tags.get(TAG_DATASET, ""), tags[TAG_STAGE1].strip().lower(), s2, run.data.params.get("seed", "0"))
            out.setdefault(key, run.info.run_id)
        token = page.token
        if not token:
            return out


def paper_says(dataset: str, kind: str, stage1: str = "") -> str:
    """What the paper states for a paired difference ``kind`` (``ts``, ``las``, ``auc``, ``gap``) of a
    ``stage1`` method on ``dataset`` (``cifar10``, ``cifar10lt``, or a CT dataset: ``nlst``, ``ucd``,
    ``upmc``, ``synthetic``...): a short phrase for the report, "no claim ..." where it states none."""
    ct = dataset not in _CIFAR
    if kind == "ts":
        return "TS lowers ECE (every dataset; below 1 % on CIFAR-10)"
    if kind == "las":
        if ct:
            return "LAS raises ECE on CT (UCD CE+LAS 31.03 %)"
        if dataset == "cifar10lt" and stage1 == "mixup":
            return "LAS on CE+Mixup: accuracy +7.44 pp, ECE rises 1.72 -> 5.18"
        return "no claim: the paper reports LAS on CIFAR-10-LT CE+Mixup only"
    if kind == "auc":
        return "focal discriminates slightly better on CT (no number)" if ct else "no claim on CIFAR"
    if kind == "gap":
        return ("Focal+Mixup under-confident (ECE 27.92 %)" if dataset == "cifar10" else
                "no claim on this dataset: the paper shows it on balanced CIFAR-10 only")
    raise ValueError(f"unknown difference kind {kind!r}: ts, las, auc or gap")


def collect_claims(client: MlflowClient, exp_id: str, split: str = "test", n_bootstrap: int = 1000,
                   seed: int = 0) -> list[Claim]:
    """Every claim the finished runs of ``exp_id`` can support, with paired CIs per seed."""
    runs = _runs_by_config(client, exp_id, split)
    cache: dict[str, tuple | None] = {}

    def preds(run_id):
        if run_id not in cache:
            cache[run_id] = load_predictions(client, run_id, split)
        return cache[run_id]

    claims: dict[tuple[str, str], Claim] = {}

    def add(dataset, name, metric, s, a_id, b_id, fn=None, paper=""):
        a, b = preds(a_id), preds(b_id) if b_id else None
        if a is None or (b_id and b is None):
            return
        bins = study_bins(dataset)
        if fn is not None:  # a one-model statistic (its difference from 0)
            pa, y = a[1], a[2]
            res = {"diff": fn(pa, y), **_one_sample_ci(fn, pa, y, n_bootstrap, seed)}
        else:
            pa, pb, y = _align(a, b)
            if len(y) == 0:
                return
            res = paired_bootstrap_diff(metric, pa, pb, y, n_bootstrap=n_bootstrap, seed=seed, n_bins=bins)
        claims.setdefault((dataset, name), Claim(dataset, name, metric, paper=paper)).per_seed[s] = res

    for (ds, s1, s2, s), run_id in sorted(runs.items()):
        if s2 in ("ts", "las") and (ds, s1, "none", s) in runs:
            add(ds, f"ΔECE({s1}+{s2.upper()} − {s1})", "ece", s, run_id, runs[(ds, s1, "none", s)],
                paper=paper_says(ds, s2, s1))
        if (s1, s2) == ("focal", "none") and (ds, "ce", "none", s) in runs:
            add(ds, "ΔAUC(focal − ce)", "auc", s, run_id, runs[(ds, "ce", "none", s)], paper=paper_says(ds, "auc"))
        if (s1, s2) == ("focal_mixup", "none"):
            add(ds, "confidence − accuracy (focal_mixup)", "gap", s, run_id, None, fn=confidence_gap,
                paper=paper_says(ds, "gap"))
    return sorted(claims.values(), key=lambda c: (c.dataset, c.name))


def _one_sample_ci(fn, probs, labels, n_bootstrap: int, seed: int) -> dict:
    """Percentile CI of a one-model statistic over resampled cases."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    reps = np.array([fn(probs[i], labels[i]) for i in (rng.integers(0, n, n) for _ in range(int(n_bootstrap)))])
    reps = reps[np.isfinite(reps)]
    if not reps.size:
        return {"ci_low": float("nan"), "ci_high": float("nan"), "significant": False}
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return {"ci_low": float(lo), "ci_high": float(hi), "significant": bool(lo > 0 or hi < 0),
            "n_bootstrap": int(reps.size)}


def format_diff(d: Mapping, percent: bool) -> str:
    """``+x.xx [+lo, +hi]`` (points of %, or a fraction to 3 places), `` (not significant)`` where the CI spans 0."""
    k = 100.0 if percent else 1.0
    text = f"{k * d['diff']:+.2f} [{k * d['ci_low']:+.2f}, {k * d['ci_high']:+.2f}]" if percent else \
        f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
    return text + ("" if d.get("significant") else " (not significant)")


def render_claims(claims: Iterable[Claim]) -> list[str]:
    """Markdown lines: one table of paired differences per dataset (ECE and gaps in points of %)."""
    claims = list(claims)
    if not claims:
        return []
    lines = ["## Paired differences (same test cases, 95% paired-bootstrap CIs)", "",
             "ECE and confidence gaps in percentage points, AUC as a fraction. A CI that spans 0 is "
             "marked *not significant*. The paper's column says what the paper states for each difference on that "
             "dataset; a row where it states nothing is our finding, not a reproduction.", "",
             "| dataset | paired difference | the paper says | seeds | mean over seeds | per seed |",
             "|---|---|---|---|---|---|"]
    for c in claims:
        percent = c.metric != "auc"
        per = "; ".join(f"seed {s}: {format_diff(d, percent)}" for s, d in sorted(c.per_seed.items()))
        mean = f"{(100 if percent else 1) * c.mean:+.{2 if percent else 3}f}"
        lines.append(f"| {c.dataset} | {c.name} | {c.paper} | {len(c.per_seed)} | {mean} | {per} |")
    return lines + [""]
