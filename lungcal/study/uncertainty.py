"""``lungcal uncertainty``: single model, +TS, MC dropout, deep ensemble and ensemble+TS on one test split.

Trains a deep ensemble with ``bundles/nlst_ensemble.json`` (or reuses one: ``parent_run``), then
evaluates from the members' checkpoints, on the same cases (issue 18, item 1):

* ``single``: member 0 (the focal recipe, seed ``seed``), one deterministic pass;
* ``single+TS``: the same with a temperature fitted on validation;
* ``MC dropout``: member 0, mean softmax of ``mc_samples`` seeded passes with dropout on
  (:func:`lungcal.ctapp.model.predict.predict_uncertainty`); ``MC dropout+TS``: TS on ``log`` of the mean;
* ``ensemble``: the average probability of the M members; ``ensemble+TS``: TS fitted on validation
  on the log of that average (pool, then calibrate), as the parent run of the bundle logs it.

Each row: test ECE and AUC with 95% bootstrap CIs, NLL, Brier, AURC (referral by confidence),
mean entropy and mutual information (nats), the paired-bootstrap ECE difference against ``single``,
and what the method costs (models; seconds of test inference on this machine). The ensemble row is
checked against the bundle's parent run (same ECE).

Under shift (Ovadia et al. 2019: which method degrades least when the scanner changes): with
``shift_datalist`` the same models, and the temperatures fitted on the *training site's* validation
split, also score the test split of another site's datalist, in a second table; nothing is refitted.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from monai.bundle import ConfigParser
from monai.bundle import run as bundle_run

from lungcal.calibration import aurc, paired_bootstrap_diff
from lungcal.calibration.scaling import make_calibrator, probabilities
from lungcal.ctapp.data.cohort import resolve_output_dir
from lungcal.ctapp.evaluate.reports import evaluate_probs
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.ctapp.model.predict import ensemble_uncertainty, predict_uncertainty
from lungcal.errors import ConfigError, TrackingError
from lungcal.runtime import resolve_device
from lungcal.tracking import MLFLOW_PARENT, TAG_ENSEMBLE, default_tracking_uri
from lungcal.tracking.tracker import open_store

__all__ = ["ENSEMBLE_BUNDLE", "score_models", "comparison_table", "compare_uncertainty"]

#: the ensemble recipe: the complete focal bundle and the ensemble's override file over it
ENSEMBLE_BUNDLE = ("bundles/nlst_focal.json", "bundles/nlst_ensemble.json")
_COLUMNS = ("| method | ECE | AUC | NLL | Brier | AURC | mean H | mean MI | ΔECE vs single [95% CI] | "
            "models; test inference |")


def score_models(nets: Sequence, loader, device, mc_samples: int, seed: int = 0) -> dict[str, Any]:
    """Deterministic passes of every member, MC dropout of member 0, and the ensemble, on one loader."""
    det, secs = [], []
    for net in nets:
        t0 = time.perf_counter()
        det.append(predict_uncertainty(net, loader, device, mc_samples=0))
        secs.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    mc = predict_uncertainty(nets[0], loader, device, mc_samples=mc_samples, seed=seed)
    return {"single": det[0], "mc": mc, "ensemble": ensemble_uncertainty(det), "secs": secs,
            "t_mc": time.perf_counter() - t0, "mc_samples": mc_samples, "member_probs": [d["probs"] for d in det]}


def _fmt(r: Mapping[str, float], key: str) -> str:
    return f"{r[key]:.3f} [{r[key + '_ci_low']:.3f}, {r[key + '_ci_high']:.3f}]"


def comparison_table(scored: Mapping[str, Any], labels, temps: Mapping[str, float], title: str, n_bins: int = 10,
                     n_bootstrap: int = 1000, seed: int = 0) -> tuple[list[str], dict[str, dict]]:
    """The Markdown lines of one test split: each method with and without its validation temperature.

    Args:
        scored: :func:`score_models` on the split.
        labels: the split's ``(N,)`` labels.
        temps: ``{"single", "mc", "ensemble"}`` temperatures fitted on validation.

    Returns:
        ``(lines, {row name: evaluate_probs report})``.
    """
    y = np.asarray(labels)
    secs, t_mc, m = scored["secs"], scored["t_mc"], len(scored["secs"])
    single, mc, ens = scored["single"], scored["mc"], scored["ensemble"]
    rows = [
        ("single (member 0)", single["probs"], None, f"1 model; {secs[0]:.1f} s"),
        (f"single+TS (T={temps['single']:.2f})", probabilities(single["logits"], temps["single"]), None,
         f"1 model; {secs[0]:.1f} s"),
        (f"MC dropout (T={scored['mc_samples']} passes)", mc["probs"], mc["mi"], f"1 model; {t_mc:.1f} s"),
        (f"MC dropout+TS (T={temps['mc']:.2f})", probabilities(mc["logits"], temps["mc"]), mc["mi"],
         f"1 model; {t_mc:.1f} s"),
        (f"ensemble of {m}", ens["probs"], ens["mi"], f"{m} models; {sum(secs):.1f} s"),
        (f"ensemble+TS (T={temps['ensemble']:.2f})", probabilities(ens["logits"], temps["ensemble"]), ens["mi"],
         f"{m} models; {sum(secs):.1f} s"),
    ]
    base = np.asarray(single["probs"], np.float64)
    lines = [title, "", _COLUMNS, "|---|---|---|---|---|---|---|---|---|---|"]
    reports = {}
    for i, (name, p, mi, cost) in enumerate(rows):
        p = np.asarray(p, np.float64)
        r = reports[name] = evaluate_probs(p, y, n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
        h = float(np.mean(-(p * np.log(np.where(p > 0, p, 1.0))).sum(1)))
        mi_s = "-" if mi is None else f"{float(np.mean(mi)):.4f}"
        diff = "-"
        if i:
            d = paired_bootstrap_diff("ece", p, base, y, n_bootstrap=n_bootstrap, seed=seed, n_bins=n_bins)
            diff = f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
        lines.append(f"| {name} | {_fmt(r, 'ece')} | {_fmt(r, 'auc')} | {r['nll']:.3f} | {r['brier']:.3f} | "
                     f"{aurc(p, y):.3f} | {h:.3f} | {mi_s} | {diff} | {cost} |")
    return lines, reports


def _files(bundle: str | Path | Sequence[str | Path]) -> list[str]:
    """A bundle's config files: one path, or a base and the files over it, in order."""
    return [str(bundle)] if isinstance(bundle, (str, Path)) else [str(b) for b in bundle]


