"""The study's comparison report, built from MLflow.

``build_report(experiment)`` reads every finished run of an MLflow experiment, keeps the latest
run of each (dataset, stage-1 method, stage-2 method) configuration and lays the final
``{split}/{metric}`` numbers out as the study's table: rows are the stage-1 methods, column
groups the stage-2 methods (none, TS, LAS), cells ACC, AUC and ECE with their 95% CIs.

* The best-calibrated configuration is marked only when its ECE CI lies wholly below every other
  configuration's ECE CI (``ece_ci_high`` < every other ``ece_ci_low``); otherwise nothing is
  marked and the report says so.
* Binary runs that logged them also show the clinical calibration measures (calibration slope,
  calibration intercept, observed/expected ratio; ``{split}/cal_slope`` etc.) with their CIs.
* Runs that logged the referral metrics (``{split}/aurc``, ``{split}/sensitivity`` and
  ``{split}/sensitivity_cov90`` etc., :func:`lungcal.calibration.selective.selective_report`) get a
  referral section per dataset: what referring the 10% least certain cases does to sensitivity
  (accuracy for multi-class runs) on the rest.
* The study's published numbers (``published_results.csv``, shipped in the package) are shown side
  by side; unknown published cells stay empty. A table of our synthetic NLST-like cohort (dataset
  tag ``synthetic``) is shown beside the numbers published on *real* NLST CTs, and its columns say
  so (``published on real NLST``): a reference from other data, never a synthetic number called NLST.
* Further sections (``--sections``, :mod:`lungcal.study.sections`): ``classes`` (accuracy per class
  and per many / medium / few group, :mod:`lungcal.study.classes`) and ``posthoc`` (the post-hoc
  fixes of each CIFAR stage-1 run side by side, :mod:`lungcal.study.posthoc`), appended to the
  Markdown and the HTML page.
* It writes ``report.md``, ``report.csv`` and a self-contained ``report.html`` (reliability
  diagrams embedded as base64 PNGs, in a stage-1 x stage-2 grid) and logs the three files as
  artifacts of a run named ``report`` (tag ``lungcal.report=true``) in the same experiment.

This module is longer than the house ~400 lines: it is one report rendered three ways (Markdown,
CSV, HTML), and the renderers share its cells, column order and formatting; the study's paired
differences live in :mod:`lungcal.study.differences`.

Metric values in MLflow are fractions (as :func:`lungcal.calibration.metrics.calibration_report`
returns them); ACC and ECE are shown in percent, AUC as a fraction.
"""
from __future__ import annotations

import base64
import csv
import html
import io
import math
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

from mlflow.tracking import MlflowClient

from lungcal.errors import ConfigError, TrackingError
from lungcal.paths import default_output_dir
from lungcal.study.classes import class_lines
from lungcal.study.differences import collect_claims, render_claims
from lungcal.study.posthoc import posthoc_lines
from lungcal.study.sections import DEFAULT_SECTIONS, SECTIONS, Config
from lungcal.tracking.liveness import reap_orphaned_runs
from lungcal.tracking.names import TAG_DATASET, TAG_REPORT, TAG_STAGE1, TAG_STAGE2, plot_artifact
from lungcal.tracking.tracker import check_tracking_uri, default_tracking_uri

__all__ = [
    "STAGE1_ORDER",
    "STAGE2_ORDER",
    "REPORT_TAG",
    "Cell",
    "StudyTable",
    "load_published",
    "collect_tables",
    "configurations",
    "best_calibrated",
    "render_markdown",
    "write_csv",
    "render_html",
    "build_report",
]

REPORT_TAG = TAG_REPORT

#: display order of the stage-1 methods (unknown methods follow, sorted)
STAGE1_ORDER = ("ce", "focal", "focal_adaptive", "mixup", "focal_mixup")
#: the column groups, in order
STAGE2_ORDER = ("none", "ts", "las")
STAGE1_LABEL = {"ce": "CE", "focal": "Focal", "focal_adaptive": "Focal (adaptive γ)", "mixup": "CE+Mixup",
                "focal_mixup": "Focal+Mixup"}
