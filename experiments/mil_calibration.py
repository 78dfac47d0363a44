"""MIL-aware calibration on the synthetic cohort, measured at bag level and against the nodule truth (issue 18 item 3).

Trains two stage-1 models with the same bundle (default ``bundles/nlst_ce.json``, the paper's NLL
setting), on the same cohort, seed and epochs:

* ``base``: the bundle as it is (its loss, here cross-entropy);
* ``mmce``: the bundle with its ``loss`` section swapped for
  ``lungcal.calibration.losses.MMCELoss`` wrapping the same base loss (Kumar et al. 2018, MMCE_w at
  bag level, ``--lam``).

then compares, on the test split:

* ``none``: the base model as trained;
* ``(a) bag TS``: temperature scaling of the CT logit, fitted on validation;
* ``(b) pooling T``: one temperature dividing the instance scores inside the log-sum-exp pooling,
  fitted on validation with the network frozen (:func:`lungcal.mil.tempering.fit_pooling_temperature`);
* ``(c) MMCE``: the MMCE-trained model as trained (and ``(c)+TS``).

Bag level: ECE and AUC with 95% bootstrap CIs, NLL, Brier, the paired-bootstrap ECE difference
against ``none``. Instance level (:mod:`lungcal.ctapp.evaluate.instance_truth`): every candidate of every
test CT is matched to the phantom's nodules (LUNA16 rule: centre within the nodule's radius) and
labelled malignant / not; its probability is the model's posterior that this candidate is the
cancer (log-sum-exp: ``P(cancer) x`` its attention share, the leak in the denominator). Reported
per candidate (all candidates; false positives are "not malignant") and per detected nodule
(the probabilities of its candidates summed), ECE / AUC with CIs.

``--subset train=300,val=100,test=200`` keeps the first rows of each split of the datalist (in its
order) in ``<output-dir>/milcal_datalist.json``, for a run that fits the CPU budget; ``--stage
bags`` only builds the bags (series checks off: every demo phantom passes them).

    python experiments/mil_calibration.py --subset train=300,val=100,test=200 --epochs 60 --jobs 2 --output-dir runs
    python experiments/mil_calibration.py ... --lam 0.5 --base-run ID        # another MMCE weight, same base model
    python experiments/mil_calibration.py ... --base-run ID --mmce-run ID    # evaluate existing runs only

``--shift-datalist B.json`` also scores another site's test split (e.g. site B of
``tests/test_hospital_workflow.py``, whose ``annotations.csv`` beside the datalist holds its nodule
truth) with the same models and the temperatures fitted on the training site's validation split:
which view of calibration survives a scanner change, with nothing refitted.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient
from monai.bundle import ConfigParser
from monai.bundle import run as bundle_run

from lungcal.calibration import paired_bootstrap_diff
from lungcal.calibration.scaling import make_calibrator, probabilities
from lungcal.ctapp.data.cohort import resolve_output_dir
from lungcal.ctapp.evaluate.instance_truth import candidate_truth, instance_report, read_nodule_truth
from lungcal.ctapp.evaluate.reports import evaluate_probs
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.data.manifest import load_manifest, rows_for_split, save_manifest
from lungcal.data.synthetic import ensure_demo_cohort
from lungcal.mil.tempering import fit_pooling_temperature, instance_probabilities, pooled_logits, pooling_view
from lungcal.paths import atomic_write_text
from lungcal.runtime import resolve_device
from lungcal.tracking import default_tracking_uri

ROOT = Path(__file__).resolve().parents[1]


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/nlst_ce.json", help="the stage-1 recipe (default nlst_ce.json)")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lam", type=float, default=2.0, help="MMCE weight lambda (default 2.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datalist", default=None, help="datalist JSON (default: the synthetic demo cohort)")
    ap.add_argument("--annotations", default=None,
                    help="nodule truth CSV (default: annotations.csv beside the datalist the subset came from)")
    ap.add_argument("--subset", default=None, help="e.g. train=300,val=100,test=200: the first rows of each split")
    ap.add_argument("--output-dir", default=None, help="output_dir of the runs (default: the bundle's)")
    ap.add_argument("--stage", choices=("all", "bags"), default="all")
    ap.add_argument("--base-run", default=None, help="reuse this stage-1 run as the base model")
    ap.add_argument("--mmce-run", default=None, help="reuse this stage-1 run as the MMCE model")
    ap.add_argument("--jobs", type=int, default=1, help="2: train the two models at once, one process each")
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shift-datalist", default=None,
                    help="also score this datalist's test split (another site), nothing refitted")
    ap.add_argument("--shift-annotations", default=None,
                    help="its nodule truth (default: annotations.csv beside --shift-datalist)")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="any other bundle override, e.g. --set patch_size=8 (repeatable)")
    return ap.parse_args()


def _source_datalist(a, output_dir: Path) -> Path:
    if a.datalist:
        return Path(a.datalist).resolve()
    return Path(ensure_demo_cohort(output_dir / "data")).resolve()


def _subset(a, source: Path, output_dir: Path) -> Path:
    """The datalist of the run: ``source``, or its first rows per split (``--subset``)."""
    if not a.subset:
        return source
    sizes = {k: int(v) for k, v in (item.split("=") for item in a.subset.split(","))}
    rows = load_manifest(source)
    keep = [r for split, n in sizes.items() for r in rows_for_split(rows, split)[:n]]
    return save_manifest(keep, output_dir / "milcal_datalist.json", source="synthetic", site="synthetic")


def _overrides(a, datalist: Path, output_dir: Path) -> dict:
    o = {"seed": a.seed, "n_bootstrap": a.n_bootstrap, "num_workers": a.num_workers, "device": a.device,
         "datalist": str(datalist), "output_dir": str(output_dir), "qc": "$None", "epochs": a.epochs}
    for item in a.set:
        key, _, value = item.partition("=")
        o[key] = json.loads(value)
    return o


def _mmce_loss(parser: ConfigParser, lam: float) -> dict:
    """The bundle's ``loss`` section wrapped in MMCELoss (the config snippet of docs/architecture.md)."""
    return {"_target_": "lungcal.calibration.losses.MMCELoss", "base": parser.get("loss"), "lam": lam}


