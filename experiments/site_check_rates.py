"""How often does ``lungcal site-check`` cry wolf, and how often does it see a real scanner change?

Trains one small stage-1 model on a synthetic 5 mm cohort (the bundle, a few epochs), then runs the site
check (its defaults: alpha 0.05, 1000 permutations, 20 subsamples) on

- ``same``: random 30-CT draws from a second cohort of the same scanner and prevalence (false alarms:
  any verdict but ``comparable`` ... and ``scanner_shift`` in particular);
- ``prevalence``: random 30-CT draws from a same-scanner cohort at prevalence 0.11 (must not be called a
  scanner change);
- graded scanner changes, each at three strengths, 30 CTs each: noise, kernel, HU offset, slice thickness.

Everything lives under OUT (resumable: cohorts and the model are made once; results.json is rewritten as
results come). Prints the tables that ``docs/results.md`` holds.

    python experiments/site_check_rates.py OUT [--draws 20] [--epochs 12]
    python experiments/site_check_rates.py OUT --preset demo --run <stage-1 run id> --store <its output_dir>

``--preset demo`` checks an existing model trained at the demo's 2.5 mm preset (e.g. README command 1's):
its sites are 128 x 128 x 96 DICOM phantoms at 2.5 mm (as the demo's), its slice changes 2.0 and 3.0 mm (the
series checks' default limit is 3 mm, and they keep their defaults).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.ct.qc import QCConfig
from lungcal.ctapp.site.site_check import site_check
from lungcal.data.synthetic import make_cohort
from lungcal.paths import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
SHAPE, SPACING = (64, 64, 48), (5.0, 5.0, 5.0)
QC = {"max_slice_thickness_mm": 12.0, "warn_slice_thickness_mm": 12.0, "max_pixel_mm": 6.0}
#: (name, strength label, make_cohort keyword arguments) of the graded scanner changes; the training
#: scanner is the default ScannerProfile (noise 20 HU, kernel 0.7 mm, offset 0, 5 mm slices sampled)
#: the demo preset's grid and its graded slice changes (128 x 128 x 96 at 2.5 mm: 320 x 320 x 240 mm)
DEMO_SHAPE, DEMO_SPACING = (128, 128, 96), (2.5, 2.5, 2.5)
DEMO_SLICES = [
    ("slice", "2.0 mm", {"spacing": (2.5, 2.5, 2.0), "shape": (128, 128, 120)}),
    ("slice", "3.0 mm", {"spacing": (2.5, 2.5, 3.0), "shape": (128, 128, 80)}),
]
GRADED = [
    ("noise", "26 HU", {"scanner": {"noise_hu": 26.0}}),
    ("noise", "32 HU", {"scanner": {"noise_hu": 32.0}}),
    ("noise", "40 HU", {"scanner": {"noise_hu": 40.0}}),
    ("kernel", "1.2 mm", {"scanner": {"kernel_sigma_mm": 1.2}}),
    ("kernel", "1.8 mm", {"scanner": {"kernel_sigma_mm": 1.8}}),
    ("kernel", "2.5 mm", {"scanner": {"kernel_sigma_mm": 2.5}}),
    ("hu_offset", "+15 HU", {"scanner": {"hu_offset": 15.0}}),
    ("hu_offset", "+30 HU", {"scanner": {"hu_offset": 30.0}}),
    ("hu_offset", "+60 HU", {"scanner": {"hu_offset": 60.0}}),
    ("slice", "6 mm", {"spacing": (5.0, 5.0, 6.0), "shape": (64, 64, 40)}),
    ("slice", "7.5 mm", {"spacing": (5.0, 5.0, 7.5), "shape": (64, 64, 32)}),
    ("slice", "10 mm", {"spacing": (5.0, 5.0, 10.0), "shape": (64, 64, 24)}),
]


def cohort(out: Path, name: str, n: int, prevalence: float, seed: int, demo: bool = False, **kw) -> Path:
    folder = out / "cohorts" / name
    dl = folder / "datalist.json"
    if not dl.is_file():
        kw.setdefault("shape", DEMO_SHAPE if demo else SHAPE)
        kw.setdefault("spacing", DEMO_SPACING if demo else SPACING)
        fmt = ("dicom",) if demo else ("nifti",)  # as the demo cohort is written (its series info, its HU integers)
        make_cohort(folder, n_subjects=n, prevalence=prevalence, seed=seed, formats=fmt, progress=False, **kw)
    return dl


def train(out: Path, datalist: Path, epochs: int) -> str:
    store = out / "model"
    uri = f"sqlite:///{store / 'mlflow.db'}"
    if (store / "mlflow.db").is_file():
        client = MlflowClient(uri)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  "tags.`lungcal.stage2` = 'none' and attributes.status = 'FINISHED'")
        if runs:
            return runs[0].info.run_id
    qc = json.dumps({"_target_": "lungcal.ct.qc.QCConfig", **QC})
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/nlst_focal.json",
           "--output_dir", str(store), "--datalist", str(datalist), "--epochs", str(epochs), "--n_bootstrap", "200",
           "--num_workers", "0", "--spacing", "[5.0, 5.0, 5.0]", "--patch_size", "8", "--batch_size", "4",
           "--test_pictures", "none", "--qc", qc]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return train(out, datalist, epochs)


def draw(datalist: Path, k: int, seed: int, out: Path) -> Path:
    rows = json.loads(datalist.read_text())["rows"]
    pick = [{**r, "image": str((datalist.parent / r["image"]).resolve())} for r in random.Random(seed).sample(rows, k)]
    path = out / f"{datalist.parent.name}_draw{seed}.json"
    path.write_text(json.dumps({"version": 1, "source": f"site:{datalist.parent.name}", "rows": pick}))
    return path


def _far(case: dict) -> bool:
    return case.get("embedding_distance", 0.0) > case.get("embedding_threshold", float("inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--n", type=int, default=30, help="CTs per site")
    ap.add_argument("--preset", choices=("small", "demo"), default="small",
                    help="small: train a 5 mm model here; demo: check --run at the demo's 2.5 mm preset")
    ap.add_argument("--run", default=None, help="with --preset demo: the stage-1 run id to check")
    ap.add_argument("--store", default=None, help="with --preset demo: that run's output_dir (its mlflow.db)")
    ap.add_argument("--num-workers", type=int, default=0)
    args = ap.parse_args()
    demo = args.preset == "demo"
    if demo and not (args.run and args.store):
        ap.error("--preset demo needs --run and --store")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    t0 = time.time()
    if demo:
        run, store = args.run, Path(args.store).resolve()
    else:
        run = train(out, cohort(out, "train", 200, 0.4, 1), args.epochs)
        store = out / "model"
    uri = f"sqlite:///{store / 'mlflow.db'}"
    qc = QCConfig() if demo else QCConfig(**QC)
    print(f"model {run} ({time.time() - t0:.0f} s)", flush=True)
    sites = []
    same = cohort(out, "same", 100, 0.4, 2, demo)
    prev = cohort(out, "prevalence", 100, 0.11, 3, demo)
    (out / "draws").mkdir(exist_ok=True)
    for i in range(args.draws):
        sites.append((f"same/{i}", "same", "", draw(same, args.n, i, out / "draws")))
        sites.append((f"prevalence/{i}", "prevalence", "0.11", draw(prev, args.n, i, out / "draws")))
    graded = [g for g in GRADED if g[0] != "slice"] + DEMO_SLICES if demo else GRADED
    for j, (kind, label, kw) in enumerate(graded):
        sites.append((f"{kind}/{label}", kind, label, cohort(out, f"{kind}_{label.replace(' ', '')}", args.n, 0.4,
                                                              10 + j, demo, **kw)))
    for key, kind, label, dl in sites:
        if key in results:
            continue
        t1 = time.time()
        res = site_check(run, dl, tracking_uri=uri, output_dir=store, qc=qc, log=False, num_workers=args.num_workers)
        results[key] = {"kind": kind, "label": label, "verdict": res.verdict, "prevalence": res.prevalence,
                        "tests": {k: v["pvalue"] for k, v in res.tests.items()},
                        "acquisition": {k: [v["outside"], v["n"], v["pvalue"]] for k, v in res.acquisition.items()},
                        "n_flagged": sum(1 for c in res.per_ct if c["flagged"]), "n": res.n,
                        "n_flagged_acquisition": sum(1 for c in res.per_ct if c["acquisition_outside"]),
                        "n_flagged_embedding": sum(1 for c in res.per_ct if _far(c)),
                        "seconds": time.time() - t1}
        atomic_write_text(results_path, json.dumps(results, indent=1))
        print(f"{key:<22} {res.verdict:<17} q={res.prevalence:.2f} "
              + " ".join(f"{k}={v['pvalue']:.3f}" for k, v in res.tests.items()), flush=True)
    report(results)


def report(results: dict) -> None:
    def rate(keys, verdict):
        v = [results[k]["verdict"] == verdict for k in keys]
        return sum(v), len(v)

    same = [k for k, r in results.items() if r["kind"] == "same"]
    prev = [k for k, r in results.items() if r["kind"] == "prevalence"]
    print("\n| sites | n | comparable | prevalence_shift | scanner_shift |\n|---|---|---|---|---|")
    for name, keys in (("same scanner, same prevalence", same), ("same scanner, prevalence 0.11", prev)):
        cells = [f"{rate(keys, v)[0]}/{len(keys)}" for v in ("comparable", "prevalence_shift", "scanner_shift")]
        print(f"| {name} | {len(keys)} | " + " | ".join(cells) + " |")
    print("\n| change | strength | verdict | re-weighted outputs p | embeddings p | acquisition fields flagged |"
          "\n|---|---|---|---|---|---|")
    for r in results.values():
        if r["kind"] in ("same", "prevalence"):
            continue
        flagged = [f"{f} {o}/{n}" for f, (o, n, p) in r["acquisition"].items() if o]
        print(f"| {r['kind']} | {r['label']} | {r['verdict']} | {r['tests']['outputs_beyond_prevalence']:.3f} | "
              f"{r['tests'].get('embeddings_beyond_prevalence', float('nan')):.3f} | {', '.join(flagged) or '-'} |")
    for name, keys in (("same-scanner draws", same), ("prevalence-0.11 draws", prev)):
        total = sum(results[k]["n"] for k in keys)
        print(f"per-CT flags on {name}: {sum(results[k]['n_flagged'] for k in keys)}/{total} (acquisition "
              f"{sum(results[k].get('n_flagged_acquisition', 0) for k in keys)}, embedding "
              f"{sum(results[k].get('n_flagged_embedding', 0) for k in keys)})")
    print("mean prevalence estimate: same "
          f"{np.mean([results[k]['prevalence'] for k in same]):.2f}, prevalence-0.11 "
          f"{np.mean([results[k]['prevalence'] for k in prev]):.2f}")


if __name__ == "__main__":
    main()