STAGE2_LABEL = {"none": "none", "ts": "TS", "las": "LAS"}
METRICS = ("acc", "auc", "ece")
#: clinical calibration measures, shown where a run logged them (binary tasks)
CLINICAL_METRICS = ("cal_slope", "cal_intercept", "oe_ratio")
METRIC_LABEL = {"cal_slope": "slope", "cal_intercept": "intercept", "oe_ratio": "O/E"}
#: referral metrics (lungcal.calibration.selective.selective_report, no CIs), shown in the referral section
REFERRAL_METRICS = ("aurc", "sensitivity", "specificity", "acc_cov90", "sensitivity_cov90", "specificity_cov90",
                    "referred_cancer_share_cov90", "n_referred_cov90")
PERCENT_METRICS = ("acc", "ece")  # shown ×100
PUBLISHED_DATASETS = ("cifar10", "cifar10lt", "nlst", "ucd")
#: a dataset shown beside another dataset's published numbers: our synthetic NLST-like cohort beside real NLST's
PUBLISHED_REFERENCE = {"synthetic": "nlst"}
#: how the report names a dataset in a heading or a column (the tag itself when absent)
DATASET_LABEL = {"synthetic": "synthetic (our NLST-like synthetic cohort, not NLST)", "nlst": "real NLST"}


def normalise_stage2(value: str | None) -> str:
    """Map a ``lungcal.stage2`` tag to one of ``none``/``ts``/``las`` (or the tag lower-cased)."""
    if value is None or str(value).strip().lower() in ("", "none", "null", "-"):
        return "none"
    return str(value).strip().lower()


@dataclass
class Cell:
    """One configuration's final numbers: ``metrics[name] = (value, ci_low, ci_high)`` (fractions)."""

    dataset: str
    stage1: str
    stage2: str
    run_id: str
    metrics: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    n_runs: int = 1  # finished runs of this configuration (the latest one is shown)

    def get(self, metric: str) -> tuple[float, float, float]:
        nan = float("nan")
        return self.metrics.get(metric, (nan, nan, nan))


@dataclass
class StudyTable:
    """All cells of one dataset, plus the published numbers for it (percent), if any.

    ``published_on`` names the dataset the published numbers were measured on where it is not
    ``dataset`` itself (``"nlst"`` beside the ``synthetic`` NLST-like cohort), else ``""``.
    """

    dataset: str
    cells: dict[tuple[str, str], Cell]
    published: dict[tuple[str, str, str], float] = field(default_factory=dict)
    published_on: str = ""

    @property
    def stage1_methods(self) -> list[str]:
        found = {s1 for s1, _ in self.cells} | {s1 for s1, _, _ in self.published}
        return [m for m in STAGE1_ORDER if m in found] + sorted(found - set(STAGE1_ORDER))

    @property
    def stage2_methods(self) -> list[str]:
        found = {s2 for _, s2 in self.cells} | {s2 for _, s2, _ in self.published}
        return [m for m in STAGE2_ORDER if m in found] + sorted(found - set(STAGE2_ORDER))

    @property
    def has_published(self) -> bool:
        return bool(self.published)


# ------------------------------------------------------------------------------------ data in
def load_published(path: str | Path | None = None) -> dict[str, dict[tuple[str, str, str], float]]:
    """Read the published study numbers.

    Args:
        path: a CSV with columns ``dataset, stage1, stage2, metric, value`` (percent); defaults to
            the ``published_results.csv`` shipped in this package.

    Returns:
        ``{dataset: {(stage1, stage2, metric): value}}``. Dataset ``nlst`` holds numbers published on
        real NLST CTs; a table of our synthetic cohort shows them as such (:data:`PUBLISHED_REFERENCE`).
    """
    if path is None:
        text = resources.files("lungcal.study").joinpath("published_results.csv").read_text()
        source = "lungcal/study/published_results.csv"
    else:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read published results ({exc.strerror})", file=path,
                              fix="pass an existing CSV with columns dataset,stage1,stage2,metric,value") from exc
    out: dict[str, dict[tuple[str, str, str], float]] = {}
    reader = csv.DictReader(io.StringIO(text))
    needed = {"dataset", "stage1", "stage2", "metric", "value"}
    if not needed <= set(reader.fieldnames or ()):
        raise ConfigError("missing columns " + ", ".join(sorted(needed - set(reader.fieldnames or ()))),
                          file=source, fix="use the header dataset,stage1,stage2,metric,value")
    for i, row in enumerate(reader):
        try:
            value = float(row["value"])
        except ValueError as exc:
            raise ConfigError("value is not a number", file=source, row=i, field="value",
                              fix="write the published number in percent, e.g. 3.60") from exc
        key = (row["stage1"].strip(), normalise_stage2(row["stage2"]), row["metric"].strip())
        out.setdefault(row["dataset"].strip(), {})[key] = value
    return out


