"""The defaults the headline trains on, decided at once (issue 43 item 4): the cohort, the bag, the scanners.

Three stage-1 models of ``bundles/nlst_focal.json`` (120 epochs unless ``--epochs``), each scored with its
reference calibrator (the TS its run fitted) and uncalibrated:

* **old**: the headline as it was (the classic nodule model, the solid LoG detector, K = 8), trained
  elsewhere; pass its run (``--old-run``, ``--old-tracking-uri``) or its checkpoint;
* **single**: the bundle as shipped now: the demo of every nodule type (``DEMO_DEFAULTS``: the
  screening type mix, masses in 15 % of the cancers), :class:`~lungcal.candidates.lesions.LesionDetector`,
  K = 16, one scanner;
* **mix**: the same, on the same patients acquired by the ``four_vendors`` scanner mix
  (``bundles/nlst_scanner_mix.json``'s cohort).

Three test sets: **home**, the single-scanner demo's 200 test CTs (the new test split); **home_mix**,
the same 200 patients acquired by the mix (the test split if the mix ships); and **site**, all
400 CTs of a site whose scanner neither model saw (``lungcal synth --n 400 --prevalence 0.4 --seed 7
--noise-hu 32 --kernel-mm 1.8``, as the 2026-12-04 site B, with the demo's nodule model): a soft
1.8 mm kernel (the mix's kernels are 0.5-1.5 mm) and 32 HU of noise.

Printed: each model's AUC and ECE (10 bins, none and TS) with 95 % bootstrap CIs on each set; paired
(2000 resamples): new - old on the test split each would ship with (the before/after of the
headline) and on site, mix - single on each set. The scanner rule, fixed before the scores were
seen: ship the model whose **worse AUC over home and site** is higher (a hospital is not the demo's
scanner; the model must serve both).

    python experiments/default_bag.py --output-dir runs/default_bag prepare
    python experiments/default_bag.py --output-dir runs/default_bag train            # single and mix
    python experiments/default_bag.py --output-dir runs/default_bag score \\
        --old-run <run id> --old-tracking-uri sqlite:///<old store>/mlflow.db --single-run <id> --mix-run <id>

Scores go to ``<output-dir>/default_bag_scores.npz`` (per model and set: probabilities, TS probabilities,
labels) and the tables to ``default_bag.json``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scanner_mix_pair import paired_datalists, run_bundle  # noqa: E402

from lungcal.calibration.measures.bootstrap import calibration_report  # noqa: E402
from lungcal.calibration.measures.significance import paired_bootstrap_diff  # noqa: E402
from lungcal.ctapp.evaluate.calibrators import reference_calibrator  # noqa: E402
from lungcal.ctapp.infer.scoring import score_rows  # noqa: E402
from lungcal.ctapp.model.checkpoint import load_stage1  # noqa: E402
from lungcal.data.manifest import load_manifest  # noqa: E402
from lungcal.data.synthetic.cohort import DEMO_DEFAULTS, cohort_datalist_path  # noqa: E402

SITE = ["--n", "400", "--prevalence", "0.4", "--seed", "7", "--noise-hu", "32", "--kernel-mm", "1.8",
        "--formats", "nii", "--site", "site-b"]
N_BINS = 10
N_BOOT = 2000


def site_datalist(out: Path, workers: int) -> Path:
    folder = out / "data" / "site_b"
    if not (folder / "datalist.json").is_file():
        cmd = [sys.executable, "-m", "lungcal.cli", "synth", "--out", str(folder), *SITE,
               "--nodule-types", str(DEMO_DEFAULTS["nodule_types"]), "--masses", str(DEMO_DEFAULTS["masses"]),
               "--workers", str(workers)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return folder / "datalist.json"


def prepare(args) -> dict[str, Path]:
    single, mixed = paired_datalists(args.output_dir, 1000, "four_vendors")
    return {"single": single, "mix": mixed, "site": site_datalist(args.output_dir, args.workers),
            "mix_own": cohort_datalist_path("demo", args.output_dir / "data", scanner_mix="four_vendors")}


def score_model(run: str, uri: str, rows: list[dict], cache_dir: Path, workers: int) -> dict[str, np.ndarray]:
    model = load_stage1(run, uri)
    cal = reference_calibrator(uri, model.run) if model.run is not None else None
    s = score_rows(model.network, rows, model.bag_params, cal, cache_dir=cache_dir, num_workers=workers)
    raw = torch.softmax(torch.as_tensor(s["logits"], dtype=torch.float64), dim=1).numpy()
    labels = np.asarray([int(r["label"]) for r in rows])
    return {"probs": raw, "probs_ts": np.asarray(s["probs"], np.float64), "labels": labels}


def summary(sc: dict[str, np.ndarray]) -> dict[str, float]:
    out = {}
    for key, probs in (("none", sc["probs"]), ("ts", sc["probs_ts"])):
        r = calibration_report(probs, sc["labels"], n_bins=N_BINS, n_bootstrap=N_BOOT)
        for m in ("auc", "ece", "acc"):
            out.update({f"{m}_{key}": r[m], f"{m}_{key}_lo": r[f"{m}_ci_low"], f"{m}_{key}_hi": r[f"{m}_ci_high"]})
    return out


def paired(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, dict]:
    assert np.array_equal(a["labels"], b["labels"])
    res = {}
    for metric, key in (("auc", "probs_ts"), ("ece", "probs"), ("ece", "probs_ts")):
        d = paired_bootstrap_diff(metric, a[key], b[key], a["labels"], n_bootstrap=N_BOOT, n_bins=N_BINS)
        res[f"{metric}_{'ts' if key == 'probs_ts' else 'none'}"] = {
            k: d[k] for k in ("diff", "ci_low", "ci_high", "p_value")}
    return res


def score(args) -> None:
    lists = prepare(args)
    home = [r for r in load_manifest(lists["single"]) if r["split"] == "test"]
    site = load_manifest(lists["site"])
    home_mix = [r for r in load_manifest(lists["mix_own"]) if r["split"] == "test"]
    uri = f"sqlite:///{args.output_dir / 'mlflow.db'}"
    models = {"old": (args.old_run, args.old_tracking_uri or uri), "single": (args.single_run, uri),
              "mix": (args.mix_run, uri)}
    store = args.output_dir / "default_bag_scores.npz"
    saved = dict(np.load(store)) if store.is_file() else {}
    scores: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, (run, muri) in models.items():
        if not run:
            continue
        for set_name, rows in (("home", home), ("site", site), ("home_mix", home_mix)):
            key = f"{name}__{set_name}"
            if f"{key}__probs" not in saved:
                print(f"scoring {name} ({run}) on {set_name}: {len(rows)} CTs", flush=True)
                sc = score_model(run, muri, rows, args.output_dir / "cache" / "bags", args.workers)
                saved.update({f"{key}__{k}": v for k, v in sc.items()})
                np.savez_compressed(store, **saved)
            scores[(name, set_name)] = {k: saved[f"{key}__{k}"] for k in ("probs", "probs_ts", "labels")}
    result: dict = {"runs": {k: v[0] for k, v in models.items()}, "models": {}, "paired": {}}
    for (name, set_name), sc in scores.items():
        result["models"][f"{name} on {set_name}"] = summary(sc)
    pairs = [("single", "old", "home"), ("mix", "old", "home_mix"), ("single", "old", "site"),
             ("mix", "single", "home"), ("mix", "single", "site"), ("mix", "single", "home_mix")]
    for a, b, s in pairs:
        if (a, s) in scores and (b, s) in scores:
            result["paired"][f"{a} - {b} on {s}"] = paired(scores[(a, s)], scores[(b, s)])
    if all((m, s) in scores for m in ("single", "mix") for s in ("home", "site")):
        worst = {m: min(result["models"][f"{m} on {s}"]["auc_ts"] for s in ("home", "site")) for m in ("single", "mix")}
        result["scanner_rule"] = {"worse_auc": worst, "ship": max(worst, key=worst.get)}
    (args.output_dir / "default_bag.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=("prepare", "train", "score"))
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--old-run", default=None, help="the old headline's run id (or checkpoint path)")
    p.add_argument("--old-tracking-uri", default=None, help="the store that holds it")
    p.add_argument("--single-run", default=None)
    p.add_argument("--mix-run", default=None)
    args = p.parse_args()
    args.output_dir = args.output_dir.absolute()
    args.subjects = 1000
    if args.stage == "prepare":
        print(json.dumps({k: str(v) for k, v in prepare(args).items()}, indent=1))
    elif args.stage == "train":
        lists = prepare(args)
        single = run_bundle(lists["single"], args, f"single-new-e{args.epochs}")
        mix = run_bundle(lists["mix"], args, f"mix-new-e{args.epochs}")
        print(json.dumps({"single": single, "mix": mix}), flush=True)
    else:
        score(args)


if __name__ == "__main__":
    main()
