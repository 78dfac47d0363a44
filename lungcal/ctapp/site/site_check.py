"""``lungcal site-check``: is a new site's data the model's kind of data, and which fixes are valid there?

A site's CTs (labels optional) are compared with the model's training data in two ways:

- **acquisition**: per CT, slice thickness, slice spacing, pixel size, HU of air, noise and edge width
  (:mod:`lungcal.ct.acquisition`, measured by the series checks), against the summary the stage-1 run
  logged of its training split (``data/acquisition.json``). Per field: how many site CTs fall outside the
  training data's 1st-99th percentiles (widened by the estimators' tolerance), against the 2 % expected,
  by an exact binomial test (:func:`lungcal.calibration.shift.range_test`);
- **what the model sees**: the network's outputs and bag embeddings on the site's CTs against those on
  its own validation split (``data/site_reference.npz``, logged by every stage-1 run), re-weighted to the
  prevalence estimated on the site (black-box shift estimation), by permutation tests
  (:func:`lungcal.calibration.shift.label_shift_test`: KS on the scores, kernel MMD on the embeddings), so
  that a pure prevalence change is not called a scanner change; and an un-weighted test on the scores that
  sees any change, the prevalence's included.

The **verdict**, at family-wise level ``alpha`` (Bonferroni over the acquisition fields and the two
re-weighted tests):

- ``scanner_shift``: an acquisition field or the re-weighted model outputs differ. ``p(x | y)`` changed, so
  the label-free routes (a prior adjustment to a known prevalence, EM on unlabelled CTs) are not valid;
  only the site's labels can recalibrate (``lungcal recalibrate``) or adapt (fine-tuning) the model;
- ``prevalence_shift``: nothing but the outputs' mix changed (the un-weighted test, or the prevalence's
  interval excluding the model's own): a prior adjustment is valid;
- ``comparable``: no difference this many CTs can show.

**The size beside the p-values.** With embeddings on both sides, the report gives the AUC of a cross-validated
logistic regression that tells the site's embeddings from the reference's (on their leading principal components
and their squares, the reference re-weighted to the site's estimated prevalence;
:func:`lungcal.calibration.shift.domain_effect`), with its 95 % CI: 0.5 when they cannot be told apart, large from
:data:`lungcal.calibration.shift.EFFECT_AUC` (0.6). Beside ``comparable`` it prints the smallest AUC the site's n
could have shown with 80 % power, so that "no difference shown" is read with its size. The verdict itself still
follows the tests; a significant change whose size is small is marked as such in the report.

Each CT is also placed against the training data (acquisition outside everything training held; embedding
beyond the 99th percentile of the validation cases' nearest-neighbour distances): the per-CT part that
``lungcal predict`` uses. The check is logged as an MLflow run (tag ``lungcal.site_check`` = the verdict)
holding ``site_check.json`` and ``plots/site_check.png``; ``--json`` writes the same JSON.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lungcal.calibration.shift import (
    EmbeddingRange,
)
from lungcal.candidates.cache import BagParams, masker_from_config
from lungcal.ct.acquisition import ACQUISITION_FIELDS, AcquisitionStats, outside_training
from lungcal.ct.qc import QCConfig
from lungcal.ctapp.data.series_qc import acquisitions, keep_passing, screen
from lungcal.ctapp.data.unlabelled import unlabelled_rows
from lungcal.ctapp.evaluate.reports import binary_scores, flat_features
from lungcal.ctapp.evaluate.site_assessment import (
    COMPARABLE,
    MIN_REFERENCE_PER_CLASS,
    MIN_SITE_CTS,
    PREVALENCE_SHIFT,
    SCANNER_SHIFT,
    VERDICTS,
    Reference,
    acquisition_checks,
    assess,
)
from lungcal.ctapp.infer.scoring import score_rows
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.data.manifest import load_manifest, manifest_source, rows_for_split
from lungcal.errors import ConfigError, DataError
from lungcal.paths import atomic_write_text, default_output_dir
from lungcal.tracking import (
    CT_EXPERIMENT,
    SITE_CHECK_ARTIFACT,
    TAG_DATASET,
    TAG_SITE,
    TAG_SITE_CHECK,
    TAG_STAGE1,
    RunTracker,
    default_tracking_uri,
    run_acquisition_summary,
    run_site_reference,
)

__all__ = ["VERDICTS", "COMPARABLE", "PREVALENCE_SHIFT", "SCANNER_SHIFT", "MIN_SITE_CTS", "MIN_REFERENCE_PER_CLASS",
           "ROUTES", "Reference", "SiteCheck", "acquisition_checks", "assess", "json_ready", "site_check",
           "format_report", "reference_from_datalist"]


#: stands for the site's datalist in the stored routes (a path is never logged); the printed routes name it
SITE_PLACEHOLDER = "<site datalist>"
#: what each verdict makes valid, as ``(route, what it needs)``; ``{run}`` and ``{site}`` are filled in
ROUTES: dict[str, list[tuple[str, str]]] = {
    COMPARABLE: [
        ("use the model as shipped: lungcal predict <CTs> --run {run}", "nothing"),
        ("check its calibration here: lungcal recalibrate --model {run} --datalist {site}",
         "the site's labelled CTs (val and test splits)"),
    ],
    PREVALENCE_SHIFT: [
        ("adjust to a known prevalence: lungcal recalibrate --model {run} --datalist {site} --prevalence P",
         "the site's prevalence P, and a labelled test split to check the result"),
        ("estimate the prevalence: lungcal recalibrate --model {run} --datalist {site} --unlabelled CTS",
         "unlabelled site CTs"),
        ("recalibrate on the site's labels: lungcal recalibrate --model {run} --datalist {site}",
         "labelled val and test splits"),
    ],
    SCANNER_SHIFT: [
        ("recalibrate on the site's labels: lungcal recalibrate --model {run} --datalist {site}",
         "labelled val and test splits (a few dozen cancers in val)"),
        ("fine-tune on the site's labels: python -m monai.bundle run --config_file bundles/nlst_focal.json "
         "--datalist {site} --init_run_id {run}", "labelled train, val and test splits (hundreds of CTs)"),
        ("not valid here: --prevalence, --unlabelled, a stored prior adjustment",
         "they assume the images did not change"),
    ],
}


@dataclass
class SiteCheck:
    """What a site check found (:func:`assess`), and where it was stored."""

    verdict: str
    alpha: float
    n: int
    n_reference: int
    source_prevalence: float
    prevalence: float
    prevalence_ci: tuple[float, float]
    tests: dict[str, dict[str, Any]]
    acquisition: dict[str, dict[str, Any]]
    per_ct: list[dict[str, Any]]
    reasons: list[str]
    routes: list[dict[str, str]] = field(default_factory=list)
    site: str = "unknown"
    model: str | None = None
    qc_skipped: int = 0
    reference_source: str = ""
    acquisition_source: str = ""
    run_id: str | None = None
    tracking_uri: str | None = None
    json_path: str | None = None
    #: the datalist checked, printed in the routes (never logged: paths stay out of MLflow)
    site_path: str | None = None
    #: the effect size (:func:`lungcal.calibration.shift.domain_effect`: ``auc``, ``ci``, ``mde``, ``threshold``,
    #: ``large``); None without embeddings
    effect: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("verdict", "alpha", "n", "n_reference", "source_prevalence",
                                             "prevalence", "prevalence_ci", "tests", "acquisition", "reasons",
                                             "routes", "site", "model", "qc_skipped", "reference_source",
                                             "acquisition_source", "run_id", "per_ct", "effect")}
        out["prevalence_ci"] = list(self.prevalence_ci)
        out["n_flagged"] = sum(1 for c in self.per_ct if c["flagged"])
        return json_ready(out)


def json_ready(x: Any) -> Any:
    """JSON-ready: NaN and infinities as None, numpy scalars as Python numbers (also for adaptation curves)."""
    if isinstance(x, Mapping):
        return {str(k): json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def per_ct(subjects: Sequence[str], stats: Sequence[AcquisitionStats | None], summary: Mapping[str, Any] | None,
           reference: Reference, features: np.ndarray | None) -> list[dict[str, Any]]:
    """Each CT against the training data: acquisition fields outside everything training held, and the
    embedding's nearest-neighbour distance beyond the validation cases' 99th percentile."""
    emb = None
    if features is not None and reference.features is not None and len(reference.features) > 6:
        rng = EmbeddingRange(reference.features)
        dist = rng.distance(features)
        emb = (dist, rng.threshold)
    out = []
    for i, (subject, a) in enumerate(zip(subjects, stats)):
        fields_out = outside_training(summary, a)
        entry: dict[str, Any] = {"subject": subject, "acquisition_outside": fields_out}
        if emb is not None:
            entry["embedding_distance"] = float(emb[0][i])
            entry["embedding_threshold"] = emb[1]
        entry["flagged"] = bool(fields_out) or (emb is not None and emb[0][i] > emb[1])
        out.append(entry)
    return out


def reference_from_datalist(net, datalist: str | Path, bag_params, *, cache_dir: Path, num_workers: int = 0,
                            qc: QCConfig | None = None, out_dir: Path | None = None) -> Reference:
    """The reference from the ``val`` split of the model's own training datalist (for runs that logged none)."""
    datalist = Path(datalist).expanduser()
    if not datalist.is_file():
        raise DataError("reference datalist not found", file=datalist, field="--reference",
                        fix="pass the datalist the model was trained on (its val split is scored)")
    rows = rows_for_split(load_manifest(datalist), "val")
    if not rows:
        raise DataError("the reference datalist has no 'val' rows", file=datalist, field="--reference")
    if qc is not None and out_dir is not None:
        rows, _ = keep_passing(rows, screen(rows, qc, out_dir / "cache" / "qc", num_workers=num_workers),
                               title="reference (val)")
    sc = score_rows(net, rows, bag_params, None, cache_dir=cache_dir, num_workers=num_workers)
    return Reference(binary_scores(sc["logits"]), np.asarray(sc["labels"]).astype(int),
                     flat_features(sc["features"]) if sc.get("features") is not None else None,
                     f"val split of {datalist.name}").check()