def _client(tracking_uri: str | None):
    check_tracking_uri(tracking_uri or default_tracking_uri())
    return MlflowClient(tracking_uri=tracking_uri or default_tracking_uri())


def _experiment_id(client, experiment: str) -> str:
    try:
        exp = client.get_experiment_by_name(experiment)
    except Exception as exc:  # unreachable server, bad URI
        raise TrackingError(f"cannot read MLflow at {client.tracking_uri} ({exc})",
                            fix="check --tracking-uri, or start the team server") from exc
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise TrackingError(f"no MLflow experiment named '{experiment}' in {client.tracking_uri}", field="experiment",
                            fix="choose one of: " + (", ".join(names) or "(none yet: run a bundle first)"))
    return exp.experiment_id


def collect_tables(experiment: str, *, tracking_uri: str | None = None, split: str = "test",
                   published: Mapping[str, Mapping] | None = None) -> list[StudyTable]:
    """Read the finished runs of ``experiment`` and group them into one table per dataset.

    A run contributes when it is FINISHED, carries a ``lungcal.stage1`` tag and logged
    ``{split}/ece``; report runs are ignored. Of several runs of the same configuration the most
    recent one is used (``Cell.n_runs`` counts them). Runs left RUNNING by a process that died are
    first marked KILLED (:func:`lungcal.tracking.liveness.reap_orphaned_runs`), so the store tells
    the truth in the UI too.
    """
    client = _client(tracking_uri)
    exp_id = _experiment_id(client, experiment)
    reap_orphaned_runs(client, [exp_id])
    published = load_published() if published is None else published
    cells: dict[str, dict[tuple[str, str], Cell]] = {}
    page_token = None
    while True:
        page = client.search_runs([exp_id], filter_string="attributes.status = 'FINISHED'",
                                  order_by=["attributes.start_time DESC"], max_results=1000,
                                  page_token=page_token)
        for run in page:
            tags = run.data.tags
            if tags.get(REPORT_TAG) or TAG_STAGE1 not in tags or f"{split}/ece" not in run.data.metrics:
                continue
            dataset = tags.get(TAG_DATASET) or experiment
            key = (tags[TAG_STAGE1].strip().lower(), normalise_stage2(tags.get(TAG_STAGE2)))
            table = cells.setdefault(dataset, {})
            if key in table:  # older run of a configuration already seen
                table[key].n_runs += 1
                continue
            m = run.data.metrics
            nan = float("nan")
            table[key] = Cell(dataset, key[0], key[1], run.info.run_id, {
                name: (m.get(f"{split}/{name}", nan), m.get(f"{split}/{name}_ci_low", nan),
                       m.get(f"{split}/{name}_ci_high", nan)) for name in METRICS + CLINICAL_METRICS + REFERRAL_METRICS
                if f"{split}/{name}" in m})
        page_token = page.token
        if not page_token:
            break
    tables = []
    for ds in sorted(cells):
        ref = PUBLISHED_REFERENCE.get(ds, ds)
        pub = dict(published.get(ref, {}))
        tables.append(StudyTable(ds, cells[ds], pub, published_on=ref if pub and ref != ds else ""))
    return tables


