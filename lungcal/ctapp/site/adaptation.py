"""``lungcal adapt-curve``: how many labelled CTs does a site need, and for which route?

On a labelled site datalist (train/val/test splits), for each number ``n`` of labelled site CTs (nested,
stratified draws from the site's train+val rows; the test split is fixed and never drawn from), four routes
are scored on the **same** test CTs:

- ``shipped``: the model as shipped (its stage-1 network and its reference calibrator), the reference row;
- ``recalibrate``: the shipped network, recalibrated on the ``n`` CTs (``auto``: TS, Platt or isotonic by
  cross-validated NLL, :func:`lungcal.calibration.scaling.select_calibrator`); no retraining;
- ``finetune``: the stage-1 bundle trained on the ``n`` CTs (75 % train, 25 % val, stratified) starting
  from the shipped weights (``init_run_id``), then its own TS on that val;
- ``scratch``: the same bundle from scratch.

One training on one draw is one sample of a route: another draw of the same size, or another training seed,
gives another model. So the curve is run over ``draws`` repetitions: draw ``d`` is its own nested draw
(``nested_draws(pool, sizes, seed + d)``) and its trainings their own seed (the bundle's ``seed``: ``seed + d``).
Each ``draw_rows`` entry is one route, size and draw with its test AUC, ECE, calibration slope and intercept and
O/E (CIs over the test CTs). Each of the main ``rows`` (one per route and size) holds the mean over the draws,
with CIs from a two-level bootstrap over the draws and the test CTs, and the AUC and ECE differences against
``shipped`` (the fixed arm); ``contrasts`` holds, per size, each pair of the routes run (later route minus
earlier: ``finetune - recalibrate``, ``scratch - recalibrate``, ``scratch - finetune``) paired by draw (the two
routes of a draw saw the same labelled CTs) and on the test CTs
(:func:`lungcal.calibration.metrics.draws_bootstrap_diff`). The curve is printed, written as JSON and logged as
one MLflow run (tag ``lungcal.adaptation``) with ``plots/adaptation_curve.png``; every training route of every
draw is its own stage-1 run in the same store, so each point can be opened.
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
from mlflow.tracking import MlflowClient
from monai.bundle import run as run_bundle

from lungcal.calibration.metrics import draws_bootstrap_diff
from lungcal.calibration.scaling import calibrated_probs, select_calibrator
from lungcal.ctapp.evaluate.calibrators import reference_calibrator
from lungcal.ctapp.evaluate.reports import evaluate_probs
from lungcal.ctapp.infer.scoring import score_rows
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.ctapp.site.site_check import json_ready
from lungcal.data.manifest import load_manifest, manifest_source, rows_for_split
from lungcal.errors import ConfigError, DataError
from lungcal.paths import atomic_write_text, default_output_dir
from lungcal.tracking import CT_EXPERIMENT, TAG_DATASET, TAG_SITE, TAG_STAGE1, RunTracker, default_tracking_uri

__all__ = ["ROUTES", "DEFAULT_SIZES", "DEFAULT_DRAWS", "TAG_ADAPTATION", "Curve", "nested_draws", "adaptation_curve",
           "format_curve"]

ROUTES = ("shipped", "recalibrate", "finetune", "scratch")
DEFAULT_SIZES = (50, 100, 200, 400)
#: repetitions (draw and training seed) per point: the fewest from which a spread can be read
DEFAULT_DRAWS = 3
#: the tag of an adaptation-curve run
TAG_ADAPTATION = "lungcal.adaptation"
#: the metrics of each row, with their CIs
_METRICS = ("auc", "ece", "cal_slope", "cal_intercept", "oe_ratio")
#: the share of a training route's draw that is its validation split
VAL_SHARE = 0.25


@dataclass
class Curve:
    """One adaptation curve.

    ``rows``: one per route and size, ``{"route", "n", "draws", "auc", "auc_ci_low", ..., "d_auc",
    "d_auc_ci_low", ..., "run_ids"}`` (``n`` 0 for ``shipped``; the metrics the mean over the draws, CIs over
    draws and test CTs); ``draw_rows``: one per route, size and draw (``"draw"``, the metrics with CIs over the
    test CTs, ``"run_id"``); ``contrasts``: per size and pair of routes, ``{"n", "a", "b", "d_auc", ...,
    "d_ece", ...}`` (``a - b``, paired by draw); ``test_probs``: p(cancer) of each test CT per
    ``"route/n/draw"`` (``"shipped"`` once) and ``test_labels``, so every number can be recomputed.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    site: str = "unknown"
    model: str = ""
    n_test: int = 0
    n_pool: int = 0
    draws: int = 1
    skipped_sizes: list[int] = field(default_factory=list)
    draw_rows: list[dict[str, Any]] = field(default_factory=list)
    contrasts: list[dict[str, Any]] = field(default_factory=list)
    test_probs: dict[str, list[float]] = field(default_factory=dict)
    test_labels: list[int] = field(default_factory=list)
    run_id: str | None = None
    json_path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"site": self.site, "model": self.model, "n_test": self.n_test, "n_pool": self.n_pool,
                "draws": self.draws, "skipped_sizes": self.skipped_sizes, "rows": self.rows,
                "contrasts": self.contrasts, "draw_rows": self.draw_rows, "run_id": self.run_id,
                "test_labels": self.test_labels, "test_probs": self.test_probs}