def _site_rows(path: Path) -> tuple[list[dict], str]:
    """The site's rows (a datalist: every split; a folder: every CT) and its name."""
    if path.is_file() and path.suffix == ".json":
        try:
            rows = load_manifest(path)
        except DataError:
            rows = None
        if rows:
            sites = sorted({str(r.get("site")) for r in rows if r.get("site")})
            return ([{**r, "subject": r.get("subject") or f"c{i:04d}"} for i, r in enumerate(rows)],
                    ",".join(sites) or "unknown")
    return unlabelled_rows(path), "unknown"


def site_check(run: str, path: str | Path, *, tracking_uri: str | None = None, output_dir: str | Path | None = None,
               json_path: str | Path | None = None, alpha: float = 0.05, site: str | None = None,
               reference: str | Path | None = None, qc: QCConfig | None = None, num_workers: int = 0,
               n_resamples: int = 1000, n_subsamples: int = 20, seed: int = 0, log: bool = True,
               experiment: str = CT_EXPERIMENT) -> SiteCheck:
    """Check a site's CTs against a stage-1 model's training data (module doc).

    Args:
        run: the stage-1 MLflow run id.
        path: the site's datalist JSON (any splits; labels not needed) or a folder of its CTs.
        json_path: also write the JSON here.
        alpha: the family-wise false-alarm rate of a scanner-change verdict (default 0.05).
        site: the ``lungcal.site`` tag (default: the datalist rows' ``site``).
        reference: a datalist whose ``val`` split is scored as the reference, for a run that logged no
            ``data/site_reference.npz``.
        qc: series-check thresholds (default: the bundles'); CTs that fail one are left out and counted.

    Raises:
        ConfigError: a bad alpha, an unknown run, or a run without a reference and no ``reference``.
        DataError: fewer than :data:`MIN_SITE_CTS` CTs pass the series checks (the message names the minimum).
    """
    if not 0 < float(alpha) < 0.5:
        raise ConfigError(f"--alpha {alpha} is not in (0, 0.5)", field="--alpha", fix="use e.g. 0.05")
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError("not found", file=path, field="DATALIST",
                        fix="pass the site's datalist JSON or a folder holding its CTs")
    rows, site_from_rows = _site_rows(path)
    if len(rows) < MIN_SITE_CTS:
        few = f"{len(rows)} CT is" if len(rows) == 1 else f"{len(rows)} CTs are"
        raise DataError(f"{few} too few to tell a site's data from the model's: a site check needs at "
                        f"least {MIN_SITE_CTS}", file=path, fix=f"add CTs until at least {MIN_SITE_CTS} pass the "
                        "series checks (lungcal qc shows which do)")
    out_dir = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    uri = tracking_uri or default_tracking_uri(out_dir)
    stage1 = load_stage1(str(run), uri, field="--run")
    _needs_run(stage1)
    cache = out_dir / "cache" / "bags"
    ref = stored_reference(uri, stage1.run.info.run_id)
    if ref is None and reference is not None:
        ref = reference_from_datalist(stage1.network, reference, stage1.bag_params, cache_dir=cache,
                                      num_workers=num_workers, qc=qc or QCConfig(), out_dir=out_dir)
    elif ref is None:
        raise _no_reference(stage1)
    stored_masker = BagParams.from_any(stage1.bag_params).preprocess.get("masker")  # None: the default masker
    reports = screen(rows, qc or QCConfig(), out_dir / "cache" / "qc", num_workers=num_workers,
                     masker=masker_from_config(stored_masker) if stored_masker else None)
    kept, skipped = keep_passing(rows, reports, title="site CTs")
    kept_reports = [rep for rep in reports if rep is None or not rep.failed]
    if len(kept) < MIN_SITE_CTS:
        raise DataError(f"{len(kept)} of {len(rows)} CTs pass the series checks, too few to tell a site's data from "
                        f"the model's: a site check needs at least {MIN_SITE_CTS}", file=path,
                        fix="run `lungcal qc` on the site's CTs to see why the others fail, or add CTs")
    sc = score_rows(stage1.network, kept, stage1.bag_params, None, cache_dir=cache, num_workers=num_workers)
    features = flat_features(sc["features"]) if sc.get("features") is not None else None
    return check_scored(stage1, binary_scores(sc["logits"]), features, acquisitions(kept_reports),
                        tracking_uri=uri, output_dir=out_dir, path=path, site=site or site_from_rows, alpha=alpha,
                        reference=ref, qc_skipped=len(skipped), n_resamples=n_resamples,
                        n_subsamples=n_subsamples, seed=seed, json_path=json_path, log=log, experiment=experiment)