def _parser(bundle: str | Path | Sequence[str | Path], overrides: Mapping[str, Any]) -> ConfigParser:
    parser = ConfigParser()
    parser.read_config(_files(bundle))
    for k, v in overrides.items():
        parser[k] = v
    return parser


def _parent_run(client, run_name: str):
    exps = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(exps, filter_string=f"tags.`{TAG_ENSEMBLE}` = 'parent' and "
                                                   f"attributes.run_name = '{run_name}'")
    if not found:
        raise TrackingError(f"the ensemble run '{run_name}' left no parent run in {client.tracking_uri}",
                            fix="see the bundle's log above")
    return found[0]


def _members(client, parent) -> list:
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`{MLFLOW_PARENT}` = '{parent.info.run_id}' and "
                                            f"tags.`{TAG_ENSEMBLE}` = 'member'")
    return sorted(runs, key=lambda r: int(r.data.params["seed"]))


def compare_uncertainty(parent_run: str | None = None, *, members: int = 3, epochs: int = 30, mc_samples: int = 20,
                        seed: int = 0, n_bootstrap: int = 1000, overrides: Mapping[str, Any] | None = None,
                        shift_datalist: str | Path | None = None,
                        bundle: str | Path | Sequence[str | Path] = ENSEMBLE_BUNDLE) -> str:
    """Train (or reuse) a deep ensemble and compare the uncertainty methods; the Markdown text.

    Args:
        parent_run: an ensemble parent run to reuse; ``None`` trains ``members`` members of
            ``epochs`` epochs with ``bundle`` (run from the project root: its ``%bundles/...`` macros).
        mc_samples: MC-dropout passes of member 0.
        overrides: other bundle keys (``datalist``, ``output_dir``, ``num_workers``, ``device``, ...).
        shift_datalist: also score this datalist's test split (another site), nothing refitted.
    """
    if mc_samples < 1:
        raise ConfigError(f"mc_samples must be at least 1, got {mc_samples}", field="--mc-samples",
                          fix="use e.g. --mc-samples 20")
    settings = {"seed": seed, "n_bootstrap": n_bootstrap, **dict(overrides or {})}
    parser = _parser(bundle, settings)
    tracking_uri = settings.get("tracking_uri") or default_tracking_uri(
        resolve_output_dir(parser.get_parsed_content("output_dir")))
    client = open_store(tracking_uri)
    t_train = None
    if parent_run is None:
        run_name = f"compare-uncertainty-{time.strftime('%Y%m%d-%H%M%S')}"
        t0 = time.perf_counter()
        no_logging_conf: Any = False  # MONAI skips its logging.conf on False (typed str | None)
        bundle_run(config_file=_files(bundle), logging_file=no_logging_conf, ensemble_members=members, epochs=epochs,
                   run_name=run_name, **settings)
        t_train = time.perf_counter() - t0
        parent = _parent_run(client, run_name)
    else:
        parent = client.get_run(parent_run)
    runs = _members(client, parent)
    if not runs:
        raise TrackingError(f"no member runs under {parent.info.run_id}", field="--parent-run",
                            fix="pass the parent run of a bundles/nlst_ensemble.json run")
    cohort = parser.get_parsed_content("cohort").load(("val", "test"))
    batch_size, n_bins = int(parser.get_parsed_content("batch_size")), int(parser.get_parsed_content("n_bins"))
    device = resolve_device(settings.get("device", "auto"))
    nets = [load_stage1(r.info.run_id, tracking_uri, device=device).network for r in runs]
    val = score_models(nets, cohort.loader("val", batch_size), device, mc_samples, seed)
    y_val = cohort.splits["val"]["labels"].numpy()
    temps = {k: float(make_calibrator("ts").fit(val[k]["logits"], y_val).temperature)
             for k in ("single", "mc", "ensemble")}
    test = score_models(nets, cohort.loader("test", batch_size), device, mc_samples, seed)
    y = cohort.splits["test"]["labels"].numpy()
    table = dict(n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)
    lines, reports = comparison_table(test, y, temps, f"test split n = {len(y)} ({int(y.sum())} cancers), 95% "
                                      f"bootstrap CIs ({n_bootstrap} resamples); parent run {parent.info.run_id}",
                                      **table)
    aucs = ", ".join(f"{evaluate_probs(p, y, n_bins=n_bins, n_bootstrap=0)['auc']:.3f}" for p in test["member_probs"])
    train_s = ", ".join(f"{(r.info.end_time - r.info.start_time) / 1000:.0f}" for r in runs)
    lines += ["", f"members' own test AUC: {aucs}; training wall time per member {train_s} s"
              + (f" (whole bundle run {t_train:.0f} s)" if t_train else ""),
              f"check: the parent run logged test/ece {parent.data.metrics.get('test/ece', float('nan')):.6f}; "
              f"recomputed here {reports[f'ensemble of {len(runs)}']['ece']:.6f}"]
    if shift_datalist:
        site = _parser(bundle, {**settings, "datalist": str(Path(shift_datalist).resolve())})
        site_cohort = site.get_parsed_content("cohort").load(("test",))
        scored = score_models(nets, site_cohort.loader("test", batch_size), device, mc_samples, seed)
        y_b = site_cohort.splits["test"]["labels"].numpy()
        shifted, _ = comparison_table(scored, y_b, temps, f"shifted site ({site_cohort.site}): test split n = "
                                      f"{len(y_b)} ({int(y_b.sum())} cancers); models and temperatures from the "
                                      "training site, nothing refitted", **table)
        lines += ["", *shifted]
    return "\n".join(lines)