def configurations(tables: Iterable[StudyTable]) -> list[Config]:
    """The measured configurations of ``tables``, in display order (stage 1, then stage 2)."""
    return [Config(t.dataset, s1, s2, _config_label(s1, s2), t.cells[(s1, s2)].run_id)
            for t in tables for s1 in t.stage1_methods for s2 in t.stage2_methods if (s1, s2) in t.cells]


def _config_label(s1: str, s2: str) -> str:
    return f"{STAGE1_LABEL.get(s1, s1)} + {STAGE2_LABEL.get(s2, s2)}"


def best_calibrated(cells: Iterable[Cell]) -> Cell | None:
    """The configuration whose ECE CI lies wholly below every other configuration's ECE CI.

    Returns ``None`` when fewer than two configurations have an ECE CI, or when the CI of the
    lowest-ECE configuration overlaps any other (the difference is then not resolved).
    """
    cands = [c for c in cells if "ece" in c.metrics and not any(map(math.isnan, c.metrics["ece"]))]
    if len(cands) < 2:
        return None
    best = min(cands, key=lambda c: c.metrics["ece"][0])
    hi = best.metrics["ece"][2]
    if all(hi < c.metrics["ece"][1] for c in cands if c is not best):
        return best
    return None


# ------------------------------------------------------------------------------------ formatting
def _fmt(metric: str, triple: tuple[float, float, float]) -> str:
    v, lo, hi = triple
    if math.isnan(v):
        return ""
    if metric in PERCENT_METRICS:
        v, lo, hi, f = 100 * v, 100 * lo, 100 * hi, "{:.2f}"
    else:
        f = "{:.3f}"
    s = f.format(v)
    if not (math.isnan(lo) or math.isnan(hi)):
        s += " [" + f.format(lo) + ", " + f.format(hi) + "]"
    return s


def _columns(table: StudyTable) -> list[tuple[str, str, str]]:
    """(stage2, kind, metric) columns; kind is 'ours' or 'published'."""
    cols = []
    for s2 in table.stage2_methods:
        for m in METRICS:
            cols.append((s2, "ours", m))
            if table.has_published and m in PERCENT_METRICS and any(
                    k[1] == s2 and k[2] == m for k in table.published):
                cols.append((s2, "published", m))
        for m in CLINICAL_METRICS:
            if any(c.stage2 == s2 and m in c.metrics for c in table.cells.values()):
                cols.append((s2, "ours", m))
    return cols


def _header(table: StudyTable, col: tuple[str, str, str]) -> str:
    s2, kind, m = col
    unit = " %" if m in PERCENT_METRICS else ""
    name = METRIC_LABEL.get(m, m.upper()) + unit
    if kind != "published":
        return f"{STAGE2_LABEL.get(s2, s2)}: {name}"
    on = f" on {DATASET_LABEL.get(table.published_on, table.published_on)}" if table.published_on else ""
    return f"{STAGE2_LABEL.get(s2, s2)}: {name} (published{on})"


def _published_note(table: StudyTable) -> str:
    if not table.published_on:
        return "Published columns: the study's reported numbers (empty where not reported)."
    return (f"Published columns: the study's numbers on {DATASET_LABEL.get(table.published_on, table.published_on)}, "
            f"shown as a reference: they were measured on other data than this table's "
            f"{DATASET_LABEL.get(table.dataset, table.dataset)} (empty where not reported).")


def _cell_text(table: StudyTable, s1: str, col: tuple[str, str, str]) -> str:
    s2, kind, m = col
    if kind == "published":
        v = table.published.get((s1, s2, m))
        return "" if v is None else f"{v:.2f}"
    cell = table.cells.get((s1, s2))
    return "" if cell is None else _fmt(m, cell.get(m))