def stored_reference(uri: str, run_id: str) -> Reference | None:
    """The reference a stage-1 run logged (``data/site_reference.npz``), or None for a run that logged none."""
    stored = run_site_reference(uri, run_id)
    if stored is None:
        return None
    return Reference(np.asarray(stored["scores"], float), np.asarray(stored["labels"]).astype(int),
                     flat_features(stored["features"]) if stored.get("features") is not None else None,
                     "the run's validation split (data/site_reference.npz)").check()


def _no_reference(stage1) -> ConfigError:
    return ConfigError(f"run {stage1.run_id} logged no site reference (it was trained before site checks)",
                       field="--run", fix="pass --reference <the datalist it was trained on>, or retrain")


def _needs_run(stage1) -> None:
    if stage1.run is None:
        raise ConfigError("a site check needs the model as an MLflow run (its training data's summary is there)",
                          field="--run", fix="pass the stage-1 run id, not a checkpoint file")


def check_scored(stage1, scores: np.ndarray, features: np.ndarray | None,
                 stats: Sequence[AcquisitionStats | None], *, tracking_uri: str, output_dir: Path, path: Path,
                 site: str | None = None, alpha: float = 0.05, reference: Reference | None = None,
                 qc_skipped: int = 0, n_resamples: int = 1000, n_subsamples: int = 20, seed: int = 0,
                 json_path: str | Path | None = None, log: bool = True,
                 experiment: str = CT_EXPERIMENT) -> SiteCheck:
    """The site check of CTs already screened and scored by ``stage1``'s network (their scores, pooled bag
    embeddings and acquisition statistics, one per CT, in order): what :func:`site_check` does after scoring, and
    what ``lungcal recalibrate`` asks of the CTs it has scored itself, so that each CT is screened and scored
    once. ``reference``: the source side (default: the run's ``data/site_reference.npz``); ``path``: the CTs'
    datalist or folder (its source names the run's dataset tag; never logged as a path).

    Raises:
        ConfigError: a model that is no run, or a run without a reference and no ``reference``.
        DataError: fewer than :data:`MIN_SITE_CTS` CTs.
    """
    _needs_run(stage1)
    if len(scores) < MIN_SITE_CTS:
        raise DataError(f"{len(scores)} CTs pass the series checks, too few to tell a site's data from the model's: "
                        f"a site check needs at least {MIN_SITE_CTS}", file=path,
                        fix="run `lungcal qc` on the site's CTs to see why the others fail, or add CTs")
    uri = tracking_uri
    ref = reference if reference is not None else stored_reference(uri, stage1.run.info.run_id)
    if ref is None:
        raise _no_reference(stage1)
    summary = run_acquisition_summary(uri, stage1.run.info.run_id)
    scores = np.asarray(scores, float)
    acq = acquisition_checks(summary, stats)
    found = assess(ref, scores, features, acq, alpha=alpha, n_resamples=n_resamples, n_subsamples=n_subsamples,
                   seed=seed)
    subjects = [f"c{i:04d}" for i in range(len(scores))]  # positional pseudonyms: no site id reaches a log
    model = stage1.run.info.run_id
    routes = [{"route": r.format(run=model, site=SITE_PLACEHOLDER), "needs": n} for r, n in ROUTES[found["verdict"]]]
    res = SiteCheck(verdict=found["verdict"], alpha=alpha, n=len(scores), n_reference=len(ref.scores),
                    source_prevalence=found["source_prevalence"], prevalence=found["prevalence"],
                    prevalence_ci=found["prevalence_ci"], tests=found["tests"], acquisition=acq,
                    per_ct=per_ct(subjects, stats, summary, ref, features), reasons=found["reasons"], routes=routes,
                    site=site or "unknown", model=model, qc_skipped=qc_skipped, reference_source=ref.source,
                    acquisition_source="the run's training split (data/acquisition.json)" if summary is not None
                    else "none: the run logged no acquisition summary, only the model's outputs were compared",
                    tracking_uri=uri, site_path=str(path) if Path(path).suffix == ".json" else None,
                    effect=found.get("effect"))
    target = Path(json_path).expanduser() if json_path is not None else None
    if target is not None:
        res.json_path = str(target)
        atomic_write_text(target, _json(res))
    if log:
        _log_run(res, ref, scores, stats, summary, Path(path), experiment, Path(output_dir),
                 stage1.stage1_name(TAG_STAGE1))
        if target is not None:  # again, now with the run id
            atomic_write_text(target, _json(res))
    return res