def _bundle_run(bundle: str, overrides: dict) -> None:
    os.chdir(ROOT)
    bundle_run(config_file=bundle, logging_file=False, **overrides)


def _run_id(run_name: str, tracking_uri: str) -> str:
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("nlst")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{run_name}'",
                              order_by=["attributes.start_time DESC"])
    stage1 = [r for r in runs if r.data.tags.get("lungcal.stage2", "none") in ("none", "")]
    return stage1[0].info.run_id


def _fmt(r: dict, key: str) -> str:
    return f"{r[key]:.3f} [{r[key + '_ci_low']:.3f}, {r[key + '_ci_high']:.3f}]"


def _table(views: dict, y: np.ndarray, split: dict, truth: dict, rows: list, a, n_bins: int, header: str):
    """Bag- and instance-level rows of one test split (``views``: each model's frozen pooling view)."""
    inst_y, nodule_of = candidate_truth(split["candidates"], split["subjects"], truth, split["mask"].numpy())
    p_ref = probabilities(pooled_logits(views["base"], 1.0).detach().numpy(), 1.0)
    valid = split["mask"].numpy()
    lines = [f"test split n = {len(y)} CTs ({int(y.sum())} cancers); {int(valid.sum())} candidates, "
             f"{int(inst_y[valid].sum())} on a malignant nodule; 95% bootstrap CIs ({a.n_bootstrap} resamples); "
             + header,
             "",
             "| method | bag ECE | bag AUC | bag NLL | ΔECE vs none | candidate ECE | candidate AUC | "
             "nodule ECE | nodule AUC |",
             "|---|---|---|---|---|---|---|---|---|"]
    rn = None
    for label, name, t_pool, t_bag in rows:
        p = probabilities(pooled_logits(views[name], t_pool).detach().numpy(), t_bag)
        r = evaluate_probs(p, y, n_bins=n_bins, n_bootstrap=a.n_bootstrap, seed=a.seed)
        if name == "base" and t_pool == 1.0 and t_bag == 1.0:
            diff = "-"
        else:
            d = paired_bootstrap_diff("ece", p, p_ref, y, n_bootstrap=a.n_bootstrap, seed=a.seed, n_bins=n_bins)
            diff = f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
        pi = instance_probabilities(views[name], t_pool, bag_temperature=t_bag)
        rc = instance_report(pi, inst_y, valid, view="candidates", n_bins=n_bins, n_bootstrap=a.n_bootstrap,
                             seed=a.seed)
        rn = instance_report(pi, inst_y, valid, view="nodules", nodule_of=nodule_of, n_bins=n_bins,
                             n_bootstrap=a.n_bootstrap, seed=a.seed)
        lines.append(f"| {label} | {_fmt(r, 'ece')} | {_fmt(r, 'auc')} | {r['nll']:.3f} | {diff} | "
                     f"{_fmt(rc, 'ece')} | {_fmt(rc, 'auc')} | {_fmt(rn, 'ece')} | {_fmt(rn, 'auc')} |")
    return lines, rn


