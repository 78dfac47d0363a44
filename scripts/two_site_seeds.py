"""Seed scan of the two-site workflow: per seed, train ``bundles/nlst_ce.json`` on site A exactly as
``tests/test_hospital_workflow.py`` does (with or without the scanner-kernel augmentation), then run
``lungcal recalibrate`` on site B; print one JSON line per run (docs/results.md, "Seed scan").

It reuses a finished slow-test folder (its two cohorts, bag caches and MLflow store), e.g. from
``pytest -m slow tests/test_hospital_workflow.py --basetemp=/tmp/hosp``:

    python scripts/two_site_seeds.py /tmp/hosp/test_two_site_recalibration0 on 1,2,3
    python scripts/two_site_seeds.py /tmp/hosp/test_two_site_recalibration0 off 0,1
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

from lungcal.cli import main
from lungcal.data.manifest import load_manifest, rows_for_split

ROOT = Path(__file__).resolve().parents[1]
R = Path(sys.argv[1])
out = R / "runs"
uri = f"sqlite:///{out / 'mlflow.db'}"
a, b = R / "site_a" / "datalist.json", R / "site_b" / "datalist.json"
unl = R / "site_b_val_unlabelled.json"
if not unl.exists():
    unl.write_text(json.dumps({"rows": [{"image": r["image"]} for r in rows_for_split(load_manifest(b), "val")]}))
client = MlflowClient(uri)
KERNEL = {"on": "[1.5, 1.5, 2.0]", "off": "0"}
METRICS = {"B_auc": "test_uncalibrated/auc", "B_shipped_ece": "test_reference_ts/ece",
           "B_shipped_p": "test_reference_ts/ece_pvalue", "B_shipped_oe": "test_reference_ts/oe_ratio",
           "auto_ece": "test/ece", "auto_p": "test/ece_pvalue", "prior_ece": "test_prior/ece",
           "em_prior": "em_prior", "em_ece": "test_em/ece"}
aug = sys.argv[2]
for seed in [int(x) for x in sys.argv[3].split(",")]:
    name = f"seedscan-{aug}-{seed}"
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/nlst_ce.json",
           "--datalist", str(a), "--epochs", "40", "--output_dir", str(out), "--tracking_uri", uri,
           "--n_bootstrap", "200", "--num_workers", "2", "--run_name", name, "--seed", str(seed),
           "--augment_kernel_mm", KERNEL[aug]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    exp = client.get_experiment_by_name("nlst")
    s1 = [r for r in client.search_runs([exp.experiment_id], f"attributes.run_name = '{name}'")
          if r.data.tags.get("lungcal.stage2") == "none"][0]
    rc = main(["recalibrate", "--model", s1.info.run_id, "--datalist", str(b), "--tracking-uri", uri,
               "--output-dir", str(out), "--n-bootstrap", "200", "--num-workers", "2", "--prevalence", "0.11",
               "--unlabelled", str(unl), "--site", f"site-b-{aug}-{seed}"])
    assert rc == 0
    r = [x for x in client.search_runs([exp.experiment_id], f"tags.`lungcal.parent_run` = '{s1.info.run_id}'")
         if "em_prior" in x.data.metrics][0]
    row = {"aug": aug, "seed": seed, "A_auc": round(s1.data.metrics["test/auc"], 3), "chosen": r.data.params["chosen"],
           **{k: round(r.data.metrics[v], 3) for k, v in METRICS.items()}}
    print(json.dumps(row), flush=True)