def _json(res: SiteCheck) -> str:
    return json.dumps(res.as_dict(), indent=2) + "\n"


def _log_run(res: SiteCheck, ref: Reference, scores: np.ndarray, stats: Sequence[AcquisitionStats | None],
             summary: Mapping[str, Any] | None, path: Path, experiment: str, out_dir: Path, stage1_name: str) -> None:
    tags = {TAG_SITE_CHECK: res.verdict, TAG_SITE: res.site, TAG_STAGE1: stage1_name,
            TAG_DATASET: manifest_source(path) if path.suffix == ".json" else "folder"}
    name = f"site-check@{res.site}-{time.strftime('%Y%m%d-%H%M%S')}"
    with RunTracker(experiment, name, tracking_uri=res.tracking_uri, tags=tags, parent_run_id=res.model) as tr:
        tr.log_params({"alpha": res.alpha, "n": res.n, "n_reference": res.n_reference, "qc_skipped": res.qc_skipped,
                       "model": res.model, "site": res.site, "verdict": res.verdict})
        metrics = {"site_check/prevalence": res.prevalence, "site_check/source_prevalence": res.source_prevalence,
                   "site_check/n_flagged": sum(1 for c in res.per_ct if c["flagged"])}
        for k, t in res.tests.items():
            metrics[f"site_check/{k}_p"] = t["pvalue"]
            metrics[f"site_check/{k}_stat"] = t["statistic"]
        for k, a in res.acquisition.items():
            metrics[f"site_check/{k}_outside"] = a["outside"]
            metrics[f"site_check/{k}_p"] = a["pvalue"]
        if res.effect is not None:
            metrics.update({"site_check/domain_auc": res.effect["auc"], "site_check/domain_auc_ci_low":
                            res.effect["ci"][0], "site_check/domain_auc_ci_high": res.effect["ci"][1],
                            "site_check/domain_auc_mde": res.effect["mde"]})
        tr.log_metrics({k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))})
        res.run_id = tr.run_id
        tr.log_dict(res.as_dict(), SITE_CHECK_ARTIFACT)
        tr.log_figure(site_check_figure(res, ref, scores, stats, summary), "plots/site_check.png")