def main() -> int:
    a = _args()
    os.chdir(ROOT)  # the bundle's % macros resolve from the project root
    parser = ConfigParser()
    parser.read_config(a.bundle)
    output_dir = resolve_output_dir(a.output_dir or parser.get_parsed_content("output_dir"))
    source = _source_datalist(a, output_dir)
    datalist = _subset(a, source, output_dir)
    overrides = _overrides(a, datalist, output_dir)
    for k, v in overrides.items():
        parser[k] = v
    cohort = parser.get_parsed_content("cohort")
    t0 = time.perf_counter()
    cohort.load()
    print(f"bags ready in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{s} {len(cohort.splits[s]['subjects'])}" for s in ("train", "val", "test")), flush=True)
    if a.stage == "bags":
        return 0
    tracking_uri = default_tracking_uri(output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    train_s = {}
    base_id, mmce_id = a.base_run, a.mmce_run
    todo = {}
    if base_id is None:
        todo["base"] = {**overrides, "run_name": f"milcal-base-{stamp}"}
    if mmce_id is None:
        todo["mmce"] = {**overrides, "run_name": f"milcal-mmce-{stamp}", "loss": _mmce_loss(parser, a.lam),
                        "method": "mmce"}
    t0 = time.perf_counter()
    if a.jobs > 1 and len(todo) > 1:  # both trainings at once, one process each
        MlflowClient(tracking_uri).search_experiments()  # create the store first: two first openings race
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_bundle_run, args=(a.bundle, o)) for o in todo.values()]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
        if any(pr.exitcode != 0 for pr in procs):
            print("a training process failed", file=sys.stderr)
            return 1
        train_s = {f"{k} (in parallel)": time.perf_counter() - t0 for k in todo}
    else:
        for k, o in todo.items():
            t1 = time.perf_counter()
            _bundle_run(a.bundle, o)
            train_s[k] = time.perf_counter() - t1
    if "base" in todo:
        base_id = _run_id(todo["base"]["run_name"], tracking_uri)
    if "mmce" in todo:
        mmce_id = _run_id(todo["mmce"]["run_name"], tracking_uri)

    device = resolve_device(a.device)
    batch_size = int(parser.get_parsed_content("batch_size"))
    n_bins = int(parser.get_parsed_content("n_bins"))
    loaders = {s: cohort.loader(s, batch_size) for s in ("val", "test")}
    y = {s: cohort.splits[s]["labels"].numpy() for s in ("val", "test")}
    annotations = Path(a.annotations) if a.annotations else source.parent / "annotations.csv"
    truth = read_nodule_truth(annotations, key="subject")

    views, fits = {}, {}
    for name, run_id in (("base", base_id), ("mmce", mmce_id)):
        net = load_stage1(run_id, tracking_uri, device=device).network
        t0 = time.perf_counter()
        views[name] = {s: pooling_view(net, loaders[s], device) for s in ("val", "test")}
        fits[name + "_view_s"] = time.perf_counter() - t0
    for s in ("val", "test"):  # the cohort's order: the same CTs as the labels
        assert np.array_equal(views["base"][s].labels.numpy(), y[s])

    def bag_logits(name: str, split: str, t_pool: float = 1.0) -> np.ndarray:
        return pooled_logits(views[name][split], t_pool).detach().numpy()

    t0 = time.perf_counter()
    ts = {n: float(make_calibrator("ts").fit(bag_logits(n, "val"), y["val"]).temperature) for n in ("base", "mmce")}
    fits["ts_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool = fit_pooling_temperature(view=views["base"]["val"])
    fits["pool_s"] = time.perf_counter() - t0
    rows = [
        (f"none ({parser.get('method')} as trained)", "base", 1.0, 1.0),
        (f"(a) bag TS, T={ts['base']:.2f}", "base", 1.0, ts["base"]),
        (f"(b) pooling T={pool.temperature:.2f}", "base", pool.temperature, 1.0),
        (f"(c) MMCE λ={a.lam:g}", "mmce", 1.0, 1.0),
        (f"(c) MMCE + bag TS, T={ts['mmce']:.2f}", "mmce", 1.0, ts["mmce"]),
    ]
    test = {n: views[n]["test"] for n in views}
    lines, rn = _table(test, y["test"], cohort.splits["test"], truth, rows, a, n_bins,
                       f"runs base {base_id}, mmce {mmce_id}")
    lines += ["", f"detected nodules on the test CTs: {rn['n']} ({rn['n_positive']} malignant); pooling-T fit: "
                  f"{pool.method}, val NLL {pool.nll_before:.4f} -> {pool.nll_after:.4f}"
                  + (" (at its bound)" if pool.at_bound else ""),
              "cost: training " + ", ".join(f"{k} {v:.0f} s" for k, v in train_s.items())
              + f"; one frozen pass over val+test {fits['base_view_s']:.1f} s; fitting bag TS (both models) "
                f"{fits['ts_s']:.2f} s, pooling T {fits['pool_s']:.2f} s"]
    if a.shift_datalist:
        shifted = ConfigParser()
        shifted.read_config(a.bundle)
        for k, v in {**overrides, "datalist": str(Path(a.shift_datalist).resolve())}.items():
            shifted[k] = v
        site = shifted.get_parsed_content("cohort").load(("test",))
        shift_truth = read_nodule_truth(Path(a.shift_annotations) if a.shift_annotations
                                        else Path(a.shift_datalist).parent / "annotations.csv", key="subject")
        shift_views = {}
        for name, run_id in (("base", base_id), ("mmce", mmce_id)):
            net = load_stage1(run_id, tracking_uri, device=device).network
            shift_views[name] = pooling_view(net, site.loader("test", batch_size), device)
        table, _ = _table(shift_views, site.splits["test"]["labels"].numpy(), site.splits["test"], shift_truth, rows,
                          a, n_bins, f"shifted site ({site.site}); models and temperatures from the training site, "
                                     "nothing refitted")
        lines += ["", *table]
    text = "\n".join(lines)
    print(text, flush=True)
    if a.out:
        atomic_write_text(Path(a.out), text + "\n")
    if train_s:
        print(json.dumps({"base_run": base_id, "mmce_run": mmce_id}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