def _best_note(table: StudyTable, best: Cell | None) -> str:
    cands = [c for c in table.cells.values() if "ece" in c.metrics]
    if best is not None:
        return (f"Best calibrated: **{STAGE1_LABEL.get(best.stage1, best.stage1)} + "
                f"{STAGE2_LABEL.get(best.stage2, best.stage2)}** (its ECE 95% CI lies below every other "
                "configuration's; marked in bold).")
    if not cands:
        return "No configuration logged an ECE."
    low = min(cands, key=lambda c: c.metrics["ece"][0])
    return (f"No configuration is marked best calibrated: the lowest ECE "
            f"({STAGE1_LABEL.get(low.stage1, low.stage1)} + {STAGE2_LABEL.get(low.stage2, low.stage2)}, "
            f"{_fmt('ece', low.get('ece'))} %) has a 95% CI that overlaps another configuration's.")


def _referral_lines(table: StudyTable, split: str) -> list[str]:
    """"If the model refers the 10% it is least sure about, what happens to sensitivity on the rest?"

    From the logged ``{split}/sensitivity`` vs ``{split}/sensitivity_cov90`` (binary runs) or
    ``{split}/acc`` vs ``{split}/acc_cov90`` (others), with AURC; empty when no run logged them.
    """
    cells = [table.cells[(s1, s2)] for s1 in table.stage1_methods for s2 in table.stage2_methods
             if (s1, s2) in table.cells]
    binary = [c for c in cells if "sensitivity_cov90" in c.metrics and "sensitivity" in c.metrics]
    rows = binary or [c for c in cells if "acc_cov90" in c.metrics]
    if not rows:
        return []

    def pct(c: Cell, m: str) -> str:
        v = c.get(m)[0]
        return "" if math.isnan(v) else f"{100 * v:.1f}"

    def change(c: Cell, m: str) -> str:
        d = c.get(f"{m}_cov90")[0] - c.get(m)[0]
        return "" if math.isnan(d) else f"{100 * d:+.1f}"

    head = "sensitivity" if binary else "acc"
    lines = ["", f"### Referral: refer the 10% least certain ({split})", "",
             f"If the model refers the 10% of cases it is least sure about (ranked by confidence), what happens to "
             f"{'sensitivity' if binary else 'accuracy'} on the 90% it keeps? In %; change in percentage points.", ""]
    cols = [f"{head} all", f"{head} kept 90%", "change"]
    if binary:
        cols += ["specificity all", "specificity kept 90%", "cancers among referred", "referred"]
    lines += ["| configuration | " + " | ".join(cols) + " | AURC |", "|---|" + "---|" * (len(cols) + 1)]
    for c in rows:
        vals = [pct(c, head), pct(c, f"{head}_cov90"), change(c, head)]
        if binary:
            n_ref = c.get("n_referred_cov90")[0]
            vals += [pct(c, "specificity"), pct(c, "specificity_cov90"), pct(c, "referred_cancer_share_cov90"),
                     "" if math.isnan(n_ref) else str(int(n_ref))]
        aurc_v = c.get("aurc")[0]
        vals.append("" if math.isnan(aurc_v) else f"{aurc_v:.3f}")
        label = f"{STAGE1_LABEL.get(c.stage1, c.stage1)} + {STAGE2_LABEL.get(c.stage2, c.stage2)}"
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return lines