def nested_draws(rows: Sequence[Mapping[str, Any]], sizes: Sequence[int], seed: int = 0) -> dict[int, list[dict]]:
    """For each size, a stratified draw of that many rows; a larger draw holds every smaller one (so the curve
    shows what more labels add, not a different sample). Sizes above ``len(rows)`` are left out."""
    rng = np.random.default_rng(seed)
    by_label = {lab: [dict(r) for r in rows if int(r["label"]) == lab] for lab in (0, 1)}
    order = {lab: [part[i] for i in rng.permutation(len(part))] for lab, part in by_label.items()}
    share = len(by_label[1]) / max(1, len(rows))
    out = {}
    for n in sorted(set(int(s) for s in sizes)):
        if n > len(rows):
            continue
        n1 = min(len(order[1]), max(1, round(n * share)))
        n0 = n - n1
        if n0 > len(order[0]):
            continue
        out[n] = order[1][:n1] + order[0][:n0]
    return out


def _train_val(rows: Sequence[dict], seed: int) -> list[dict]:
    """Stratified 75/25 train/val split of a draw (at least one val case of each label)."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for lab in (0, 1):
        part = [r for r in rows if int(r["label"]) == lab]
        idx = rng.permutation(len(part))
        n_val = max(1, round(len(part) * VAL_SHARE))
        out += [{**part[i], "split": "val" if k < n_val else "train"} for k, i in enumerate(idx)]
    return out


def _report(probs: np.ndarray, labels: np.ndarray, n_bootstrap: int, seed: int) -> dict[str, Any]:
    """One model's test metrics with CIs over the test CTs."""
    rep = evaluate_probs(probs, labels, n_bins=10, n_bootstrap=n_bootstrap, seed=seed)
    row: dict[str, Any] = {}
    for m in _METRICS:
        row[m], row[f"{m}_ci_low"], row[f"{m}_ci_high"] = rep[m], rep.get(f"{m}_ci_low"), rep.get(f"{m}_ci_high")
    return row


def _diff(metric: str, a: np.ndarray, b: np.ndarray | None, labels: np.ndarray, n_bootstrap: int,
          seed: int) -> dict[str, Any]:
    return draws_bootstrap_diff(metric, a, b, labels, n_bootstrap=n_bootstrap, seed=seed, n_bins=10)


def _mean_row(probs: np.ndarray, labels: np.ndarray, shipped: np.ndarray, n_bootstrap: int,
              seed: int) -> dict[str, Any]:
    """The mean over the draws ``probs`` (D, N) of each metric, and its AUC and ECE differences against
    ``shipped``, with CIs over draws and test CTs."""
    row: dict[str, Any] = {"draws": int(probs.shape[0])}
    for m in _METRICS:
        d = _diff(m, probs, None, labels, n_bootstrap, seed)
        row[m], row[f"{m}_ci_low"], row[f"{m}_ci_high"] = d["diff"], d["ci_low"], d["ci_high"]
    for m in ("auc", "ece"):
        d = _diff(m, probs, shipped, labels, n_bootstrap, seed)
        row[f"d_{m}"], row[f"d_{m}_ci_low"], row[f"d_{m}_ci_high"] = d["diff"], d["ci_low"], d["ci_high"]
        row[f"d_{m}_p"] = d["p_value"]
    return row


