"""``lungcal monitor``: a site after go-live, chunk by chunk (a month, or N CTs), with and without labels.

Input: a datalist of the site's CTs, each row with ``image``, its acquisition date in ``study_date``
(:data:`lungcal.ctapp.site.monitoring.DATE_COLUMN`: ``YYYY-MM-DD`` or DICOM's ``YYYYMMDD``; ``lungcal import-site``
copies the site CSV's ``study_date`` column) and, where it has arrived, its ``label`` (0 or
1; anything else, or none, is "not yet"). The model is a stage-1 run; the site is the one ``lungcal recalibrate``
fitted (``--site``, default the rows' ``site``): its calibrator, its threshold and the sensitivity its guarantee
promises (``--miss-rate``: ``1 - miss rate``), and its calibration CTs (scores, embeddings, acquisition) as the
reference, found as ``lungcal predict --site`` finds them.

Each CT is checked (series checks), scored with the model and the site's calibrator, and placed against the training
data joined with the site's calibration CTs (:class:`lungcal.ctapp.infer.ood.TrainingRange`). The CTs are grouped
into chunks by date, and each chunk gets the statistics of :mod:`lungcal.ctapp.site.monitoring` and the alerts of
its rule. Bad input never stops the pass: a row without a date, with a date in an unknown format, whose image is
missing or that fails a series check, and a chunk too small to say anything, is reported in one line (the row's
number, the chunk's ordinal) and left out; the other chunks go on.

One MLflow run per pass (tag ``lungcal.monitor`` = ``alert`` or ``quiet``, ``lungcal.monitor_alerts`` the alerts by
chunk ordinal, linked to the model's run): each chunk's statistics as metrics ``monitor/...`` at step = its ordinal,
``monitor.json`` and ``plots/monitor.png`` (each statistic against the chunk, the alerts marked). ``--json`` writes
the same JSON.

**Privacy.** Dates are patient identifiers: they are read from the datalist to group the rows and go nowhere else.
Everything printed, logged or written names a chunk by its ordinal and its offset from the first (``month +3``,
``CTs 101-200 in date order``), and a row by its number; no date reaches a param, tag, metric, artifact or file
name (``tests/ctapp/test_monitor.py`` checks it).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient
from tqdm.auto import tqdm

from lungcal.calibration.scaling import calibrated_probs
from lungcal.candidates.cache import BagParams, masker_from_config
from lungcal.ct.qc import QCConfig
from lungcal.ctapp.data.inputs import CT_SUFFIXES
from lungcal.ctapp.data.series_qc import acquisitions, log_warnings, screen
from lungcal.ctapp.evaluate.calibrators import site_calibrator, site_guarantee
from lungcal.ctapp.evaluate.reports import binary_scores, flat_features
from lungcal.ctapp.evaluate.site_assessment import Reference, acquisition_checks
from lungcal.ctapp.infer.ood import TrainingRange
from lungcal.ctapp.infer.scoring import score_rows
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.ctapp.site.monitoring import (
    DATE_COLUMN,
    MIN_CHUNK_CTS,
    MONTH,
    AlertRule,
    Chunk,
    chunk_statistics,
    dated_rows,
    false_alarm_rate,
    make_chunks,
    parse_chunk,
    reference_splits,
    run_alerts,
)
from lungcal.ctapp.site.site_check import json_ready
from lungcal.errors import ConfigError, DataError
from lungcal.paths import atomic_write_text, default_output_dir
from lungcal.tracking import (
    CT_EXPERIMENT,
    MONITOR_ARTIFACT,
    TAG_DATASET,
    TAG_MONITOR,
    TAG_MONITOR_ALERTS,
    TAG_SITE,
    TAG_STAGE1,
    RunTracker,
    default_tracking_uri,
    linked_calibrator_run,
    run_acquisition_summary,
    run_site_reference,
)

__all__ = ["Monitoring", "monitor", "format_report", "read_monitor_rows"]

_FIX = "pass a datalist JSON whose rows have 'image' and 'study_date' (and 'label' where it has arrived)"


@dataclass
class Monitoring:
    """What a monitoring pass found: the chunks (ordinal, name, n, statistics, alerts), the rule, the problems
    (one line each), and where it was stored."""

    site: str
    model: str
    site_run: str
    chunking: str
    threshold: float | None
    rule: AlertRule
    chunks: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)
    n_rows: int = 0
    false_alarms: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    run_id: str | None = None
    json_path: str | None = None

    @property
    def alerts(self) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
        """``(chunk, alert)`` of every alert, in chunk order."""
        return [(c, a) for c in self.chunks for a in c["alerts"]]

    def alert_tag(self) -> str:
        return "; ".join(f"chunk {c['chunk']}: {a['kind']}" for c, a in self.alerts) or "none"

    def as_dict(self) -> dict[str, Any]:
        return json_ready({"site": self.site, "model": self.model, "site_run": self.site_run,
                           "chunking": self.chunking, "threshold": self.threshold, "rule": self.rule.as_dict(),
                           "rule_text": self.rule.describe(), "bound": self.rule.bound(), "n_rows": self.n_rows,
                           "chunks": self.chunks, "problems": self.problems, "false_alarms": self.false_alarms,
                           "notes": self.notes, "run_id": self.run_id})


def _label(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1) else -1


def read_monitor_rows(path: str | Path) -> tuple[list[dict[str, Any]], list[str], int]:
    """The datalist's rows (``image`` resolved, ``label`` 0/1 or -1 for not yet, ``study_date`` kept, ``subject``
    positional, ``row`` its number), one line per row left out for a missing image, and the number of rows. Raises
    a DataError for a file that is not a datalist."""
    path = Path(path).expanduser()
    if not path.is_file() or path.name.lower().endswith(CT_SUFFIXES):
        raise DataError("not a datalist JSON", file=path, field="DATALIST", fix=_FIX)
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"not valid JSON ({exc.__class__.__name__})", file=path, field="DATALIST", fix=_FIX) from None
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise DataError("the datalist has no rows", file=path, field="rows", fix=_FIX)
    out, problems = [], []
    for i, r in enumerate(rows):
        image = r.get("image") if isinstance(r, dict) else None
        if not image:
            problems.append(f"row {i}: no image: left out")
            continue
        p = Path(str(image)).expanduser()
        p = p if p.is_absolute() else path.parent.absolute() / p
        if not p.exists():
            problems.append(f"row {i}: image not found: left out")
            continue
        out.append({"image": str(p), "label": _label(r.get("label")), "subject": f"m{i:05d}", "row": i,
                    "site": str(r.get("site") or ""), "split": "test", DATE_COLUMN: r.get(DATE_COLUMN)})
    return out, problems, len(rows)


def _site_name(rows: Sequence[Mapping[str, Any]], site: str | None) -> str:
    if site:
        return str(site)
    names = sorted({str(r["site"]) for r in rows if r.get("site")})
    if len(names) != 1:
        raise ConfigError(f"the datalist names {len(names)} sites ({', '.join(names) or 'none'})", field="--site",
                          fix="pass --site NAME: the site `lungcal recalibrate` was run for")
    return names[0]


def _reference(uri: str, run_id: str, source: str) -> Reference | None:
    stored = run_site_reference(uri, run_id)
    if stored is None or stored.get("scores") is None or stored.get("labels") is None:
        return None
    return Reference(np.asarray(stored["scores"], float), np.asarray(stored["labels"]).astype(int),
                     None if stored.get("features") is None else flat_features(stored["features"]), source)


def monitor(run: str, datalist: str | Path, *, site: str | None = None, chunk: str | int = MONTH,
            json_path: str | Path | None = None, alpha: float = 0.05, threshold: float | None = None,
            promise: float | None = None, tracking_uri: str | None = None, output_dir: str | Path | None = None,
            qc: QCConfig | None = None, num_workers: int = 0, n_resamples: int = 1000, n_subsamples: int = 20,
            n_bootstrap: int = 1000, false_alarm_years: int = 0, seed: int = 0, log: bool = True) -> Monitoring:
    """Monitor a site's CTs chunk by chunk (module doc).

    Args:
        run: the stage-1 MLflow run id.
        datalist: the site's datalist with ``study_date`` per row (labels optional).
        site: the site ``lungcal recalibrate`` was run for (default: the rows' ``site``).
        chunk: ``"month"`` or a number of CTs per chunk.
        alpha: the rule's false-alarm rate of a scanner alert over a year (per chunk: alpha / 12).
        threshold / promise: the decision threshold and the promised sensitivity (default: the site's stored
            guarantee: its threshold and ``1 - miss rate``).
        qc: series-check thresholds (default: the bundles'); a CT that fails one is left out and reported.
        false_alarm_years: also measure the rule's false-alarm rate over that many simulated stable years, chunks
            drawn from the site's calibration CTs, each year a fresh random split of them into reference and pool
            (0: not measured in this pass; the bound is stated).

    Raises:
        ConfigError: an unknown run, a run that is a checkpoint, a site without a recalibration run.
        DataError: a file that is not a datalist, or no row left with a date.
    """
    chunking = parse_chunk(chunk)
    rows, problems, n_rows = read_monitor_rows(datalist)
    out_dir = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    uri = tracking_uri or default_tracking_uri(out_dir)
    stage1 = load_stage1(str(run), uri, field="--run")
    if stage1.run is None:
        raise ConfigError("monitoring needs the model as an MLflow run", field="--run",
                          fix="pass the stage-1 run id, not a checkpoint file")
    site = _site_name(rows, site)
    site_run = linked_calibrator_run(uri, stage1.run, site=site)
    if site_run is None:
        raise ConfigError(f"run {stage1.run_id} has no finished run recalibrated at site {site!r}", field="--site",
                          fix=f"run `lungcal recalibrate --model {stage1.run_id} --datalist <site.json> --miss-rate "
                              "ALPHA` first: monitoring compares each chunk with the site's calibration CTs")
    cal = site_calibrator(uri, stage1.run, site)
    guarantee = site_guarantee(uri, stage1.run, site)
    notes = []
    if threshold is None and guarantee is not None:
        threshold = guarantee.threshold
    if promise is None and guarantee is not None:
        promise = 1.0 - guarantee.alpha
    if threshold is None:
        notes.append(f"site {site}'s recalibration stored no threshold (--miss-rate) and none was given "
                     "(--threshold): no work-up rate or sensitivity")
    if promise is None:
        notes.append("no promised sensitivity (a --miss-rate guarantee, or --promise): no sensitivity alert")
    rule = AlertRule(alpha_year=float(alpha), promise=promise)

    dated, bad_dates = dated_rows(rows)
    problems += [_row_line(rows, line) for line in bad_dates]
    if not dated:
        raise DataError(f"no row has a usable {DATE_COLUMN}", file=datalist, field=DATE_COLUMN,
                        fix="fill it (YYYY-MM-DD) from the DICOM StudyDate or the site's records")
    kept_rows = [rows[i] for i, _ in dated]
    stored_masker = BagParams.from_any(stage1.bag_params).preprocess.get("masker")
    reports = screen(kept_rows, qc or QCConfig(), out_dir / "cache" / "qc", num_workers=num_workers,
                     masker=masker_from_config(stored_masker) if stored_masker else None)
    log_warnings(kept_rows, reports)
    passing = [k for k, rep in enumerate(reports) if rep is None or not rep.failed]
    for k, rep in enumerate(reports):
        if rep is not None and rep.failed:
            problems.append(f"row {kept_rows[k]['row']}: series check '{rep.failed[0].name}' failed: left out")
    if not passing:
        raise DataError(f"no CT passes the series checks ({len(kept_rows)} dated rows)", file=datalist,
                        fix="run `lungcal qc` on the site's CTs to see why")
    scored_rows = [kept_rows[k] for k in passing]
    sc = score_rows(stage1.network, scored_rows, stage1.bag_params, cal, cache_dir=out_dir / "cache" / "bags",
                    num_workers=num_workers)
    scores = binary_scores(sc["logits"])
    p1 = np.asarray(sc["probs"])[:, 1]
    feats = None if sc.get("features") is None else flat_features(sc["features"])
    stats = acquisitions([reports[k] for k in passing])
    labels = np.array([r["label"] for r in scored_rows])
    training_range = TrainingRange.from_run(uri, stage1.run, site_run, site)
    flagged = [training_range.block(stats[j], None if feats is None else feats[j]) for j in range(len(scored_rows))]
    flags = [bool(b["flagged"]) if any(b["checked"].values()) else None for b in flagged]

    site_ref = _reference(uri, site_run.info.run_id, f"site {site}'s calibration CTs")
    training_ref = _reference(uri, stage1.run.info.run_id, "the model's validation split")
    site_summary = run_acquisition_summary(uri, site_run.info.run_id)
    training_summary = run_acquisition_summary(uri, stage1.run.info.run_id)
    dates = [dated[k][1] for k in passing]
    chunks = make_chunks(dates, chunking)
    chunk_stats: list[dict[str, Any] | None] = []
    for c in tqdm(chunks, desc="chunks", unit="chunk", disable=len(chunks) < 2):
        if c.n < MIN_CHUNK_CTS:
            problems.append(f"{c.label()}: {c.n} CTs, too few to say anything (a chunk needs {MIN_CHUNK_CTS}): "
                            "skipped")
            chunk_stats.append(None)
            continue
        m = np.asarray(c.members)
        st = [stats[j] for j in c.members]
        chunk_stats.append(chunk_statistics(
            scores[m], p1[m], threshold=threshold, rule=rule, site=site_ref, training=training_ref,
            features=None if feats is None else feats[m], site_acquisition=acquisition_checks(site_summary, st),
            training_acquisition=acquisition_checks(training_summary, st), labels=labels[m],
            flagged=[flags[j] for j in c.members], n_resamples=n_resamples, n_subsamples=n_subsamples,
            n_bootstrap=n_bootstrap, seed=seed + c.ordinal))
    alerts = run_alerts(chunk_stats, rule)
    out_chunks = [_chunk_record(c, s, a) for c, s, a in zip(chunks, chunk_stats, alerts)]
    false_alarms = None
    if false_alarm_years > 0 and site_ref is not None:
        sizes = [c.n for c in chunks if c.n >= MIN_CHUNK_CTS]
        ref_p1 = calibrated_probs(cal, np.stack([np.zeros_like(site_ref.scores), site_ref.scores], 1))[:, 1]
        false_alarms = false_alarm_rate(reference_splits(site_ref, ref_p1), None, rule, threshold=threshold,
                                        n_per_chunk=int(np.median(sizes)) if sizes else MIN_CHUNK_CTS,
                                        n_years=int(false_alarm_years), n_subsamples=n_subsamples, seed=seed)
    res = Monitoring(site=site, model=stage1.run.info.run_id, site_run=site_run.info.run_id,
                     chunking=MONTH if chunking == MONTH else f"{chunking} CTs", threshold=threshold, rule=rule,
                     chunks=out_chunks, problems=problems, n_rows=n_rows, false_alarms=false_alarms, notes=notes)
    target = Path(json_path).expanduser() if json_path is not None else None
    if log:
        _log_run(res, uri, stage1.run, stage1.stage1_name(TAG_STAGE1))
    if target is not None:
        res.json_path = str(target)
        atomic_write_text(target, json.dumps(res.as_dict(), indent=2) + "\n")
    return res


def _row_line(rows: Sequence[Mapping[str, Any]], line: str) -> str:
    """A :func:`dated_rows` line renumbered to the datalist's own row (``row k`` of the rows read -> its index)."""
    head, _, rest = line.partition(":")
    k = int(head.split()[1])
    return f"row {rows[k]['row']}:{rest}"


def _chunk_record(c: Chunk, stats: Mapping[str, Any] | None, alerts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"chunk": c.ordinal, "name": c.name, "n": c.n, "skipped": stats is None,
            "stats": None if stats is None else dict(stats), "alerts": alerts}


def _metrics(chunk: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one chunk to log at step = its ordinal."""
    s = chunk["stats"]
    out: dict[str, Any] = {"monitor/n": chunk["n"], "monitor/alert": float(bool(chunk["alerts"])),
                           "monitor/ood_share": s["ood"]["share"]}
    for name, check in (("site", s["site_check"]), ("training", s["training_check"])):
        if check.get("verdict") is None:
            continue
        out[f"monitor/{name}_comparable"] = float(check["verdict"] == "comparable")
        out[f"monitor/{name}_prevalence"] = check["prevalence"]
        for k, t in check["tests"].items():
            out[f"monitor/{name}_{k}_p"] = t["pvalue"]
        if check.get("effect"):
            out[f"monitor/{name}_domain_auc"] = check["effect"]["auc"]
    if "work_up" in s:
        out["monitor/work_up_rate"] = s["work_up"]["rate"]
    e = s["estimate"]
    if math.isfinite(e["sensitivity"]):
        out.update({"monitor/est_sensitivity": e["sensitivity"], "monitor/est_sensitivity_ci_low": e["interval"][0],
                    "monitor/est_sensitivity_ci_high": e["interval"][1], "monitor/est_valid": float(e["valid"])})
    o = s.get("observed")
    if o:
        out.update({"monitor/obs_n": o["n"], "monitor/obs_oe": o["oe"], "monitor/obs_ece": o["ece"]})
        if "sensitivity" in o:
            out.update({"monitor/obs_sensitivity": o["sensitivity"], "monitor/obs_work_up_rate": o["work_up_rate"]})
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}


def _log_run(res: Monitoring, uri: str, stage1_run, stage1_name: str) -> None:
    exp = MlflowClient(uri).get_experiment(stage1_run.info.experiment_id)
    tags = {TAG_MONITOR: "alert" if res.alerts else "quiet", TAG_MONITOR_ALERTS: res.alert_tag()[:4900],
            TAG_SITE: res.site, TAG_STAGE1: stage1_name, TAG_DATASET: "monitor"}
    with RunTracker(exp.name if exp is not None else CT_EXPERIMENT, f"monitor@{res.site}", tracking_uri=uri,
                    tags=tags, parent_run_id=res.model) as tr:
        tr.log_params({"site": res.site, "model": res.model, "site_run": res.site_run, "chunking": res.chunking,
                       "threshold": res.threshold, "n_rows": res.n_rows, "n_problems": len(res.problems),
                       "n_chunks": len(res.chunks), "n_chunks_skipped": sum(c["skipped"] for c in res.chunks),
                       **{f"rule.{k}": v for k, v in res.rule.as_dict().items()}})
        for c in res.chunks:
            if not c["skipped"]:
                tr.log_metrics(_metrics(c), step=c["chunk"])
        if res.false_alarms is not None:
            tr.log_metrics({"monitor/false_alarm_rate_year": res.false_alarms["rate"],
                            "monitor/false_alarm_years": res.false_alarms["years"]})
        res.run_id = tr.run_id
        tr.log_dict(res.as_dict(), MONITOR_ARTIFACT)
        tr.log_figure(monitor_figure(res), "plots/monitor.png")


def monitor_figure(res: Monitoring) -> Figure:
    """Each statistic against the chunk (x: the chunk's ordinal, never a date), alerts marked in red."""
    fig = Figure(figsize=(9, 7.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    done = [c for c in res.chunks if not c["skipped"]]
    x = np.array([c["chunk"] for c in done], float)

    def series(get) -> np.ndarray:
        vals = []
        for c in done:
            try:
                v = get(c["stats"])
            except (KeyError, TypeError, IndexError):
                v = None
            vals.append(math.nan if v is None else float(v))
        return np.array(vals, float)

    ax = axes[0]
    est = series(lambda s: s["estimate"]["sensitivity"])
    lo = series(lambda s: s["estimate"]["interval"][0])
    hi = series(lambda s: s["estimate"]["interval"][1])
    valid = np.array([bool(c["stats"]["estimate"]["valid"]) for c in done], bool)
    if np.isfinite(est).any():
        ax.errorbar(x[valid], est[valid], yerr=[est[valid] - lo[valid], hi[valid] - est[valid]], fmt="o",
                    color="tab:blue", label="estimated sensitivity (CBPE, valid)")
        ax.plot(x[~valid], est[~valid], "x", color="grey", label="estimate not valid")
    obs = series(lambda s: s["observed"]["sensitivity"])
    if np.isfinite(obs).any():
        ax.plot(x, obs, "s", color="black", label="observed sensitivity (labels)")
    ax.plot(x, series(lambda s: s["work_up"]["rate"]), "^-", color="tab:green", label="work-up rate")
    if res.rule.promise is not None:
        ax.axhline(res.rule.promise, color="tab:red", ls="--", lw=1, label=f"promised {res.rule.promise:.2f}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("rate")
    ax.legend(fontsize=7, loc="lower left")
    ax = axes[1]
    for name, color in (("site", "tab:purple"), ("training", "tab:orange")):
        ax.plot(x, series(lambda s, n=name: s[f"{n}_check"]["effect"]["auc"]), "o-", color=color,
                label=f"domain AUC vs {'site calibration CTs' if name == 'site' else 'training data'}")
    ax.axhline(0.6, color="grey", ls=":", lw=1, label="large (0.6)")
    ax.set_ylabel("domain AUC")
    ax.legend(fontsize=7, loc="upper left")
    ax = axes[2]
    ax.plot(x, series(lambda s: s["ood"]["share"]), "o-", color="tab:brown", label="share flagged out of distribution")
    ax.plot(x, series(lambda s: s["site_check"]["prevalence"]), "d-", color="tab:cyan",
            label="estimated prevalence (BBSE)")
    ax.set_ylabel("share")
    ax.set_xlabel("chunk (ordinal; " + ("month +k is chunk k+1)" if res.chunking == MONTH else f"{res.chunking})"))
    ax.legend(fontsize=7, loc="upper left")
    for c in done:
        if c["alerts"]:
            for a in axes:
                a.axvspan(c["chunk"] - 0.4, c["chunk"] + 0.4, color="tab:red", alpha=0.15, lw=0)
            axes[0].annotate(",".join(a["kind"].replace("_shift", "") for a in c["alerts"]), (c["chunk"], 1.0),
                             fontsize=6, color="tab:red", ha="center", va="top", rotation=90)
    axes[0].set_title(f"lungcal monitor: site {res.site} ({len(res.alerts)} alert(s); red: an alerting chunk)")
    fig.tight_layout()
    return fig


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"


def _ci(v: float, ci: Sequence[float], digits: int = 3) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _verdict(check: Mapping[str, Any]) -> str:
    if check.get("verdict") is None:
        return f"not checked ({check.get('note')})"
    e = check.get("effect")
    return check["verdict"] + (f" (domain AUC {e['auc']:.2f})" if e else "")


def format_report(res: Monitoring) -> str:
    """The printed report: the rule and its false-alarm rate, one block per chunk, the alerts, the problems."""
    lines = [f"== lungcal monitor: site {res.site}, model {res.model} (site run {res.site_run}) =="]
    lines.append(f"  chunks        {len(res.chunks)} by {res.chunking}; threshold "
                 + ("-" if res.threshold is None else f"{res.threshold:.4f}")
                 + ("" if res.rule.promise is None else f"; promised sensitivity {res.rule.promise:.3f}"))
    lines.append(f"  alert rule    {res.rule.describe()}")
    lines.append(f"  false alarms  {res.rule.bound()}")
    fa = res.false_alarms
    if fa is not None:
        lines.append(f"  measured      {fa['years_with_alert']} of {fa['years']} simulated stable years raised an "
                     f"alert ({_ci(fa['rate'], fa['ci'])}; {fa['n_per_chunk']} CTs a chunk, drawn from the site's "
                     f"calibration CTs, a fresh split into reference and chunks each year)")
    else:
        lines.append("  measured      not in this pass (--false-alarm-years N; docs/hospital.md gives it)")
    for note in res.notes:
        lines.append(f"  note          {note}")
    for c in res.chunks:
        head = f"  chunk {c['chunk']:>3} ({c['name']}, {c['n']} CTs)"
        s = c["stats"]
        if s is None:
            lines.append(f"{head}: skipped, too few to say anything")
            continue
        lines.append(f"{head}: vs site {_verdict(s['site_check'])}; vs training {_verdict(s['training_check'])}; "
                     f"out of distribution {_pct(s['ood']['share'])}")
        e = s["estimate"]
        if "work_up" in s:
            w = s["work_up"]
            valid = "valid" if e["valid"] else "NOT VALID"
            adj = f", prior-adjusted to {e['target_prevalence']:.2f}" if e["prior_adjusted"] else ""
            lines.append(f"        work-up {_ci(w['rate'], w['ci'], 2)}; estimated sensitivity "
                         f"{_ci(e['sensitivity'], e['interval'])} ({valid}{adj}: {e['why']}); O/E the labels should "
                         f"show {_ci(e['oe'], e['oe_interval'], 2)}")
        o = s.get("observed")
        if o:
            sens = f"sensitivity {_ci(o['sensitivity'], o['sensitivity_ci'])}, " if "sensitivity" in o else ""
            lines.append(f"        observed on {o['n']} labelled ({o['n_cancers']} cancers): {sens}"
                         + (f"work-up {_ci(o['work_up_rate'], o['work_up_ci'], 2)}, " if "work_up_rate" in o else "")
                         + f"O/E {_ci(o['oe'], o['oe_ci'], 2)}, ECE {_ci(o['ece'], o['ece_ci'])}")
        for a in c["alerts"]:
            lines.append(f"        {'ALERT' if a['new'] else 'still'}   {a['why']}")
    if res.alerts:
        first = res.alerts[0][0]
        lines.append(f"  ALERTS        {res.alert_tag()} (first: chunk {first['chunk']}, {first['name']}); what each "
                     "means and the route to take: docs/hospital.md, step 5")
    else:
        lines.append("  alerts        none")
    for p in res.problems:
        lines.append(f"  left out      {p}")
    if res.run_id:
        lines.append(f"  MLflow run    {res.run_id} (tag {TAG_MONITOR}; chunks by ordinal, no dates)")
    if res.json_path:
        lines.append(f"  JSON          {res.json_path}")
    return "\n".join(lines)
