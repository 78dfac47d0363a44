"""Compare single model, +TS, MC dropout, deep ensemble and ensemble+TS on one test split (issue 18, item 1).

Trains a deep ensemble with ``bundles/nlst_ensemble.json`` (or reuses one: ``--parent-run``), then
evaluates from the members' checkpoints, on the same cases:

* ``single``: member 0 (the focal recipe, seed ``seed``), one deterministic pass;
* ``single+TS``: the same with a temperature fitted on validation;
* ``MC dropout``: member 0, mean softmax of ``--mc-samples`` seeded passes with dropout on
  (:func:`lungcal.engine.model.predict.predict_uncertainty`); ``MC dropout+TS``: TS on ``log`` of the mean;
* ``ensemble``: the average probability of the M members; ``ensemble+TS``: TS fitted on validation
  on the log of that average (pool, then calibrate), as the parent run of the bundle logs it.

Each row: test ECE and AUC with 95% bootstrap CIs, NLL, Brier, AURC (referral by confidence),
mean entropy and mutual information (nats), the paired-bootstrap ECE difference against ``single``,
and what the method costs (training: member runs' wall time; inference: seconds for the test split
on this machine). The ensemble row is checked against the bundle's parent run (same ECE). Prints a
Markdown table and writes it to ``--out`` when given.

    python scripts/compare_uncertainty.py --members 3 --epochs 30 --output-dir runs/uncertainty
    python scripts/compare_uncertainty.py --parent-run <id> --output-dir runs/uncertainty   # reuse

Under shift (Ovadia et al. 2019: which method degrades least when the scanner changes): with
``--shift-datalist B.json`` the same models, and the temperatures fitted on the *training site's*
validation split, are also scored on the test split of another site's datalist (e.g. site B of
``tests/test_hospital_workflow.py``), in a second table. Nothing is refitted on the shifted site.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient
from monai.bundle import ConfigParser
from monai.bundle import run as bundle_run

from lungcal.calibration import aurc, paired_bootstrap_diff
from lungcal.calibration.scaling import make_calibrator, probabilities
from lungcal.engine.data.cohort import resolve_output_dir
from lungcal.engine.evaluate.reports import evaluate_probs
from lungcal.engine.model.checkpoint import load_stage1
from lungcal.engine.model.predict import ensemble_uncertainty, predict_uncertainty
from lungcal.paths import atomic_write_text
from lungcal.runtime import resolve_device
from lungcal.tracking import MLFLOW_PARENT, TAG_ENSEMBLE, default_tracking_uri

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = "bundles/nlst_ensemble.json"


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=3, help="ensemble size M (default 3)")
    ap.add_argument("--epochs", type=int, default=30, help="epochs per member (the bundle's default is 120)")
    ap.add_argument("--mc-samples", type=int, default=20, help="MC-dropout passes T (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datalist", default=None, help="datalist JSON (default: the synthetic demo cohort)")
    ap.add_argument("--output-dir", default=None, help="output_dir of the runs (default: the bundle's)")
    ap.add_argument("--parent-run", default=None, help="reuse this ensemble parent run instead of training")
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--shift-datalist", default=None,
                    help="also score the test split of this datalist (another site), with nothing refitted")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="any other bundle override, e.g. --set patch_size=8 (repeatable)")
    return ap.parse_args()


def _overrides(a) -> dict:
    o = {"seed": a.seed, "n_bootstrap": a.n_bootstrap, "num_workers": a.num_workers, "device": a.device}
    if a.datalist:
        o["datalist"] = str(Path(a.datalist).resolve())
    if a.output_dir:
        o["output_dir"] = str(Path(a.output_dir).resolve())
    for item in a.set:
        key, _, value = item.partition("=")
        o[key] = json.loads(value)
    return o


def _parser(a) -> ConfigParser:
    parser = ConfigParser()
    parser.read_config(BUNDLE)
    for k, v in _overrides(a).items():
        parser[k] = v
    return parser


def _members(client: MlflowClient, parent_id: str):
    exp = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs([exp], filter_string=f"tags.`{MLFLOW_PARENT}` = '{parent_id}' and "
                                                   f"tags.`{TAG_ENSEMBLE}` = 'member'")
    return sorted(runs, key=lambda r: int(r.data.params["seed"]))


def _fmt(r: dict, key: str) -> str:
    return f"{r[key]:.3f} [{r[key + '_ci_low']:.3f}, {r[key + '_ci_high']:.3f}]"


def _score(nets, loader, device, a) -> dict:
    """Deterministic passes of every member, MC dropout of member 0, and the ensemble, on one loader."""
    det, secs = [], []
    for net in nets:
        t0 = time.perf_counter()
        det.append(predict_uncertainty(net, loader, device, mc_samples=0))
        secs.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mc = predict_uncertainty(nets[0], loader, device, mc_samples=a.mc_samples, seed=a.seed)
    t_mc = time.perf_counter() - t0
    return {"single": det[0], "mc": mc, "ensemble": ensemble_uncertainty(det), "secs": secs, "t_mc": t_mc,
            "member_probs": [d["probs"] for d in det]}


def _table(out: dict, y: np.ndarray, temps: dict, a, n_bins: int, m_count: int, title: str):
    """The Markdown rows of one test split: each method with and without its validation temperature."""
    secs, t_mc = out["secs"], out["t_mc"]
    p_single = out["single"]["probs"]
    ens_name = f"ensemble of {m_count}"
    rows = [
        ("single (member 0)", p_single, None, f"1 model; {secs[0]:.1f} s"),
        (f"single+TS (T={temps['single']:.2f})", probabilities(out["single"]["logits"], temps["single"]), None,
         f"1 model; {secs[0]:.1f} s"),
        (f"MC dropout (T={a.mc_samples} passes)", out["mc"]["probs"], out["mc"]["mi"], f"1 model; {t_mc:.1f} s"),
        (f"MC dropout+TS (T={temps['mc']:.2f})", probabilities(out["mc"]["logits"], temps["mc"]), out["mc"]["mi"],
         f"1 model; {t_mc:.1f} s"),
        (ens_name, out["ensemble"]["probs"], out["ensemble"]["mi"], f"{m_count} models; {sum(secs):.1f} s"),
        (f"ensemble+TS (T={temps['ensemble']:.2f})", probabilities(out["ensemble"]["logits"], temps["ensemble"]),
         out["ensemble"]["mi"], f"{m_count} models; {sum(secs):.1f} s"),
    ]
    lines = [title, "",
             "| method | ECE | AUC | NLL | Brier | AURC | mean H | mean MI | ΔECE vs single [95% CI] | "
             "models; test inference |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    reports = {}
    for name, p, mi, cost in rows:
        r = evaluate_probs(p, y, n_bins=n_bins, n_bootstrap=a.n_bootstrap, seed=a.seed)
        reports[name] = r
        h = float(np.mean(-(p * np.log(np.where(p > 0, p, 1.0))).sum(1)))
        mi_s = "-" if mi is None else f"{float(np.mean(mi)):.4f}"
        if p is p_single:
            diff = "-"
        else:
            d = paired_bootstrap_diff("ece", p, p_single, y, n_bootstrap=a.n_bootstrap, seed=a.seed, n_bins=n_bins)
            diff = f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
        lines.append(f"| {name} | {_fmt(r, 'ece')} | {_fmt(r, 'auc')} | {r['nll']:.3f} | {r['brier']:.3f} | "
                     f"{aurc(p, y):.3f} | {h:.3f} | {mi_s} | {diff} | {cost} |")
    return lines, reports


def main() -> int:
    a = _args()
    os.chdir(ROOT)  # the bundle's % macros resolve from the project root
    parser = _parser(a)
    output_dir = resolve_output_dir(parser.get_parsed_content("output_dir"))
    tracking_uri = default_tracking_uri(output_dir)
    run_name = f"compare-uncertainty-{time.strftime('%Y%m%d-%H%M%S')}"
    t_train = None
    if a.parent_run is None:
        t0 = time.perf_counter()
        bundle_run(config_file=BUNDLE, logging_file=False, ensemble_members=a.members, epochs=a.epochs,
                   run_name=run_name, **_overrides(a))
        t_train = time.perf_counter() - t0
        client = MlflowClient(tracking_uri)
        exp = client.get_experiment_by_name("nlst")
        parent = client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_ENSEMBLE}` = 'parent' and "
                                                                        f"attributes.run_name = '{run_name}'")[0]
    else:
        client = MlflowClient(tracking_uri)
        parent = client.get_run(a.parent_run)
    members = _members(client, parent.info.run_id)
    if not members:
        print(f"no member runs under {parent.info.run_id}", file=sys.stderr)
        return 1
    member_train_s = [(m.info.end_time - m.info.start_time) / 1000 for m in members]

    cohort = parser.get_parsed_content("cohort").load(("val", "test"))
    batch_size = int(parser.get_parsed_content("batch_size"))
    n_bins = int(parser.get_parsed_content("n_bins"))
    device = resolve_device(a.device)
    nets = [load_stage1(m.info.run_id, tracking_uri, device=device).network for m in members]
    val = _score(nets, cohort.loader("val", batch_size), device, a)
    y_val = cohort.splits["val"]["labels"].numpy()
    temps = {k: float(make_calibrator("ts").fit(val[k]["logits"], y_val).temperature)
             for k in ("single", "mc", "ensemble")}
    test = _score(nets, cohort.loader("test", batch_size), device, a)
    y = cohort.splits["test"]["labels"].numpy()
    lines, reports = _table(test, y, temps, a, n_bins, len(members),
                            f"test split n = {len(y)} ({int(y.sum())} cancers), 95% bootstrap CIs "
                            f"({a.n_bootstrap} resamples); parent run {parent.info.run_id}")
    ens_name = f"ensemble of {len(members)}"
    single_aucs = ", ".join(f"{evaluate_probs(p, y, n_bins=n_bins, n_bootstrap=0)['auc']:.3f}"
                            for p in test["member_probs"])
    lines += ["",
              f"members' own test AUC: {single_aucs}; training wall time per member "
              f"{', '.join(f'{s:.0f}' for s in member_train_s)} s"
              + (f" (whole bundle run {t_train:.0f} s)" if t_train else ""),
              f"check: the parent run logged test/ece {parent.data.metrics.get('test/ece', float('nan')):.6f}; "
              f"recomputed here {reports[ens_name]['ece']:.6f}"]
    if a.shift_datalist:
        shifted = _parser(a)
        shifted["datalist"] = str(Path(a.shift_datalist).resolve())
        site = shifted.get_parsed_content("cohort").load(("test",))
        out = _score(nets, site.loader("test", batch_size), device, a)
        y_b = site.splits["test"]["labels"].numpy()
        table_b, _ = _table(out, y_b, temps, a, n_bins, len(members),
                            f"shifted site ({site.site}): test split n = {len(y_b)} ({int(y_b.sum())} cancers); "
                            "models and temperatures from the training site, nothing refitted")
        lines += ["", *table_b]
    text = "\n".join(lines)
    print(text, flush=True)
    if a.out:
        atomic_write_text(Path(a.out), text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