def _contrast(n: int, a: str, b: str, pa: np.ndarray, pb: np.ndarray, labels: np.ndarray, n_bootstrap: int,
              seed: int) -> dict[str, Any]:
    """Route ``a`` minus route ``b`` at ``n`` labelled CTs, paired by draw and on the test CTs."""
    out: dict[str, Any] = {"n": n, "a": a, "b": b, "draws": int(pa.shape[0])}
    for m in ("auc", "ece"):
        d = _diff(m, pa, pb, labels, n_bootstrap, seed)
        out[f"d_{m}"], out[f"d_{m}_ci_low"], out[f"d_{m}_ci_high"] = d["diff"], d["ci_low"], d["ci_high"]
        out[f"d_{m}_p"], out[f"d_{m}_significant"] = d["p_value"], d["significant"]
    return out


def _train(bundle: str, datalist: Path, *, output_dir: Path, tracking_uri: str | None, init_run_id: str | None,
           run_name: str, epochs: int | None, overrides: Mapping[str, Any]) -> str:
    """Run the stage-1 bundle in this process; the id of the stage-1 run it made."""
    kw: dict[str, Any] = {"datalist": str(datalist), "output_dir": str(output_dir), "run_name": run_name,
                          "init_run_id": init_run_id, **overrides}
    if epochs is not None:
        kw["epochs"] = int(epochs)
    if tracking_uri:
        kw["tracking_uri"] = tracking_uri
    kw["logging_file"] = False  # the bundle's own logging config would reset the caller's
    run_bundle(config_file=bundle, **kw)
    uri = tracking_uri or default_tracking_uri(output_dir)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(CT_EXPERIMENT)
    found = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'",
                               order_by=["attributes.start_time DESC"], max_results=1) if exp else []
    if not found:
        raise DataError(f"the bundle finished but no run named {run_name!r} is in the store", field="bundle")
    return found[0].info.run_id


