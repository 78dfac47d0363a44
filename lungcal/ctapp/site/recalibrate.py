"""Local recalibration for a hospital site: recalibrators fitted on the site's own validation split.

A model trained elsewhere is re-checked on the site's data and recalibrated *without retraining*:
the stage-1 network is frozen, and the site's ``test`` split is scored (bootstrap CIs, the same
resamples for every row, so rows are comparable) with

- ``uncalibrated``: the network's softmax;
- ``reference_<name>``: the model *as shipped*, i.e. with the calibrator the stage-1 bundle
  fitted on its own (reference-site) validation split, when the model is a run that has one;
- each local calibrator fitted on the site's ``val`` logits only (``--method``; ``auto`` =
  :func:`lungcal.calibration.scaling.select_calibrator` over ts / platt / isotonic by
  cross-validated NLL);
- ``prior``: the shipped probabilities re-weighted to the site's known prevalence
  (``--prevalence``; :func:`lungcal.calibration.prior.adjust_to_prior`, no labels used);
- ``em``: the same with the prevalence estimated by EM on site CTs without outcomes
  (``--unlabelled``; :func:`lungcal.calibration.prior.estimate_prior_em`).

The *source* prevalence of a prior adjustment is the one the shipped probabilities are calibrated
to: the ``source_prior`` of the reference calibrator's run (its fit split's prevalence), else the
stage-1 run's ``train/prevalence`` or ``val/prevalence``, else ``--source-prevalence``.

The test split is never used for fitting. The result is logged as one MLflow run
(``lungcal.stage2`` = ``lungcal.calibrator`` = the chosen calibrator, ``lungcal.site``,
``lungcal.recalibration = local``, ``lungcal.parent_run``), holding the chosen calibrator as
``calibrator/<name>.json`` (what ``inference.json --site`` applies), final metrics ``test/...``
for the chosen row and ``test_<row>/...`` for the others, ``temperature`` when TS is chosen,
and ``lungcal.fit_warning`` when the chosen fit is "no signal". Everything is checked before the
run is opened, so a bad input leaves no run behind.

With ``--miss-rate ALPHA`` (and ``--confidence``, 1 - delta), the run also holds a decision threshold
chosen on the certify split's probabilities of the chosen calibrator (``--certify-split``, default val),
whose missed-cancer rate is at most ALPHA with probability 1 - delta (``--guarantee ltt``, default) or at
most ALPHA on average over draws (``--guarantee crc``) (:mod:`lungcal.ctapp.site.threshold`):
``val/threshold_missrate``, the positive rate on the certify split and test, the test sensitivity with its
CI, and ``guarantee.json``, which ``predict --site`` applies and states per CT. A certify split with too few
cancers is refused first, and so is one whose CTs trained the model or chose its checkpoint
(:mod:`lungcal.ctapp.site.certify_split`: the fine-tune route's val split).

**The site check guards the label-free routes.** A prior adjustment (``--prevalence``, ``--unlabelled``)
assumes that only the prevalence changed. Before either is fitted, ``lungcal site-check``'s statistics
(:func:`lungcal.ctapp.site.site_check.check_scored`, logged as its own MLflow run) run on the datalist's
``val`` and ``test`` CTs as this recalibration screened and scored them (each CT is screened and scored once):
the CTs the adjustment is evaluated on, drawn from the population it will be
applied to (the train split is not used by a recalibration). With ``--unlabelled``, the unlabelled CTs
that EM runs on are checked too, on their own (a shift among them must not be diluted by val and test):
params ``site_check_unlabelled``, ``site_check_run_unlabelled``; either check refuses alike. The val and test
verdict and run are recorded on the recalibration run (params ``site_check``, ``site_check_run``), which is
what ``predict --site`` reads (:func:`lungcal.ctapp.evaluate.calibrators.prior_guard`).

- ``scanner_shift``: refused (ConfigError, exit code 2) in one line naming the verdict, its first reason and
  the routes that are valid (labelled recalibration, fine-tuning), unless ``force``: then the run goes on,
  prints a warning and is tagged ``lungcal.forced_past_site_check = scanner_shift``;
- the check cannot run (fewer than :data:`~lungcal.ctapp.site.site_check.MIN_SITE_CTS` val and test CTs
  pass the series checks, a stage-1 run that logged no site reference, a checkpoint instead of a run):
  refused the same way, since "not checked" must not read as "comparable"; with ``force`` the run is
  tagged ``unchecked``;
- ``comparable`` / ``prevalence_shift``: goes on.

A labelled-only recalibration (no ``--prevalence``/``--unlabelled``) runs no check: the site's labels make
it valid under any shift.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lungcal.calibration.measures.decision_curve import DEFAULT_THRESHOLDS, DecisionCurve, decision_curve
from lungcal.calibration.metrics import ece_consistency_pvalue
from lungcal.calibration.plots import decision_curve_plot
from lungcal.calibration.prior import PRIOR, PriorAdjusted, adjust_to_prior, check_prior, estimate_prior_em
from lungcal.calibration.scaling import (
    CALIBRATORS,
    FEW_EVENTS,
    calibrated_probs,
    fit_warnings,
    make_calibrator,
    no_signal,
    probabilities,
    select_calibrator,
)
from lungcal.calibration.selective import REFERRAL_METRIC, referral_threshold
from lungcal.candidates.cache import BagParams, masker_from_config
from lungcal.ct.acquisition import AcquisitionStats, summarize_acquisitions
from lungcal.ct.qc import QCConfig
from lungcal.ctapp.data.series_qc import acquisitions, keep_passing, screen
from lungcal.ctapp.data.unlabelled import unlabelled_rows
from lungcal.ctapp.evaluate.calibrators import SITE_CHECK_PARAM, SITE_CHECK_RUN_PARAM, UNCHECKED, reference_calibrator
from lungcal.ctapp.evaluate.reports import binary_scores, evaluate_probs, flat_features, log_site_reference, log_split
from lungcal.ctapp.infer.scoring import score_rows
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.ctapp.site.certify_split import certify_check
from lungcal.ctapp.site.recalibrate_summary import format_summary
from lungcal.ctapp.site.site_check import MIN_SITE_CTS, ROUTES, SCANNER_SHIFT, check_scored
from lungcal.ctapp.site.subgroups import ct_groups, subgroup_rows
from lungcal.ctapp.site.threshold import (
    SiteThreshold,
    check_cancers,
    check_certify_split,
    check_levels,
    site_threshold,
)
from lungcal.data.manifest import load_manifest, manifest_source, rows_for_split
from lungcal.errors import ConfigError, DataError
from lungcal.paths import atomic_write_text, default_output_dir
from lungcal.tracking import (
    ACQUISITION_ARTIFACT,
    CALIBRATOR_DIR,
    CT_EXPERIMENT,
    GUARANTEE_ARTIFACT,
    TAG_CALIBRATOR,
    TAG_DATASET,
    TAG_FIT_WARNING,
    TAG_FORCED,
    TAG_RECALIBRATION,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
    file_digest,
    linked_calibrator_run,
    plot_artifact,
)

__all__ = ["METHODS", "AUTO_CANDIDATES", "Recalibration", "recalibrate", "format_summary", "check_prevalence",
           "check_method"]

#: ``--method`` choices: a registry calibrator, ``auto`` (selection) or ``prior`` (store the prior adjustment)
METHODS = ("auto", *CALIBRATORS, PRIOR)
#: the candidates of ``--method auto``, simplest first
AUTO_CANDIDATES = ("ts", "platt", "isotonic")
#: an EM prevalence estimate this close to 0 or 1 is "no signal" (the shipped probabilities are far
#: from calibrated on the unlabelled CTs: not a pure prevalence change)
EM_BOUND = 0.01
#: the series checks a site's CTs pass before they are scored (the bundles' ``qc`` defaults)
DEFAULT_QC = QCConfig()


def check_method(method: str) -> str:
    """``method`` if it is one of :data:`METHODS`, else a ConfigError naming them."""
    if method not in METHODS:
        raise ConfigError(f"unknown --method {method!r}", field="--method", fix=f"use one of: {', '.join(METHODS)}")
    return method


def check_prevalence(value: Any, field: str = "--prevalence") -> float:
    """A prevalence strictly between 0 and 1, else a ConfigError (:func:`lungcal.calibration.prior.check_prior`)."""
    return check_prior(value, field)


def _site_rows(datalist: Path) -> tuple[list[dict], list[dict], str]:
    rows = load_manifest(datalist)
    val, test = rows_for_split(rows, "val"), rows_for_split(rows, "test")
    _site_labels(val, test, datalist)
    sites = sorted({str(r.get("site")) for r in rows if r.get("site")})
    return val, test, ",".join(sites) or "unknown"


def _site_labels(val: list[dict], test: list[dict], datalist: Path) -> None:
    """DataError unless both splits hold cancer and non-cancer CTs."""
    for name, part in (("val", val), ("test", test)):
        labels = {int(r["label"]) for r in part}
        if not part:
            raise DataError(f"the datalist has no '{name}' rows", file=datalist, field="split",
                            fix="import the site with validation and test splits (lungcal import-site), "
                                "then check with lungcal check-data")
        if labels != {0, 1}:
            raise DataError(f"the '{name}' split holds only label(s) {sorted(labels)}", file=datalist, field="label",
                            fix=f"the {name} split needs cancer and non-cancer CTs (that pass the series checks); "
                                "re-split the site with more subjects")


def _screen(rows: list[dict], bag_params, qc: QCConfig | None, out_dir: Path, num_workers: int,
            what: str) -> tuple[list[dict], list[str], list[AcquisitionStats | None]]:
    """The rows whose series pass the checks (the stage-1 run's masker), the pseudonyms of those that fail, and
    the acquisition statistics of the rows kept (None each without the checks).

    As in training, a failing CT is left out (count and reasons printed), not scored: the test split
    then holds what inference would accept.
    """
    if qc is None:
        return rows, [], [None] * len(rows)
    stored = BagParams.from_any(bag_params).preprocess.get("masker")  # None: the default masker
    reports = screen(rows, qc, out_dir / "cache" / "qc", masker=masker_from_config(stored) if stored else None,
                     num_workers=num_workers)
    kept, skipped = keep_passing(rows, reports, title=what)
    if not kept:
        raise DataError(f"every {what} CT fails a series check", field="--datalist",
                        fix="run `lungcal qc` on the site's CTs to see why (--no-qc scores them anyway)")
    kept_acq = [acq for rep, acq in zip(reports, acquisitions(reports)) if rep is None or not rep.failed]
    return kept, skipped, kept_acq


def _check_stats(rows: list[dict], acq: list[AcquisitionStats | None], qc: QCConfig | None, out_dir: Path,
                 num_workers: int) -> list[AcquisitionStats | None]:
    """The acquisition statistics the site check compares: those the series checks measured, or, with the checks
    off (``--no-qc``), measured by the default checks anyway (a site check always reads them; no CT is left
    out for it)."""
    if qc is not None:
        return acq
    return acquisitions(screen(rows, DEFAULT_QC, out_dir / "cache" / "qc", num_workers=num_workers))


def _source_prior(uri: str, stage1, ref_run, explicit: float | None) -> tuple[float, str]:
    """The prevalence the shipped probabilities are calibrated to, and where it came from."""
    if explicit is not None:
        return explicit, "--source-prevalence"
    if ref_run is not None and "source_prior" in ref_run.data.metrics:
        return float(ref_run.data.metrics["source_prior"]), "reference calibrator's fit split"
    metrics = stage1.run.data.metrics if stage1.run is not None else {}
    for key in ("train/prevalence", "val/prevalence"):
        if key in metrics:
            return float(metrics[key]), f"stage-1 run {key}"
    raise ConfigError("the prevalence the model was calibrated to is unknown (a checkpoint, or a run that did not "
                      "log it)", field="--source-prevalence",
                      fix="pass --source-prevalence <fraction of cancers in the model's training/validation data>")


def _fit_local(method: str, val: Mapping[str, Any], seed: int) -> tuple[str | None, dict[str, Any], dict | None]:
    """-> (chosen local name or None, {name: fitted calibrator}, cv_nll or None)."""
    z, y = val["logits"], val["labels"]
    if method == "auto":
        chosen, cal, cv_nll = select_calibrator(z, y, candidates=AUTO_CANDIDATES, seed=seed)
        fitted = {n: (cal if n == chosen else make_calibrator(n).fit(z, y)) for n in AUTO_CANDIDATES}
        return chosen, fitted, cv_nll
    if method == PRIOR:
        return None, {}, None
    return method, {method: make_calibrator(method).fit(z, y)}, None


@dataclass
class Recalibration:
    """What :func:`recalibrate` measured and stored at a site.

    ``rows`` holds one test report per row (``uncalibrated``, ``reference_<name>``, each local calibrator,
    ``prior``, ``em``): :func:`~lungcal.calibration.metrics.calibration_report` plus ``ece_pvalue``.
    ``before``, ``reference`` and ``after`` are the rows of the uncalibrated network, the model as shipped
    and the chosen calibrator. ``warnings`` maps a row to why its fit is "no signal".
    """

    rows: dict[str, dict[str, Any]]
    chosen: str
    chosen_row: str
    calibrator: Any
    method: str
    warnings: dict[str, list[str]]
    few_events: bool
    n_events: int
    cv_nll: dict[str, float] | None
    priors: dict[str, Any]
    shipped: str
    before: dict[str, Any]
    reference: dict[str, Any] | None
    after: dict[str, Any]
    temperature: float | None
    reference_temperature: float | None
    parent_run: str | None
    stage1: str
    site: str
    n_val: int
    n_test: int
    tracking_uri: str
    qc_skipped: dict[str, int]
    run_id: str | None = None
    #: the guaranteed decision threshold (``--miss-rate``), fitted on val, with its test numbers
    threshold: SiteThreshold | None = None
    #: the site check of a label-free route (:func:`guard_label_free`): ``verdict`` (or ``unchecked``),
    #: ``run`` (its MLflow run id or None), ``forced`` (the overridden verdict, or None); None without one
    site_check: dict[str, Any] | None = None
    #: the chosen calibrator's decision curve on the test split (net benefit against treating all and none)
    decision: DecisionCurve | None = None
    #: with a threshold: work-up rate, sensitivity and O/E on the test split by scanner, nodule type and size
    #: (:mod:`lungcal.ctapp.site.subgroups`)
    subgroups: list[dict[str, Any]] | None = None


def _test_groups(test: Mapping[str, Any], rows: list[dict], datalist: Path) -> dict[str, list[str]]:
    """The subgroups of the scored test CTs (the rows :func:`score_rows` scored, in its order); one ``unknown``
    group when the scores carry no rows to match (a scorer that returns none)."""
    scored = test.get("rows") or rows
    n = len(test["labels"])
    if len(scored) != n:
        return {"scanner": ["unknown"] * n, "nodule type": ["unknown"] * n, "nodule size": ["unknown"] * n}
    return ct_groups(scored, datalist)


def _curve_grid(mark: float | None) -> list[float]:
    """The decision curve's threshold probabilities: 1-50 %, and the site's threshold when it has one."""
    grid = set(DEFAULT_THRESHOLDS)
    if mark is not None and 0.0 < mark < 1.0:
        grid.add(float(mark))
    return sorted(grid)


def _valid_routes(model: str, datalist: Path) -> str:
    """The routes a ``scanner_shift`` verdict leaves, as one clause."""
    return "; ".join(r.format(run=model, site=datalist) for r, _ in ROUTES[SCANNER_SHIFT]
                     if not r.startswith("not valid"))


def guard_label_free(stage1, datalist: Path, path: Path, scored: list[Mapping[str, Any]],
                     stats: Sequence[AcquisitionStats | None], *, force: bool, route: str, tracking_uri: str,
                     out_dir: Path, qc_skipped: int = 0, what: str = "val and test") -> dict[str, Any]:
    """The site check of CTs this recalibration has screened and scored itself (``scored``: the outputs of
    :func:`score_rows`, one per group, concatenated in order; ``stats``: their acquisition statistics), before a
    label-free route (module doc): the datalist's val and test CTs, or the ``--unlabelled`` CTs (``what`` names
    them, ``path`` is where they came from). Each CT is screened and scored once
    (:func:`~lungcal.ctapp.site.site_check.check_scored`), the check logged as its own MLflow run.

    Returns ``{"verdict", "run", "forced"}``; raises ConfigError (exit code 2) on ``scanner_shift`` or when
    no check can run, unless ``force``.
    """
    try:
        scores = np.concatenate([binary_scores(sc["logits"]) for sc in scored])
        feats = [sc.get("features") for sc in scored]
        features = None if any(f is None for f in feats) else np.concatenate([flat_features(f) for f in feats])
        res = check_scored(stage1, scores, features, stats, tracking_uri=tracking_uri, output_dir=out_dir,
                           path=path, qc_skipped=qc_skipped, log=True)
    except (DataError, ConfigError) as exc:
        if not force:
            raise ConfigError(f"{route} needs a site check first, and it could not run: {exc.message.rstrip('.')}; "
                              "a prior adjustment is valid only where the images did not change, which only a site "
                              "check can show", field=route,
                              fix=f"give the {what} CTs at least {MIN_SITE_CTS} that pass the series "
                                  f"checks, or recalibrate on the site's labels (drop {route}), or add --force to "
                                  f"run it unchecked (the run is then tagged {TAG_FORCED}={UNCHECKED})") from None
        print(f"  WARNING --force: {route} runs without a site check ({exc.message.rstrip('.')}); the run is tagged "
              f"{TAG_FORCED}={UNCHECKED}", flush=True)
        return {"verdict": UNCHECKED, "run": None, "forced": UNCHECKED}
    model = stage1.run.info.run_id if stage1.run is not None else stage1.run_id
    reason = res.reasons[0] if res.reasons else "see the site check's run"
    if res.verdict == SCANNER_SHIFT:
        if not force:
            raise ConfigError(f"{route} refused: site check verdict {SCANNER_SHIFT} ({reason}); a prior adjustment "
                              "assumes the images did not change. Valid routes: "
                              f"{_valid_routes(res.model or model, datalist)}", field=route,
                              fix=f"take one of those routes (the check is MLflow run {res.run_id}), or add --force "
                                  f"to run it anyway (the run is then tagged {TAG_FORCED}={SCANNER_SHIFT})")
        print(f"  WARNING --force: site check verdict {SCANNER_SHIFT} ({reason}) overridden: {route} is not valid "
              f"under a scanner change; the run is tagged {TAG_FORCED}={SCANNER_SHIFT} (check: run {res.run_id})",
              flush=True)
        return {"verdict": res.verdict, "run": res.run_id, "forced": SCANNER_SHIFT}
    print(f"  site check    {res.verdict} on {res.n} {what} CTs (run {res.run_id}): {route} is valid here",
          flush=True)
    return {"verdict": res.verdict, "run": res.run_id, "forced": None}


def recalibrate(model: str, datalist: str | Path, *, method: str = "auto", prevalence: float | str | None = None,
                unlabelled: str | Path | None = None, source_prevalence: float | str | None = None,
                site: str | None = None, experiment: str = CT_EXPERIMENT, n_bins: int = 10, n_bootstrap: int = 1000,
                seed: int = 0, tracking_uri: str | None = None, output_dir: str | Path | None = None,
                num_workers: int = 0, qc: QCConfig | None = DEFAULT_QC, log: bool = True,
                miss_rate: float | str | None = None, confidence: float | str | None = None,
                guarantee: str | None = None, certify_split: str | None = None,
                force: bool = False) -> Recalibration:
    """Fit recalibrators on a site's validation split and evaluate each on its test split.

    Args:
        model: a stage-1 MLflow run id (in ``tracking_uri``) or a stage-1 checkpoint file.
        datalist: the site's datalist JSON (rows with ``val`` and ``test`` splits; train is unused).
        method: one of :data:`METHODS` (default ``auto``). ``prior`` stores the prior adjustment
            (``--prevalence``, else the EM estimate of ``--unlabelled``) as the site's calibrator.
        prevalence: the site's known prevalence, in (0, 1): adds the ``prior`` row.
        unlabelled: a datalist or folder of site CTs without outcomes: adds the ``em`` row.
        source_prevalence: the prevalence the shipped model is calibrated to (default: read from
            the stage-1 run, see the module doc).
        site: value of the ``lungcal.site`` tag (default: the datalist rows' ``site``).
        experiment, n_bins, n_bootstrap, seed, tracking_uri, output_dir, num_workers: as before.
        qc: series-check thresholds (default: the bundles' defaults); a site CT that fails one is
            left out of val, test and the unlabelled CTs (counts in ``qc_skipped``); ``None`` skips
            the checks.
        log: record an MLflow run.
        miss_rate: the missed-cancer rate allowed (alpha, in (0, 1)): adds the decision threshold chosen on
            the val split's probabilities of the chosen calibrator (:mod:`lungcal.ctapp.site.threshold`).
        confidence: the probability (1 - delta) that the guarantee holds over the val draw (default 0.9;
            only with ``miss_rate``, not with ``guarantee="crc"``).
        guarantee: ``ltt`` (default: with probability 1 - delta) or ``crc`` (conformal risk control: on average
            over draws); only with ``miss_rate``.
        certify_split: the split the threshold is chosen on, ``val`` (default) or ``test`` (the way out when the
            model's checkpoint was chosen on val: :mod:`lungcal.ctapp.site.certify_split`); only with
            ``miss_rate``.
        force: go on with ``prevalence`` / ``unlabelled`` although the site check found ``scanner_shift`` or
            could not run (module doc); the run is tagged ``lungcal.forced_past_site_check``.

    Returns:
        a :class:`Recalibration` (``run_id`` set when ``log``).
    """
    # every check before any work, and before the run is opened
    method = check_method(method)
    prevalence = check_prevalence(prevalence) if prevalence is not None else None
    source_prevalence = (check_prevalence(source_prevalence, "--source-prevalence")
                         if source_prevalence is not None else None)
    for flag, value in (("--confidence", confidence), ("--guarantee", guarantee), ("--certify-split", certify_split)):
        if value is not None and miss_rate is None:
            raise ConfigError(f"{flag} belongs to the --miss-rate guarantee", field=flag,
                              fix=f"add --miss-rate ALPHA (e.g. 0.05), or drop {flag}")
    kind = guarantee or "ltt"
    levels = check_levels(miss_rate, confidence, kind) if miss_rate is not None else None
    cert = check_certify_split(certify_split or "val")
    if method == PRIOR and prevalence is None and unlabelled is None:
        raise ConfigError("--method prior needs the site's prevalence", field="--method",
                          fix="add --prevalence P (known) or --unlabelled DATALIST (estimated by EM)")
    datalist = Path(datalist).expanduser()
    if not datalist.is_file():
        raise DataError("datalist not found", file=datalist, field="--datalist",
                        fix="create it with `lungcal import-site`, then run `lungcal check-data`")
    val_rows, test_rows, site_from_rows = _site_rows(datalist)
    if levels is not None:  # too few cancers for the guarantee: refused before anything is loaded
        check_cancers(test_rows if cert == "test" else val_rows, *levels, datalist, kind, cert)
    unl_rows = unlabelled_rows(unlabelled) if unlabelled is not None else None
    out_dir = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    uri = tracking_uri or default_tracking_uri(out_dir)
    stage1 = load_stage1(str(model), uri, field="--model")
    net, run, bag_params = stage1.network, stage1.run, stage1.bag_params
    ref_run = linked_calibrator_run(uri, run) if run is not None else None
    # a certify split whose CTs trained the model or chose its checkpoint is refused before anything is scored
    certified = (certify_check(stage1, test_rows if cert == "test" else val_rows, cert, datalist, uri)
                 if levels is not None else None)
    source = None
    checked = None
    label_free = prevalence is not None or unl_rows is not None
    if label_free:  # before any CT is screened: a run without a source prior is refused at once
        source = _source_prior(uri, stage1, ref_run, source_prevalence)
    ref_cal = reference_calibrator(uri, run) if run is not None else None
    ref_name = getattr(ref_cal, "name", None)
    site = site or site_from_rows
    cache = out_dir / "cache" / "bags"
    skipped = {}
    val_rows, skipped["val"], val_acq = _screen(val_rows, bag_params, qc, out_dir, num_workers, "val")
    test_rows, skipped["test"], test_acq = _screen(test_rows, bag_params, qc, out_dir, num_workers, "test")
    _site_labels(val_rows, test_rows, datalist)
    if levels is not None:  # and again once the series checks have left CTs out, before any bag is scored
        check_cancers(test_rows if cert == "test" else val_rows, *levels, datalist, kind, cert)
    val, test = (score_rows(net, r, bag_params, None, cache_dir=cache, num_workers=num_workers)
                 for r in (val_rows, test_rows))
    if label_free:  # the site check on the CTs just scored (each CT is screened and scored once)
        route = "--prevalence" if prevalence is not None else "--unlabelled"
        checked = guard_label_free(stage1, datalist, datalist, [val, test],
                                   _check_stats(val_rows + test_rows, val_acq + test_acq, qc, out_dir, num_workers),
                                   force=force, route=route, tracking_uri=uri, out_dir=out_dir,
                                   qc_skipped=len(skipped["val"]) + len(skipped["test"]))
    unl = None
    if unl_rows is not None:  # EM runs on the unlabelled CTs: they are checked themselves, not only val and test
        assert checked is not None and unlabelled is not None
        unl_rows, skipped["unlabelled"], unl_acq = _screen(unl_rows, bag_params, qc, out_dir, num_workers,
                                                           "unlabelled")
        unl = score_rows(net, unl_rows, bag_params, None, cache_dir=cache, num_workers=num_workers)
        unl_checked = guard_label_free(stage1, datalist, Path(unlabelled).expanduser(), [unl],
                                       _check_stats(unl_rows, unl_acq, qc, out_dir, num_workers),
                                       force=force, route="--unlabelled", tracking_uri=uri, out_dir=out_dir,
                                       qc_skipped=len(skipped["unlabelled"]), what="unlabelled")
        checked["unlabelled"] = unl_checked
        checked["forced"] = checked["forced"] or unl_checked["forced"]

    chosen_local, fitted, cv_nll = _fit_local(method, val, seed)
    probs: dict[str, np.ndarray] = {"uncalibrated": probabilities(test["logits"])}
    shipped_key = "uncalibrated"
    if ref_cal is not None:
        shipped_key = f"reference_{ref_name}"
        probs[shipped_key] = calibrated_probs(ref_cal, test["logits"])
    for name, cal in fitted.items():
        probs[name] = calibrated_probs(cal, test["logits"])
    priors: dict[str, Any] = {}
    stored: dict[str, Any] = dict(fitted)
    if source is not None:
        priors.update(source_prior=source[0], source=source[1])
    if prevalence is not None:
        assert source is not None  # looked up above when a prevalence is given
        priors["site_prior"] = prevalence
        stored["prior"] = PriorAdjusted(ref_cal, source[0], prevalence, "given")
        probs["prior"] = adjust_to_prior(probs[shipped_key], source[0], prevalence)
    if unl is not None:
        assert source is not None and unl_rows is not None  # both come with the unlabelled CTs
        em = estimate_prior_em(calibrated_probs(ref_cal, unl["logits"]), source[0])
        priors.update(em_prior=em, n_unlabelled=len(unl_rows))
        stored["em"] = PriorAdjusted(ref_cal, source[0], em, "em")
        probs["em"] = adjust_to_prior(probs[shipped_key], source[0], em)
    # no local method (only with --method prior): the prior row
    chosen_row = chosen_local if chosen_local is not None else ("prior" if prevalence is not None else "em")
    chosen_cal = stored[chosen_row]
    threshold = None
    if levels is not None and certified is not None:  # fitted on the certify split only; test reports what it does
        fit = test if cert == "test" else val
        threshold = site_threshold(calibrated_probs(chosen_cal, fit["logits"]), np.asarray(fit["labels"]),
                                   None if cert == "test" else probs[chosen_row],
                                   None if cert == "test" else np.asarray(test["labels"]), *levels,
                                   guarantee=kind, fit_split=cert, certify_note=certified.note,
                                   certify_checked=certified.checked)

    rows = {}
    for key, p in probs.items():
        rep = evaluate_probs(p, test["labels"], n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
        rep["ece_pvalue"] = ece_consistency_pvalue(p, test["labels"], n_bins=n_bins, seed=seed)[1]
        rows[key] = rep
    warnings = {n: fit_warnings(c, val["logits"], val["labels"]) for n, c in fitted.items()}
    flags = {n: no_signal(w) for n, w in warnings.items() if no_signal(w)}
    if "em_prior" in priors and not EM_BOUND < priors["em_prior"] < 1 - EM_BOUND:
        flags["em"] = [f"EM prevalence estimate {priors['em_prior']:.3f} at its bound: the shipped probabilities are "
                       "far from calibrated on these CTs (a scanner or case-mix shift, not only a change of "
                       "prevalence), so a prior adjustment does not apply: no signal"]
    n_events = int(min(int((val["labels"] == 1).sum()), int((val["labels"] == 0).sum())))
    temp = float(chosen_cal.temperature) if getattr(chosen_cal, "name", "") == "ts" else None
    ref_temp = float(ref_cal.temperature) if ref_cal is not None and getattr(ref_cal, "name", "") == "ts" else None
    parent = stage1.run_id
    stage1_name = stage1.stage1_name(TAG_STAGE1)
    result = Recalibration(
        rows=rows, chosen=chosen_cal.name, chosen_row=chosen_row, calibrator=chosen_cal, method=method,
        warnings=flags, few_events=n_events < FEW_EVENTS, n_events=n_events, cv_nll=cv_nll, priors=priors,
        shipped=shipped_key, before=rows["uncalibrated"],
        reference=rows.get(shipped_key) if shipped_key != "uncalibrated" else None, after=rows[chosen_row],
        temperature=temp, reference_temperature=ref_temp, parent_run=parent, stage1=stage1_name, site=site,
        n_val=len(val_rows), n_test=len(test_rows), tracking_uri=uri,
        qc_skipped={k: len(v) for k, v in skipped.items()}, threshold=threshold, site_check=checked,
        decision=decision_curve(probs[chosen_row], np.asarray(test["labels"]),
                                _curve_grid(None if threshold is None else threshold.guarantee.threshold)),
        subgroups=None if threshold is None else subgroup_rows(
            probs[chosen_row][:, 1], np.asarray(test["labels"]), _test_groups(test, test_rows, datalist),
            threshold.guarantee.threshold, n_bootstrap=n_bootstrap, seed=seed))
    if not log:
        return result
    _log_run(result, probs, test, val, datalist, bag_params, experiment, out_dir, n_bins, n_bootstrap, val_acq)
    return result


def _log_run(res: Recalibration, probs: Mapping[str, np.ndarray], test, val, datalist: Path, bag_params,
             experiment: str, out_dir: Path, n_bins: int, n_bootstrap: int,
             val_acq: Sequence[AcquisitionStats | None] = ()) -> None:
    chosen, site, stage1_name, parent = res.chosen_row, res.site, res.stage1, res.parent_run
    cal = res.calibrator
    source = manifest_source(datalist)
    tags = {TAG_DATASET: source, TAG_STAGE1: stage1_name, TAG_STAGE2: cal.name, TAG_CALIBRATOR: cal.name,
            TAG_SITE: site, TAG_RECALIBRATION: "local"}
    flags = res.warnings.get(chosen, [])
    if flags:
        tags[TAG_FIT_WARNING] = "; ".join(flags)
    if res.site_check is not None and res.site_check["forced"]:
        tags[TAG_FORCED] = res.site_check["forced"]
    name = f"{stage1_name}+{cal.name}@{site}-{time.strftime('%Y%m%d-%H%M%S')}"
    with RunTracker(experiment, name, tracking_uri=res.tracking_uri, tags=tags, parent_run_id=parent) as tr:
        params = {"stage2": cal.name, "method": res.method, "chosen": chosen, "fit_split": "val",
                  "model": parent or "checkpoint", "site": site,
                  "datalist": {"source": source, "sha256": file_digest(datalist)},
                  "n_val": res.n_val, "n_test": res.n_test, "qc_skipped": res.qc_skipped,
                  "n_bins": n_bins, "n_bootstrap": n_bootstrap,
                  "bag_params": bag_params, "retrained": False, "rows": list(probs)}
        if res.priors.get("source"):
            params["source_prior_from"] = res.priors["source"]
        if res.threshold is not None:
            g = res.threshold.guarantee
            params.update(miss_rate=g.alpha, guarantee=g.guarantee, certify_split=res.threshold.fit_split,
                          threshold_method=g.method)
            if g.delta is not None:  # conformal risk control states none
                params["confidence"] = 1 - g.delta
        if res.site_check is not None:  # what predict --site reads before applying a prior adjustment
            params[SITE_CHECK_PARAM] = res.site_check["verdict"]
            params[SITE_CHECK_RUN_PARAM] = res.site_check["run"] or "none"
            unl = res.site_check.get("unlabelled")
            if unl is not None:  # the --unlabelled CTs' own check
                params[f"{SITE_CHECK_PARAM}_unlabelled"] = unl["verdict"]
                params[f"{SITE_CHECK_RUN_PARAM}_unlabelled"] = unl["run"] or "none"
        tr.log_params(params)
        tr.log_dict({**params, "cv_nll": res.cv_nll, "warnings": res.warnings}, "config/resolved.json")
        metrics = {k: v for k, v in res.priors.items() if isinstance(v, (int, float))}
        metrics["val/n_events"] = res.n_events
        metrics[REFERRAL_METRIC] = referral_threshold(calibrated_probs(cal, val["logits"]))  # inference's rule
        if res.threshold is not None:
            metrics.update(res.threshold.metrics())
        if res.temperature is not None:
            metrics["temperature"] = res.temperature
        if res.reference_temperature is not None:
            metrics["reference_temperature"] = res.reference_temperature
        for n, v in (res.cv_nll or {}).items():
            metrics[f"val/cv_nll_{n}"] = v
        tr.log_metrics(metrics)
        work = out_dir / "recalibration" / tr.run_id
        for key, p in probs.items():
            split = "test" if key == chosen else f"test_{key}"
            full = key in (chosen, "uncalibrated")
            log_split(tr, split, p, test["labels"], res.rows[key], n_bins=n_bins,
                      subjects=test["subjects"] if full else None, attention=test["attention"] if full else None,
                      workdir=work, title=f"{stage1_name}+{key} @ {site}")
        # the site's calibration CTs, as a stage-1 run logs its own: they join the range predict --site flags
        # a CT against (lungcal.ctapp.infer.ood.TrainingRange.joined)
        if any(a is not None for a in val_acq):
            tr.log_dict(summarize_acquisitions(list(val_acq)), ACQUISITION_ARTIFACT)
        if val.get("features") is not None:
            log_site_reference(tr, val["logits"], val["labels"], val["features"], work)
        if res.subgroups is not None:
            tr.log_dict({"split": "test", "threshold": res.threshold.guarantee.threshold if res.threshold else None,
                         "rows": res.subgroups}, "data/test_subgroups.json")
        if res.decision is not None:  # the test split's decision curve, marked at the site's threshold
            mark = res.threshold.guarantee.threshold if res.threshold is not None else None
            fig = decision_curve_plot(curve=res.decision, mark=mark,  # the curve the run logs, not a second one
                                      title=f"{stage1_name}+{chosen} @ {site}: decision curve (test)")
            tr.log_figure(fig, plot_artifact("test", "decision_curve"))
            tr.log_dict(res.decision.as_dict(), "data/test_decision_curve.json")
            if mark is not None and 0.0 < mark < 1.0:
                at = res.decision.at(mark)
                tr.log_metrics({"test/net_benefit_at_threshold": at["model"],
                                "test/net_benefit_treat_all_at_threshold": at["treat_all"]})
        state = atomic_write_text(work / f"{cal.name}.json", cal.to_json())
        tr.log_artifact(state, CALIBRATOR_DIR)  # calibrator_artifact(cal.name)
        if res.threshold is not None:
            tr.log_dict(res.threshold.as_dict(), GUARANTEE_ARTIFACT)
        res.run_id = tr.run_id