def render_markdown(tables: list[StudyTable], experiment: str, split: str = "test") -> str:
    """The report as Markdown: one table per dataset, best-calibrated note, published numbers."""
    lines = [f"# Calibration study report: experiment `{experiment}`", "",
             f"Split: `{split}`. ACC and ECE in %, AUC as a fraction; 95% bootstrap CIs in brackets. "
             "Rows: stage-1 method; column groups: stage-2 method.", ""]
    if not tables:
        lines.append("No finished runs with final metrics were found.")
    for table in tables:
        best = best_calibrated(table.cells.values())
        cols = _columns(table)
        lines += [f"## {DATASET_LABEL.get(table.dataset, table.dataset)}", "",
                  "| stage 1 | " + " | ".join(_header(table, c) for c in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for s1 in table.stage1_methods:
            texts = []
            for c in cols:
                t = _cell_text(table, s1, c)
                if best is not None and c[1] == "ours" and (s1, c[0]) == (best.stage1, best.stage2) and t:
                    t = f"**{t}**"
                texts.append(t)
            lines.append(f"| {STAGE1_LABEL.get(s1, s1)} | " + " | ".join(texts) + " |")
        lines += ["", _best_note(table, best)]
        if table.has_published:
            lines.append(_published_note(table))
        dup = [c for c in table.cells.values() if c.n_runs > 1]
        if dup:
            lines.append("Configurations with several finished runs show the latest: " + ", ".join(
                f"{c.stage1}/{c.stage2} ({c.n_runs} runs)" for c in dup) + ".")
        lines += _referral_lines(table, split)
        lines.append("")
    return "\n".join(lines)


def write_csv(tables: list[StudyTable], path: str | Path) -> Path:
    """One row per configuration (ours, and published-only rows), metrics as fractions, published in %."""
    path = Path(path)
    fields = ["dataset", "stage1", "stage2", "run_id"]
    for m in METRICS + CLINICAL_METRICS:
        fields += [m, f"{m}_ci_low", f"{m}_ci_high"]
    fields += ["best_calibrated", "published_acc", "published_ece", "published_on"]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for table in tables:
            best = best_calibrated(table.cells.values())
            for s1 in table.stage1_methods:
                for s2 in table.stage2_methods:
                    cell = table.cells.get((s1, s2))
                    pub = {m: table.published.get((s1, s2, m)) for m in PERCENT_METRICS}
                    if cell is None and all(v is None for v in pub.values()):
                        continue
                    row = {"dataset": table.dataset, "stage1": s1, "stage2": s2,
                           "run_id": cell.run_id if cell else "",
                           "best_calibrated": int(cell is not None and cell is best),
                           "published_acc": "" if pub["acc"] is None else pub["acc"],
                           "published_ece": "" if pub["ece"] is None else pub["ece"],
                           "published_on": "" if all(v is None for v in pub.values())
                           else table.published_on or table.dataset}
                    for m in METRICS + CLINICAL_METRICS:
                        v = cell.get(m) if cell and m in cell.metrics else (float("nan"),) * 3
                        for suffix, x in zip(("", "_ci_low", "_ci_high"), v):
                            row[m + suffix] = "" if math.isnan(x) else repr(float(x))
                    w.writerow(row)
    return path


def _artifact_png(client, run_id: str, split: str, kind: str) -> bytes | None:
    """The PNG bytes of a run's plot :func:`~lungcal.tracking.names.plot_artifact` ``(split, kind)``, or ``None`` if
    the run has none or its store cannot be read."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return Path(client.download_artifacts(run_id, plot_artifact(split, kind), tmp)).read_bytes()
    except Exception:  # noqa: BLE001 - no such plot, or the artifact store is unreachable: the table is still useful
        return None


def reliability_png(client, run_id: str, split: str = "test") -> bytes | None:
    """The PNG bytes of a run's reliability diagram, or ``None``."""
    return _artifact_png(client, run_id, split, "reliability")


def risk_coverage_png(client, run_id: str, split: str = "test") -> bytes | None:
    """The PNG bytes of a run's risk-coverage plot, or ``None``."""
    return _artifact_png(client, run_id, split, "risk_coverage")


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3} td:first-child,th:first-child{text-align:left}
td.best{font-weight:bold;background:#e7f6e7} td.pub{color:#555;background:#fafafa}
.grid{display:grid;gap:8px} .grid figure{margin:0;border:1px solid #ddd;padding:4px;text-align:center}
.grid img{max-width:100%} .grid .empty{color:#999;padding:2em 0}
"""


def render_html(tables: list[StudyTable], experiment: str, split: str = "test",
                diagrams: Mapping[str, bytes] | None = None, risk_plots: Mapping[str, bytes] | None = None,
                sections_md: Sequence[str] = (), study: bool = True) -> str:
    """A self-contained HTML page: the tables and, per dataset, a stage-1 x stage-2 grid of
    reliability diagrams (``diagrams[run_id]`` = PNG bytes, embedded as base64), and one of
    risk-coverage plots (``risk_plots[run_id]``) where any run of the dataset has one; then the
    further sections' Markdown lines (``sections_md``). ``study=False`` leaves the tables out."""
    tables = tables if study else []
    diagrams = diagrams or {}
    risk_plots = risk_plots or {}
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>lungcal report: {e(experiment)}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Calibration study report: <code>{e(experiment)}</code></h1>",
             f"<p>Split <code>{e(split)}</code>. ACC and ECE in %, AUC as a fraction; 95% bootstrap CIs in "
             f"brackets. Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.</p>"]
    if study and not tables:
        parts.append("<p>No finished runs with final metrics were found.</p>")
    for table in tables:
        best = best_calibrated(table.cells.values())
        cols = _columns(table)
        parts.append(f"<h2>{e(DATASET_LABEL.get(table.dataset, table.dataset))}</h2><table><tr><th>stage 1</th>")
        parts += [f"<th>{e(_header(table, c))}</th>" for c in cols]
        parts.append("</tr>")
        for s1 in table.stage1_methods:
            parts.append(f"<tr><td>{e(STAGE1_LABEL.get(s1, s1))}</td>")
            for c in cols:
                cls = "pub" if c[1] == "published" else (
                    "best" if best is not None and (s1, c[0]) == (best.stage1, best.stage2) else "")
                parts.append(f"<td class='{cls}'>{e(_cell_text(table, s1, c))}</td>")
            parts.append("</tr>")
        parts.append("</table>")
        parts.append(f"<p>{e(_best_note(table, best).replace('**', ''))}</p>")
        if table.has_published:
            parts.append(f"<p>{e(_published_note(table))}</p>")
        s2s = table.stage2_methods
        parts.append(f"<h3>Reliability diagrams ({e(table.dataset)}, {e(split)})</h3>"
                     f"<div class='grid' style='grid-template-columns:repeat({len(s2s)},1fr)'>")
        for s1 in table.stage1_methods:
            for s2 in s2s:
                cell = table.cells.get((s1, s2))
                label = _config_label(s1, s2)
                png = diagrams.get(cell.run_id) if cell else None
                if png:
                    b64 = base64.b64encode(png).decode("ascii")
                    body = f"<img alt='{e(label)}' src='data:image/png;base64,{b64}'>"
                else:
                    body = "<div class='empty'>no diagram</div>"
                parts.append(f"<figure>{body}<figcaption>{e(label)}</figcaption></figure>")
        parts.append("</div>")
        parts += _risk_grid(table, split, risk_plots)
    parts += _markdown_html(sections_md)
    parts.append("</body></html>")
    return "".join(parts)


def _markdown_html(lines: Sequence[str]) -> list[str]:
    """The report sections' Markdown (headings, pipe tables, paragraphs) as HTML."""
    e = html.escape
    parts: list[str] = []
    table: list[list[str]] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= {"-", ":"} for c in cells):  # not the |---| rule
                table.append(cells)
            continue
        if table:
            head, *body = table
            parts.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in head) + "</tr>"
                         + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in body)
                         + "</table>")
            table = []
        level = len(line) - len(line.lstrip("#"))
        if 0 < level <= 6 and line[level:level + 1] == " ":
            parts.append(f"<h{level}>{e(line[level + 1:])}</h{level}>")
        elif line.strip():
            parts.append(f"<p>{e(line)}</p>")
    return parts