def adaptation_curve(run: str, datalist: str | Path, *, sizes: Sequence[int] = DEFAULT_SIZES,
                     routes: Sequence[str] = ROUTES, bundle: str = "bundles/nlst_focal.json",
                     overrides: Mapping[str, Any] | None = None, epochs: int | None = None,
                     tracking_uri: str | None = None, output_dir: str | Path | None = None, n_bootstrap: int = 1000,
                     seed: int = 0, num_workers: int = 0, json_path: str | Path | None = None,
                     log: bool = True, draws: int = DEFAULT_DRAWS) -> Curve:
    """The adaptation curve of a labelled site (module doc).

    Args:
        run: the shipped model's stage-1 MLflow run id.
        datalist: the site's labelled datalist with train, val and test splits.
        sizes: the numbers of labelled site CTs (drawn from train + val).
        routes: a subset of :data:`ROUTES` (``shipped`` is always scored: the differences are against it).
        bundle: the stage-1 bundle the training routes run (from the project root).
        overrides: bundle keys for the training routes (e.g. a smaller grid for a quick curve).
        epochs: the training routes' epochs (default: the bundle's).
        seed: draw ``d`` is ``nested_draws(pool, sizes, seed + d)`` and its trainings run with the bundle's
            ``seed`` = ``seed + d``; the bootstrap's seed.
        draws: repetitions per point (1: one draw and one training seed, the CIs then cover the test CTs only).
    """
    unknown = sorted(set(routes) - set(ROUTES))
    if unknown:
        raise ConfigError(f"unknown route(s) {unknown}", field="--routes", fix=f"use some of {', '.join(ROUTES)}")
    if int(draws) < 1:
        raise ConfigError(f"draws must be at least 1, got {draws}", field="--draws",
                          fix="e.g. --draws 3 (1 gives CIs over the test CTs only)")
    if any(int(s) < 10 for s in sizes):
        raise ConfigError(f"sizes {list(sizes)}: each needs at least 10 CTs", field="--sizes",
                          fix="e.g. --sizes 50,100,200,400")
    training = [r for r in routes if r in ("finetune", "scratch")]
    if training and not Path(bundle).is_file():
        raise ConfigError(f"bundle {bundle} not found", field="--bundle",
                          fix="run from the project root, or pass --bundle with the stage-1 bundle's path")
    datalist = Path(datalist).expanduser()
    if not datalist.is_file():
        raise DataError("datalist not found", file=datalist, field="DATALIST",
                        fix="import the site with lungcal import-site (train, val and test splits, labelled)")
    rows = load_manifest(datalist)
    test = rows_for_split(rows, "test")
    pool = rows_for_split(rows, "train") + rows_for_split(rows, "val")
    for name, part in (("test", test), ("train + val", pool)):
        if {int(r["label"]) for r in part} != {0, 1}:
            raise DataError(f"the site's {name} rows need cancer and non-cancer CTs", file=datalist, field="label")
    all_draws = [nested_draws(pool, sizes, seed + d) for d in range(int(draws))]
    out_dir = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    uri = tracking_uri or default_tracking_uri(out_dir)
    stage1 = load_stage1(str(run), uri, field="--run")
    if stage1.run is None:
        raise ConfigError("the shipped model must be an MLflow run", field="--run", fix="pass its stage-1 run id")
    cache = out_dir / "cache" / "bags"
    site = ",".join(sorted({str(r.get("site")) for r in rows if r.get("site")})) or "unknown"
    curve = Curve(site=site, model=stage1.run.info.run_id, n_test=len(test), n_pool=len(pool), draws=int(draws),
                  skipped_sizes=sorted(set(int(s) for s in sizes) - set(all_draws[0])))
    if json_path is not None:
        curve.json_path = str(Path(json_path).expanduser())

    def score(net, bag_params, calibrator) -> tuple[np.ndarray, np.ndarray]:
        sc = score_rows(net, test, bag_params, calibrator, cache_dir=cache, num_workers=num_workers)
        p = np.asarray(sc["probs"])
        return (p[:, 1] if p.ndim == 2 else p), np.asarray(sc["labels"]).astype(int)

    shipped, y = score(stage1.network, stage1.bag_params, reference_calibrator(uri, stage1.run))
    curve.test_labels = [int(v) for v in y]
    curve.test_probs["shipped"] = [float(v) for v in shipped]
    curve.rows.append({"route": "shipped", "n": 0, "draws": 1, **_report(shipped, y, n_bootstrap, seed),
                       "run_ids": [stage1.run.info.run_id]})
    work = out_dir / "adaptation" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    zt = None
    probs: dict[tuple[str, int], list[np.ndarray]] = {}

    def keep(route: str, n: int, d: int, p: np.ndarray, extra: Mapping[str, Any]) -> None:
        probs.setdefault((route, n), []).append(p)
        curve.test_probs[f"{route}/{n}/{d}"] = [float(v) for v in p]
        curve.draw_rows.append({"route": route, "n": n, "draw": d, **_report(p, y, n_bootstrap, seed), **extra})
        if curve.json_path:  # so far, in case the curve is stopped: every finished training can be read
            atomic_write_text(curve.json_path + ".partial",
                              json.dumps(json_ready(curve.as_dict()), indent=2) + "\n")

    for n in sorted(all_draws[0]):
        for d, nested in enumerate(all_draws):
            draw = nested[n]
            print(f"-- {n} labelled site CTs ({sum(int(r['label']) for r in draw)} cancers), draw {d + 1}/{draws}",
                  flush=True)
            if "recalibrate" in routes:
                sc = score_rows(stage1.network, draw, stage1.bag_params, None, cache_dir=cache,
                                num_workers=num_workers)
                name, cal, _ = select_calibrator(sc["logits"], np.asarray([int(r["label"]) for r in draw]),
                                                 seed=seed + d)
                if zt is None:
                    zt = score_rows(stage1.network, test, stage1.bag_params, None, cache_dir=cache,
                                    num_workers=num_workers)["logits"]
                p = calibrated_probs(cal, zt)
                keep("recalibrate", n, d, p[:, 1] if np.ndim(p) == 2 else p, {"calibrator": name, "run_id": None})
            for route in training:
                dl = work / f"{route}_{n}_d{d}.json"
                dl.write_text(json.dumps({"version": 1, "source": manifest_source(datalist),
                                          "rows": _train_val(draw, seed + d) + [dict(r) for r in test]}))
                t0 = time.time()
                rid = _train(bundle, dl, output_dir=out_dir, tracking_uri=tracking_uri,
                             init_run_id=stage1.run.info.run_id if route == "finetune" else None,
                             run_name=f"adapt-{route}-{n}-d{d}-{dl.parent.name}", epochs=epochs,
                             overrides={**(overrides or {}), "seed": seed + d})
                trained = load_stage1(rid, uri, field="--run")
                p, _ = score(trained.network, trained.bag_params, reference_calibrator(uri, trained.run))
                keep(route, n, d, p, {"run_id": rid, "seconds": round(time.time() - t0, 1)})
    run_order = [r for r in ROUTES[1:] if r in routes]
    for n in sorted(all_draws[0]):
        for route in run_order:
            stack = np.stack(probs[(route, n)])
            ids = [r["run_id"] for r in curve.draw_rows if r["route"] == route and r["n"] == n]
            row = {"route": route, "n": n, **_mean_row(stack, y, shipped, n_bootstrap, seed), "run_ids": ids}
            if route == "recalibrate":
                row["calibrators"] = [r["calibrator"] for r in curve.draw_rows if r["route"] == route and r["n"] == n]
            curve.rows.append(row)
        for i, b in enumerate(run_order):
            for a in run_order[i + 1:]:
                curve.contrasts.append(_contrast(n, a, b, np.stack(probs[(a, n)]), np.stack(probs[(b, n)]), y,
                                                 n_bootstrap, seed))
    if log:
        _log(curve, uri, datalist, work)
    if curve.json_path:
        atomic_write_text(curve.json_path, json.dumps(json_ready(curve.as_dict()), indent=2) + "\n")
        Path(curve.json_path + ".partial").unlink(missing_ok=True)
    return curve


