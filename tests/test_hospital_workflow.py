"""The hospital workflow end to end on two synthetic sites from different scanners, on the default model.

Site A (the reference, "trained elsewhere"): an enriched cohort (prevalence 0.4, like a
case-control training set), 2.5 mm isotropic, low noise. Site B (the hospital): a screening
population (prevalence 0.11, NLST-like; 600 CTs, all for recalibration: 300 val / 300 test),
anisotropic 1.8 x 1.8 x 3.0 mm voxels, a softer kernel and twice the noise. A stage-1 model is
trained on A with the real bundle as shipped (``bundles/nlst_focal.json`` + ``nlst_ce.json``, ``--datalist A``; only the
run length, the bootstrap size and the workers are set), which also fits A's *reference*
temperature on A's validation split. ``lungcal recalibrate --model <run> --datalist B
--prevalence 0.11 --unlabelled <B's val CTs without labels> --force`` then scores B's test split with the
model as shipped and with every recalibrator, fitted on B's validation split only (``--force``: the site
check that guards the label-free rows would refuse them on B's scanner; they are measured here regardless).

It must show (issue 14): the model as shipped is miscalibrated on B (consistency p-value of its
ECE < 0.05: ECE is biased upwards on small splits, so it is not compared with A's); the ``auto``
recalibrator brings B's test ECE below the shipped one, to a level consistent with a calibrated
model (p >= 0.05); the prior adjustment with B's true prevalence and the EM estimate on B's val
CTs without labels each lower the shipped ECE; TS, Platt and the prior adjustments leave the AUC
unchanged (isotonic may tie ranks: its AUC is reported). The numbers are printed (run with ``-s``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lungcal.cli import main
from lungcal.data.manifest import load_manifest, rows_for_split
from lungcal.data.synthetic import make_cohort

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
# checked the TS workflow on the former model (softmax attention, single orientation, lr 2e-3).
# Issue 14 (2026-12-01, night): recalibrators with an intercept (Platt, isotonic, prior adjustment,
# EM) exist now, so the test runs the bundle defaults as shipped, with no pinned head, flips or
# learning rate, and checks them (docs/hospital.md holds the measured table). First run (23:00):
# shipped ECE 0.768 (p < 0.001, O/E 0.135: the default model calls almost every B CT cancer), auto
# chose Platt: 0.012 (p 0.90); prior to 0.11: 0.359; EM ran to a prevalence of 1.000 and gave 0.880,
# so the EM assertion FAILED: B's shift is a scanner (covariate) shift, not only a label shift.
# 2026-12-02: B's 3.2 mm slices failed the default series checks (max 3.0 mm) that inference applies,
# and `recalibrate` now runs them too, so B is scanned at 3.0 mm (80 slices, the same 240 mm). The
# run trained with scanner-noise augmentation (augment_noise_hu 30, lungcal.engine.data.bagset
# random_noise) to test whether B's collapse is the model reading cancer into B's noise. It is not:
# B's AUC 0.518 [0.40, 0.62] (A 0.788), shipped ECE 0.617 (p < 0.001), auto = Platt 0.050 (p 0.042),
# prior 0.057, EM 1.000 (no signal): the AUC guard fails first (docs/results.md). The augmentation is
# off in the shipped bundles again; the test stays as the issue states it.
# 2026-12-02 (later): measured why (docs/results.md): B's kernel and resampled thick slices change
# which false positives fill a bag (larger, brighter, at the pleura), B's noise does not. With the
# scanner-kernel augmentation (augment_kernel_mm [1.5, 1.5, 2.0]) over seeds 0-2: A AUC 0.69-0.73, B AUC
# 0.55-0.58, B shipped ECE 0.10-0.21, auto = Platt passes (p 0.06-0.18), prior 0.05-0.09, EM fails
# (0.61-1.00 for 0.11); without it (seeds 0-1): A AUC 0.79-0.85, B AUC 0.52 (the guard fails), shipped
# 0.69-0.77, auto passes, EM 1.00. The augmentation costs in-domain ranking, so it ships off; the
# test stays as the issue states it.
# 2026-12-02, seed 0, docs/results.md "Resolution harmonization": detector log_weight
# 0.02 (fewer pleural false positives on B): A 0.732, B AUC 0.616, shipped 0.750, auto p 0.016, EM 1.000;
# harmonize 1.5 mm: A 0.799, B 0.606, shipped 0.378, auto p < 0.001, prior 0.079, EM 1.000; harmonize
# 2.0 mm: A 0.685, B 0.625, shipped 0.165, auto 0.043 (p 0.14), prior 0.027, EM 0.516 -> 0.225 > 0.165:
# fails at EM only. None passes, so none ships (2.0 mm costs A's AUC; 1.5 mm none measurable on the headline
# demo over two seeds: the candidate default); the test stays as the issue states it.
# 2026-12-02, seed 0 as shipped: A 0.785, B AUC 0.505 (guard), shipped 0.719, auto (Platt)
# 0.033 (p 0.23), prior 0.168, EM 1.000 -> 0.880. Control (results.md "Two sites: label shift alone": B's population on
# A's scanner, prevalence the only change): shipped 0.210 (p < 0.001), Platt 0.031 (p 0.21), prior 0.020
# (p 0.60), EM 0.019 -> 0.073, AUC 0.719: every assertion below holds there. The scanner fails the test.
SITE_A = dict(n_subjects=400, prevalence=0.4, seed=11, shape=(128, 128, 96), spacing=(2.5, 2.5, 2.5),
              scanner={"site": "site-a", "noise_hu": 20.0, "kernel_sigma_mm": 0.7, "hu_offset": 0.0})
SITE_B = dict(n_subjects=600, prevalence=0.11, splits=(0.0, 0.5, 0.5), seed=12, shape=(176, 176, 80),
              spacing=(1.8, 1.8, 3.0),
              scanner={"site": "site-b", "noise_hu": 40.0, "kernel_sigma_mm": 1.2, "hu_offset": 0.0})


#: rows of the recalibrate table whose map is monotone (ranking, hence AUC, unchanged)
MONOTONE = ("ts", "platt", "prior", "em")
KEYS = ("ece", "ece_ci_low", "ece_ci_high", "ece_pvalue", "cal_slope", "cal_slope_ci_low", "cal_slope_ci_high",
        "cal_intercept", "cal_intercept_ci_low", "cal_intercept_ci_high", "oe_ratio", "oe_ratio_ci_low",
        "oe_ratio_ci_high", "auc", "auc_ci_low", "auc_ci_high", "acc", "acc_ci_low", "acc_ci_high")


@pytest.mark.slow
@pytest.mark.timeout(7200)  # 17 min on 2 idle cores; an hour or more when the machine is shared
def test_two_site_recalibration(tmp_path, capsys):
    out = tmp_path / "runs"
    uri = f"sqlite:///{out / 'mlflow.db'}"
    a = make_cohort(tmp_path / "site_a", formats=("nifti",), progress=False, num_workers=2, **SITE_A)
    b = make_cohort(tmp_path / "site_b", formats=("nifti",), progress=False, num_workers=2, **SITE_B)

    # train on the reference site with the real stage-1 bundle as shipped (+ its linked TS run)
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file",
           "['bundles/nlst_focal.json','bundles/nlst_ce.json']",
           "--datalist", str(a), "--epochs", "40", "--output_dir", str(out), "--tracking_uri", uri,
           "--n_bootstrap", "500", "--num_workers", "2", "--run_name", "site-a-ce"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=5400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("nlst")
    s1 = client.search_runs([exp.experiment_id], "tags.`lungcal.stage2` = 'none'")[0]
    ts_a = client.search_runs([exp.experiment_id], f"tags.`lungcal.parent_run` = '{s1.info.run_id}'")[0]
    site_a = {"auc": s1.data.metrics["test/auc"], "ece": s1.data.metrics["test/ece"],
              "ece_reference_ts": ts_a.data.metrics["test/ece"], "temperature": ts_a.data.metrics["temperature"],
              "val_prevalence": s1.data.metrics["val/prevalence"]}

    # B's val CTs without their outcomes, for the EM estimate of B's prevalence
    unlabelled = tmp_path / "site_b_val_unlabelled.json"
    val_b = rows_for_split(load_manifest(b), "val")
    unlabelled.write_text(json.dumps({"rows": [{"image": row["image"]} for row in val_b]}))

    # the hospital: recalibrate on its own validation split, evaluate on its test split
    capsys.readouterr()
    rc = main(["recalibrate", "--model", s1.info.run_id, "--datalist", str(b), "--tracking-uri", uri,
               "--output-dir", str(out), "--n-bootstrap", "1000", "--num-workers", "2",
               "--prevalence", str(SITE_B["prevalence"]), "--unlabelled", str(unlabelled),
               # B is another scanner: the site check (run first) refuses the label-free rows; this test measures
               # them all the same, so it goes past the check, and the run records its verdict
               "--force"])
    summary = capsys.readouterr().out
    assert rc == 0, summary
    runs = client.search_runs([exp.experiment_id], "tags.`lungcal.site` = 'site-b'")
    assert len(runs) == 1
    r = runs[0]
    m, chosen = r.data.metrics, r.data.params["chosen"]
    assert r.data.tags["lungcal.parent_run"] == s1.info.run_id and r.data.tags["lungcal.calibrator"] == chosen
    assert r.data.params["fit_split"] == "val" and r.data.params["retrained"] == "False"
    assert r.data.params["site_check"] in ("comparable", "prevalence_shift", "scanner_shift", "unchecked")
    rows = [chosen] + sorted(k[len("test_"):-len("/ece")] for k in m if k.startswith("test_") and k.endswith("/ece"))
    numbers = {"site_a": site_a, "chosen": chosen, "fit_warning": r.data.tags.get("lungcal.fit_warning"),
               "priors": {k: m[k] for k in ("source_prior", "site_prior", "em_prior")},
               "temperature_b": m.get("temperature")}
    for row in rows:
        split = "test" if row == chosen else f"test_{row}"
        numbers[row] = {k: m[f"{split}/{k}"] for k in KEYS}
    with capsys.disabled():
        print("\nhospital workflow numbers:\n" + summary + "\n" + json.dumps(numbers, indent=2))
    shipped, before = numbers["reference_ts"], numbers["uncalibrated"]
    assert site_a["auc"] > 0.6 and before["auc"] > 0.55, "the model does not rank on B: the shift is too destructive"
    assert shipped["ece_pvalue"] < 0.05, "the model as shipped is not miscalibrated on site B: the shift is not real"
    auto = numbers[chosen]
    assert auto["ece"] < shipped["ece"], f"auto ({chosen}) did not lower B's test ECE below the shipped model's"
    assert auto["ece_pvalue"] >= 0.05, f"auto ({chosen}) left B's test ECE inconsistent with a calibrated model"
    assert numbers["prior"]["ece"] < shipped["ece"], "the prior adjustment to B's prevalence did not lower the ECE"
    assert numbers["em"]["ece"] < shipped["ece"], "the EM prior adjustment did not lower the ECE"
    for row in MONOTONE:
        assert numbers[row]["auc"] == pytest.approx(before["auc"], abs=1e-9), f"{row} changed the AUC"
    assert shipped["auc"] == pytest.approx(before["auc"], abs=1e-9)
    assert 0.0 <= numbers["isotonic"]["auc"] <= 1.0  # may tie ranks: reported, not asserted equal