def _risk_grid(table: StudyTable, split: str, risk_plots: Mapping[str, bytes]) -> list[str]:
    """HTML grid of the risk-coverage plots of one dataset's configurations (empty when none has one)."""
    if not any(c.run_id in risk_plots for c in table.cells.values()):
        return []
    e = html.escape
    parts = [f"<h3>Risk-coverage curves ({e(table.dataset)}, {e(split)})</h3>"
             f"<div class='grid' style='grid-template-columns:repeat({len(table.stage2_methods)},1fr)'>"]
    for s1 in table.stage1_methods:
        for s2 in table.stage2_methods:
            cell = table.cells.get((s1, s2))
            label = _config_label(s1, s2)
            png = risk_plots.get(cell.run_id) if cell else None
            body = (f"<img alt='{e(label)}' src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>"
                    if png else "<div class='empty'>no plot</div>")
            parts.append(f"<figure>{body}<figcaption>{e(label)}</figcaption></figure>")
    parts.append("</div>")
    return parts


# ------------------------------------------------------------------------------------ entry point
def build_report(experiment: str, out_dir: str | Path | None = None, *, tracking_uri: str | None = None,
                 split: str = "test", log_run: bool = True, published_path: str | Path | None = None,
                 sections: Sequence[str] = DEFAULT_SECTIONS, n_bootstrap: int = 1000) -> dict[str, object]:
    """Build the study report of one MLflow experiment.

    Args:
        experiment: the MLflow experiment (``nlst``, ``cifar10``, ``cifar10lt``, ...).
        out_dir: where to write ``report.md``, ``report.csv`` and ``report.html``; defaults to
            ``<output_dir>/reports/<experiment>``.
        tracking_uri: MLflow tracking URI; defaults to the project's SQLite store.
        split: the split whose final metrics are tabulated.
        log_run: also log the three files as artifacts of a new ``report`` run.
        published_path: override the shipped published-results CSV.
        sections: which of :data:`lungcal.study.sections.SECTIONS` to write (``study``: the tables,
            referral and paired differences; ``classes``; ``posthoc``), in that order.
        n_bootstrap: resamples of the ``classes`` and ``posthoc`` sections' CIs.

    Returns:
        ``{"markdown": Path, "csv": Path, "html": Path, "run_id": str | None, "tables": [...],
        "claims": [...]}`` (the study's claims as paired differences, :mod:`lungcal.study.differences`).
    """
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ConfigError(f"unknown report sections {unknown}" if unknown else "no report section chosen",
                          field="sections", fix="choose from " + ", ".join(SECTIONS))
    study = "study" in sections
    tracking_uri = tracking_uri or default_tracking_uri()
    tables = collect_tables(experiment, tracking_uri=tracking_uri, split=split,
                            published=load_published(published_path))
    out = Path(out_dir) if out_dir is not None else default_output_dir() / "reports" / experiment
    out.mkdir(parents=True, exist_ok=True)
    client = _client(tracking_uri)
    diagrams, risk_plots = {}, {}
    for table in tables if study else []:
        for cell in table.cells.values():
            png = reliability_png(client, cell.run_id, split)
            if png:
                diagrams[cell.run_id] = png
            png = risk_coverage_png(client, cell.run_id, split)
            if png:
                risk_plots[cell.run_id] = png
    claims = collect_claims(client, _experiment_id(client, experiment), split) if study else []
    configs = configurations(tables)
    extra: list[str] = []
    if "classes" in sections:
        extra += class_lines(client, configs, split, n_bootstrap)
    if "posthoc" in sections:
        extra += posthoc_lines(client, configs, split, n_bootstrap)
    md = out / "report.md"
    head = (render_markdown(tables, experiment, split) + "\n".join(["", *render_claims(claims)]) if study else
            f"# Calibration study report: experiment `{experiment}`\n\nSplit: `{split}`.\n")
    md.write_text(head + "\n".join(["", *extra]))
    csv_path = write_csv(tables, out / "report.csv")
    html_path = out / "report.html"
    html_path.write_text(render_html(tables, experiment, split, diagrams, risk_plots, extra, study=study))
    run_id = None
    if log_run:
        exp_id = _experiment_id(client, experiment)
        run = client.create_run(exp_id, run_name="report", tags={REPORT_TAG: "true", "mlflow.runName": "report"})
        run_id = run.info.run_id
        try:
            client.log_param(run_id, "split", split)
            client.log_param(run_id, "sections", ",".join(sections))
            client.log_metric(run_id, "report/configurations", sum(len(t.cells) for t in tables))
            for p in (md, csv_path, html_path):
                client.log_artifact(run_id, str(p), "report")
        except BaseException:
            client.set_terminated(run_id, "FAILED")
            raise
        client.set_terminated(run_id, "FINISHED")
    return {"markdown": md, "csv": csv_path, "html": html_path, "run_id": run_id, "tables": tables,
            "claims": claims}