def site_check_figure(res: SiteCheck, ref: Reference, scores: np.ndarray, stats: Sequence[AcquisitionStats | None],
                      summary: Mapping[str, Any] | None):
    """The two distributions: the model's scores on the site against the reference's (as it is, and re-weighted
    to the site's estimated prevalence), and each acquisition field's site values against the training range."""
    fields_shown = [f for f in ACQUISITION_FIELDS if f in res.acquisition]
    fig = Figure(figsize=(4 + 2.2 * max(1, len(fields_shown)), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1 + max(1, len(fields_shown)), squeeze=False)
    ax = axes[0, 0]
    y = ref.labels
    q = res.prevalence if res.prevalence is not None and math.isfinite(res.prevalence) else float(y.mean())
    w = np.where(y == 1, q / max(y.mean(), 1e-9), (1 - q) / max(1 - y.mean(), 1e-9))
    bins = np.linspace(min(ref.scores.min(), scores.min()), max(ref.scores.max(), scores.max()), 25)
    ax.hist(ref.scores, bins=bins, density=True, histtype="step", color="grey", label="model's val")
    ax.hist(ref.scores, bins=bins, weights=w, density=True, histtype="step", color="black",
            label=f"val re-weighted to {q:.2f}")
    ax.hist(scores, bins=bins, density=True, alpha=0.5, color="tab:red", label=f"site (n={len(scores)})")
    ax.set_xlabel("score (logit cancer - logit other)")
    ax.set_title(f"verdict: {res.verdict}")
    ax.legend(fontsize=7)
    for ax, name in zip(axes[0, 1:], fields_shown):
        a = res.acquisition[name]
        v = np.array([getattr(s, name) for s in stats if s is not None], float)
        ax.axhspan(a["training_low"], a["training_high"], color="grey", alpha=0.25, label="training 1-99%")
        ax.plot(np.random.default_rng(0).uniform(-0.3, 0.3, v.size), v, ".", color="tab:red", alpha=0.6)
        ax.set_xticks([])
        ax.set_title(f"{name}\np = {a['pvalue']:.2g}", fontsize=8)
    for ax in axes[0, 1 + len(fields_shown):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def effect_lines(res: SiteCheck) -> list[str]:
    """The effect size beside the p-values: the domain classifier's AUC with its CI, the threshold it is read
    against, and the smallest AUC this site's n could have shown (what ``comparable`` can and cannot rule out)."""
    e = res.effect
    if e is None:
        return ["  effect size   not measured: no embeddings on one side"]
    size = "large" if e["large"] else "small"
    out = [f"  effect size   domain AUC {e['auc']:.3f} [{e['ci'][0]:.3f}, {e['ci'][1]:.3f}] (0.5: the site's "
           f"embeddings cannot be told from the reference's; >= {e['threshold']:.2f} counts as large): {size}"]
    if res.verdict == COMPARABLE:
        out.append(f"  could show    a domain AUC of {e['mde']:.3f} or more with 80% power at these n ({res.n} site, "
                   f"{res.n_reference} reference); a smaller difference may hide behind 'comparable'")
    elif res.verdict == SCANNER_SHIFT and not e["large"] and not any(
            k in r for r in res.reasons for k in ACQUISITION_FIELDS):
        out.append("  note          significant but small: the outputs differ by less than the stated size")
    return out


def format_report(res: SiteCheck) -> str:
    """The printed report: the verdict, why, the statistics, the valid routes, and where it is stored."""
    lines = [f"== site check: {res.site} against model {res.model} =="]
    lines.append(f"  verdict       {res.verdict}")
    for r in res.reasons:
        lines.append(f"  because       {r}")
    lines.append(f"  CTs           {res.n} checked" + (f" ({res.qc_skipped} failed a series check, left out)"
                                                       if res.qc_skipped else "") + f"; reference {res.n_reference}")
    ci = res.prevalence_ci
    lines.append(f"  prevalence    {res.prevalence:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] estimated here (BBSE); "
                 f"model's {res.source_prevalence:.2f}")
    for k, t in res.tests.items():
        lines.append(f"  {k:<30} stat {t['statistic']:.3f}  p {t['pvalue']:.3g}")
    for k, a in res.acquisition.items():
        lines.append(f"  {k:<30} {a['outside']}/{a['n']} outside [{a['training_low']:.3g}, {a['training_high']:.3g}]"
                     f"  site median {a['site_median']:.3g}  p {a['pvalue']:.3g}")
    if not res.acquisition:
        lines.append(f"  acquisition   {res.acquisition_source}")
    lines.extend(effect_lines(res))
    flagged = sum(1 for c in res.per_ct if c["flagged"])
    lines.append(f"  per CT        {flagged} of {res.n} outside the training data (acquisition or embedding)")
    for route in res.routes:
        text = route["route"].replace(SITE_PLACEHOLDER, res.site_path) if res.site_path else route["route"]
        lines.append(f"  route         {text}  (needs: {route['needs']})")
    if res.run_id:
        lines.append(f"  MLflow run    {res.run_id} (tag {TAG_SITE_CHECK} = {res.verdict})")
    if res.json_path:
        lines.append(f"  JSON          {res.json_path}")
    return "\n".join(lines)
