"""Control for the two-site workflow: the same hospital population as site B (prevalence 0.11, 600 CTs,
300 val / 300 test), scanned on site A's scanner, so the only change from A is the prevalence (a
pure label shift, the assumption of the prior adjustment and of EM). Runs ``lungcal recalibrate``
with ``--prevalence`` and ``--unlabelled`` on the model a finished slow-test folder trained on A,
and prints one JSON line (docs/results.md, "Two sites: label shift alone"), with the spread of
the EM estimate over 1000 bootstrap resamples of the unlabelled CTs.

    pytest -m slow tests/test_hospital_workflow.py -s --basetemp=/tmp/hosp   # trains on A (pass or fail)
    python scripts/two_site_label_shift.py /tmp/hosp/test_two_site_recalibration0 [SEED]
"""
import json
import sys
from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.calibration.prior import estimate_prior_em
from lungcal.calibration.scaling import calibrated_probs
from lungcal.cli import main
from lungcal.data.manifest import load_manifest, rows_for_split
from lungcal.data.synthetic import make_cohort
from lungcal.engine.evaluate.calibrators import reference_calibrator
from lungcal.engine.model.checkpoint import load_stage1
from lungcal.engine.site.recalibrate import _predict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_hospital_workflow import SITE_A, SITE_B  # noqa: E402  (one definition of the two sites)

R = Path(sys.argv[1])
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 13
out = R / "runs"
uri = f"sqlite:///{out / 'mlflow.db'}"
# B's population (size, prevalence, splits) on A's scanner (shape, spacing, noise, kernel)
site = {**SITE_B, "seed": seed, "shape": SITE_A["shape"], "spacing": SITE_A["spacing"],
        "scanner": {**SITE_A["scanner"], "site": "site-b-on-a-scanner"}}
folder = R / f"site_b_on_a_scanner_{seed}"
datalist = folder / "datalist.json"
if not datalist.exists():
    make_cohort(folder, formats=("nifti",), progress=True, num_workers=2, **site)
val_images = [r["image"] for r in rows_for_split(load_manifest(datalist), "val")]
unl = folder / "val_unlabelled.json"
unl.write_text(json.dumps({"rows": [{"image": image} for image in val_images]}))

client = MlflowClient(uri)
exp = client.get_experiment_by_name("nlst")
s1 = [r for r in client.search_runs([exp.experiment_id], "attributes.run_name = 'site-a-ce'")
      if r.data.tags.get("lungcal.stage2") == "none"][0]
name = f"site-b-on-a-scanner-{seed}"
rc = main(["recalibrate", "--model", s1.info.run_id, "--datalist", str(datalist), "--tracking-uri", uri,
           "--output-dir", str(out), "--n-bootstrap", "1000", "--num-workers", "2", "--prevalence",
           str(SITE_B["prevalence"]), "--unlabelled", str(unl), "--site", name])
assert rc == 0, rc
r = client.search_runs([exp.experiment_id], f"tags.`lungcal.site` = '{name}'")[0]
m = r.data.metrics
rows = {"shipped": "test_reference_ts", "uncalibrated": "test_uncalibrated",
        f"auto ({r.data.params['chosen']})": "test", "prior": "test_prior", "em": "test_em"}
result = {"site": name, "A_auc": round(s1.data.metrics["test/auc"], 3),
          "priors": {k: round(m[k], 4) for k in ("source_prior", "site_prior", "em_prior")}}
for row, split in rows.items():
    result[row] = {k: round(m[f"{split}/{k}"], 4) for k in ("ece", "ece_ci_low", "ece_ci_high", "ece_pvalue",
                                                            "cal_intercept", "oe_ratio", "auc")}
# the EM estimate's spread: the same unlabelled CTs (bags cached by the run above), resampled
stage1 = load_stage1(s1.info.run_id, uri)
unl_rows = [{"image": image, "label": 0} for image in val_images]  # label unused: EM sees probabilities only
probs = calibrated_probs(reference_calibrator(uri, stage1.run),
                         _predict(stage1.network, unl_rows, stage1.bag_params, out / "cache" / "bags", 2)["logits"])
rng = np.random.default_rng(0)
boot = [estimate_prior_em(probs[rng.integers(0, len(probs), len(probs))], m["source_prior"]) for _ in range(1000)]
result["em_prior_bootstrap"] = {"estimate": round(estimate_prior_em(probs, m["source_prior"]), 4),
                                "ci95": [round(float(q), 4) for q in np.percentile(boot, [2.5, 97.5])],
                                "mean_shipped_prob": round(float(np.mean(probs[:, 1])), 4)}
print(json.dumps(result), flush=True)