def curve_figure(curve: Curve) -> Figure:
    """Test AUC and ECE against the number of labelled site CTs: per route the mean over the draws (line) with
    its 95 % CI over draws and test CTs (band) and each draw (dots); the shipped model as a horizontal band."""
    fig = Figure(figsize=(9, 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    ship = next(r for r in curve.rows if r["route"] == "shipped")
    for ax, m in zip(axes, ("auc", "ece")):
        ax.axhspan(ship[f"{m}_ci_low"], ship[f"{m}_ci_high"], color="grey", alpha=0.2)
        ax.axhline(ship[m], color="grey", label="shipped")
        for route in ROUTES[1:]:
            pts = sorted((r for r in curve.rows if r["route"] == route), key=lambda r: r["n"])
            if not pts:
                continue
            n = np.array([r["n"] for r in pts], float)
            line, = ax.plot(n, [r[m] for r in pts], marker="o", label=f"{route} (mean of {pts[0]['draws']})")
            ax.fill_between(n, [r[f"{m}_ci_low"] for r in pts], [r[f"{m}_ci_high"] for r in pts],
                            color=line.get_color(), alpha=0.15, linewidth=0)
            each = [r for r in curve.draw_rows if r["route"] == route]
            ax.scatter([r["n"] for r in each], [r[m] for r in each], s=8, color=line.get_color(), alpha=0.5)
        ax.set_xscale("log")
        ax.set_xlabel("labelled site CTs")
        ax.set_ylabel(f"test {m.upper()}")
        ax.legend(fontsize=7)
    fig.suptitle(f"site {curve.site}: {curve.n_test} test CTs, {curve.draws} draw(s) per point "
                 "(bands: 95 % CI over draws and test CTs)", fontsize=9)
    fig.tight_layout()
    return fig


def _log(curve: Curve, uri: str, datalist: Path, work: Path) -> None:
    tags = {TAG_ADAPTATION: "curve", TAG_SITE: curve.site, TAG_DATASET: manifest_source(datalist),
            TAG_STAGE1: "adaptation"}
    name = f"adapt-curve@{curve.site}-{time.strftime('%Y%m%d-%H%M%S')}"
    with RunTracker(CT_EXPERIMENT, name, tracking_uri=uri, tags=tags, parent_run_id=curve.model) as tr:
        tr.log_params({"model": curve.model, "n_test": curve.n_test, "n_pool": curve.n_pool, "draws": curve.draws,
                       "sizes": sorted({r["n"] for r in curve.rows if r["n"]}), "site": curve.site})
        metrics = {}
        for r in curve.rows:
            for m in ("auc", "ece", "d_auc", "d_ece"):
                v = r.get(m)
                if v is not None and math.isfinite(float(v)):
                    metrics[f"{r['route']}_{r['n']}/{m}"] = float(v)
        for c in curve.contrasts:
            for m in ("d_auc", "d_auc_ci_low", "d_auc_ci_high", "d_ece", "d_ece_ci_low", "d_ece_ci_high"):
                v = c.get(m)
                if v is not None and math.isfinite(float(v)):
                    metrics[f"contrast_{c['n']}/{c['a']}_vs_{c['b']}/{m}"] = float(v)
        tr.log_metrics(metrics)
        curve.run_id = tr.run_id
        tr.log_dict(json_ready(curve.as_dict()), "adaptation_curve.json")
        tr.log_figure(curve_figure(curve), "plots/adaptation_curve.png")


def format_curve(curve: Curve) -> str:
    """The printed tables: one row per route and size (means over the draws, CIs over draws and test CTs, the
    differences against shipped), then the route-against-route contrasts per size."""
    def ci(r: Mapping[str, Any], m: str, fmt: str = ".3f") -> str:
        v, lo, hi = r.get(m), r.get(f"{m}_ci_low"), r.get(f"{m}_ci_high")
        if v is None:
            return "-"
        if lo is None or hi is None:
            return f"{v:{fmt}}"
        return f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    lines = [f"== adaptation curve: site {curve.site}, {curve.n_test} test CTs, model {curve.model}, "
             f"{curve.draws} draw(s) per point ==",
             "  (means over the draws; 95 % CIs over draws and test CTs)",
             f"  {'route':<12} {'n':>4}  {'AUC':<22} {'ECE':<22} {'slope':<22} {'O/E':<22} "
             f"{'dAUC vs shipped':<24} dECE vs shipped"]
    for r in curve.rows:
        lines.append(f"  {r['route']:<12} {r['n']:>4}  {ci(r, 'auc'):<22} {ci(r, 'ece'):<22} "
                     f"{ci(r, 'cal_slope', '.2f'):<22} {ci(r, 'oe_ratio', '.2f'):<22} {ci(r, 'd_auc', '+.3f'):<24} "
                     f"{ci(r, 'd_ece', '+.3f')}")
    if curve.contrasts:
        lines += ["", "  route against route (a - b), paired by draw and on the test CTs; * = the CI excludes 0",
                  f"  {'n':>4}  {'a - b':<26} {'dAUC':<26} dECE"]
        for c in curve.contrasts:
            star = {m: "*" if c.get(f"d_{m}_significant") else "" for m in ("auc", "ece")}
            lines.append(f"  {c['n']:>4}  {c['a'] + ' - ' + c['b']:<26} {ci(c, 'd_auc', '+.3f') + star['auc']:<26} "
                         f"{ci(c, 'd_ece', '+.3f')}{star['ece']}")
    if curve.skipped_sizes:
        lines.append(f"  sizes left out (more than the site's {curve.n_pool} train + val CTs): {curve.skipped_sizes}")
    if curve.run_id:
        lines.append(f"  MLflow run    {curve.run_id} (tag {TAG_ADAPTATION}); each training route is its own run")
    if curve.json_path:
        lines.append(f"  JSON          {curve.json_path} (draw_rows: each draw; test_probs: every score)")
    return "\n".join(lines)
