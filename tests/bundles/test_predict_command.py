"""``lungcal predict PATH --run ID`` and ``bundles/inference.json``: one code path, one linked MLflow run each.

A tiny stage-1 model is trained on the session's tiny cohort with the real bundle; then CTs
without labels are scored from a single NIfTI file, a folder of DICOM series and a datalist whose
rows hold only ``image``. Checked: the per-CT JSON (the reference TS applied, referral by the
post-hoc run's validation threshold or ``--refer-below``, top candidates in mm by attention, MC
member samples through the same calibrator), the PNGs (decode, expected size), the local key
``inputs.csv`` (and that it stays out of MLflow), the MLflow run (linked to the model's run,
FINISHED, params and artifacts, no input path anywhere in it), and bad input (exit 2, one line,
no run left RUNNING). A case folder as a user has it (issue 34 item 6: the CT, its nodule mask, XML and
CSV, an unreadable and a single-slice CT beside it): ``predict`` and ``qc`` read it the same way, the
mask and the other files are skipped by name, the two bad CTs are refused with their reasons while
the good one is scored (exit 2), the key lists everything, and a run that breaks off is tagged
``failed``; the same around the real LIDC scan where ``../shared/data/ct`` has it. Out of its depth (issue 32
item 7): the real scan (0.7 mm pixels, 2.5 mm slices) lies outside the tiny model's 5 mm training data, so it
is flagged and referred (line, JSON, CSV, picture), a CT like the training ones is not, and every answer of
this synthetic model says it is a demo; a site's prior adjustment whose site check found a scanner shift is
refused, and applied with a warning when the recalibration was forced.
"""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import SimpleITK as sitk
import torch
from mlflow.tracking import MlflowClient
from monai.bundle import run
from PIL import Image

from lungcal.calibration.guarantee import MissedCancerGuarantee
from lungcal.calibration.prior import PriorAdjusted
from lungcal.calibration.scaling import PlattScaler, calibrated_probs
from lungcal.calibration.selective import REFERRAL_METRIC, referral_threshold
from lungcal.calibration.shift import EmbeddingRange
from lungcal.cli import main
from lungcal.ct.acquisition import AcquisitionStats, summarize_acquisitions
from lungcal.ctapp.evaluate.calibrators import SITE_CHECK_PARAM, SITE_CHECK_RUN_PARAM, reference_calibrator
from lungcal.ctapp.evaluate.cases import (
    DEMO_NOTICE,
    NOT_COVERED,
    OOD_REASON,
    ReferralRule,
    answer_line,
    case_record,
)
from lungcal.ctapp.evaluate.pictures import (
    _patch,
    _plane,
    case_figure,
    check_picture_mode,
    gallery_selection,
    log_split_pictures,
)
from lungcal.ctapp.infer.inference import InferenceRun, PartlyRefused
from lungcal.ctapp.infer.ood import TrainingRange
from lungcal.ctapp.model.predict import predict
from lungcal.errors import ConfigError, DataError
from lungcal.paths import atomic_write_text
from lungcal.tracking import (
    MLFLOW_PARENT,
    TAG_FORCED,
    TAG_INFERENCE,
    TAG_MODEL,
    TAG_OUTCOME,
    TAG_PARENT,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
    linked_calibrator_run,
)

ROOT = Path(__file__).resolve().parents[2]
#: the tiny cohort is at 5 mm: series checks that accept its slices and pixels (the defaults refuse both)
TINY_QC = {"max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0, "max_pixel_mm": 6.0}
PNG_SIZE = (1300, 820)


@pytest.fixture(scope="module")
def model(tiny_cohort, tmp_path_factory):
    """A store with a 1-epoch nlst_ce model (and its reference TS run) trained on the tiny cohort."""
    store = tmp_path_factory.mktemp("predict_runs")
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)  # % macros resolve from the working directory
    try:
        run(config_file=["bundles/nlst_focal.json", "bundles/nlst_ce.json"], logging_file=False,
            datalist=str(tiny_cohort), output_dir=str(store),
            epochs=1, n_bootstrap=20, num_workers=0, spacing=[5.0, 5.0, 5.0], patch_size=8, batch_size=4,
            run_name="tiny-predict", qc={"_target_": "lungcal.ct.qc.QCConfig", **TINY_QC})
    finally:
        mp.undo()
    uri = default_tracking_uri(store)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("nlst")
    s1 = client.search_runs([exp.experiment_id], f"tags.`{TAG_STAGE2}` = 'none'")[0]
    dicoms = sorted(p for p in (tiny_cohort.parent / "dicom").iterdir() if p.is_dir())
    return {"store": store, "uri": uri, "run": s1, "client": client, "dicoms": dicoms}


def _predict(model, path, out: Path, *extra: str) -> int:
    return main(["predict", str(path), "--run", model["run"].info.run_id, "--output-dir", str(model["store"]),
                 "--output", str(out), "--qc", json.dumps(TINY_QC), *extra])


def _runs(model, **tags) -> list:
    flt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    exp = model["client"].get_experiment_by_name("nlst")
    return model["client"].search_runs([exp.experiment_id], filter_string=flt,
                                       order_by=["attributes.start_time DESC"])


def _mlflow_text(model, run_id: str, tmp: Path) -> str:
    """Every param, tag and artifact (name and text) of a run, as one string."""
    r = model["client"].get_run(run_id)
    parts = [json.dumps(r.data.params), json.dumps(r.data.tags)]
    local = Path(model["client"].download_artifacts(run_id, "", str(tmp)))
    for f in local.rglob("*"):
        if f.is_file():
            parts.append(str(f.relative_to(local)))
            if f.suffix in (".csv", ".json", ".txt"):
                parts.append(f.read_text())
    return "\n".join(parts)


def _answers(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("ct")]


def test_predict_one_nifti_writes_json_png_key_and_a_linked_run(model, tmp_path, capsys):
    nifti = tmp_path / "inputs" / "patient_Doe_John.nii.gz"  # a file name that identifies someone
    nifti.parent.mkdir()
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(model["dicoms"][0])))
    sitk.WriteImage(reader.Execute(), str(nifti))
    out = tmp_path / "out"
    assert _predict(model, nifti, out) == 0
    answers = _answers(capsys)
    assert len(answers) == 1 and answers[0].startswith("ct0000  p(cancer) ")

    case = json.loads((out / "cases" / "ct0000.json").read_text())
    assert {"pseudonym", "probability", "confidence", "calibrator", "uncertainty", "referral", "candidates",
            "model"} <= set(case)
    assert case["calibrator"] == "ts" and 0.0 <= case["probability"] <= 1.0
    assert case["confidence"] == pytest.approx(max(case["probability"], 1 - case["probability"]))
    assert case["uncertainty"]["entropy"] > 0 and case["uncertainty"]["interval"] is None  # no MC samples
    # the referral rule is the reference TS run's validation threshold
    ts_run = linked_calibrator_run(model["uri"], model["run"])
    thr = ts_run.data.metrics[REFERRAL_METRIC]
    assert case["referral"]["source"] == "validation" and case["referral"]["threshold"] == pytest.approx(thr)
    assert case["referral"]["refer"] == (case["confidence"] < thr)
    cands = case["candidates"]
    assert 1 <= len(cands) <= 3 and [c["rank"] for c in cands] == list(range(1, len(cands) + 1))
    assert all(a["attention"] >= b["attention"] for a, b in zip(cands, cands[1:]))
    for c in cands:
        assert len(c["ras_mm"]) == 3 and c["lps_mm"] == pytest.approx([-c["ras_mm"][0], -c["ras_mm"][1],
                                                                       c["ras_mm"][2]])
    png = Image.open(out / "cases" / "ct0000.png")
    png.load()
    assert png.size == PNG_SIZE
    with open(out / "inputs.csv") as fh:
        key = list(csv.DictReader(fh))
    assert key == [{"pseudonym": "ct0000", "image": str(nifti.absolute()), "series_uid": "", "status": "scored"}]
    # a synthetic-cohort model says so; a CT like its training ones is inside its acquisition range; its
    # validation split (a few CTs) is too small for an embedding range, and the JSON says so
    assert case["notice"] == DEMO_NOTICE and answers[0].endswith(f"[{DEMO_NOTICE}]")
    ood = case["out_of_distribution"]
    assert ood["checked"] == {"acquisition": True, "embedding": False} and ood["acquisition_outside"] == []
    assert not ood["flagged"] and ood["embedding_distance"] is None and "embedding range" in ood["not_checked"][
        "embedding"]
    assert OOD_REASON not in case["referral"]["reasons"]

    runs = _runs(model, **{TAG_INFERENCE: "predict", TAG_PARENT: model["run"].info.run_id})
    assert len(runs) == 1
    r = runs[0]
    assert r.info.status == "FINISHED" and r.data.tags[MLFLOW_PARENT] == model["run"].info.run_id
    assert r.data.tags[TAG_OUTCOME] == "complete" and r.data.params["n_refused"] == "0"
    assert r.data.tags[TAG_MODEL] == model["run"].info.run_id and TAG_STAGE2 not in r.data.tags
    assert r.data.params["n_inputs"] == "1" and r.data.params["calibrator"] == "ts"
    assert case["model"]["mlflow_run"] == r.info.run_id
    names = {a.path for a in model["client"].list_artifacts(r.info.run_id)}
    assert {"predictions.csv", "qc.csv", "gallery"} <= names and "inputs.csv" not in names
    text = _mlflow_text(model, r.info.run_id, tmp_path / "dl")
    assert "Doe_John" not in text and str(nifti.parent) not in text
    # the reference-run look-ups still find the calibrator, not the scoring run
    assert reference_calibrator(model["uri"], model["run"]).name == "ts"


def test_predict_folder_and_label_free_datalist(model, tmp_path, capsys):
    folder = tmp_path / "new_cts"
    for d in model["dicoms"][:3]:
        shutil.copytree(d, folder / d.name)
    out = tmp_path / "folder_out"
    assert _predict(model, folder, out) == 0
    assert [a.split()[0] for a in _answers(capsys)] == ["ct0000", "ct0001", "ct0002"]
    for name in ("ct0000", "ct0001", "ct0002"):
        assert json.loads((out / "cases" / f"{name}.json").read_text())["pseudonym"] == name
        with Image.open(out / "cases" / f"{name}.png") as png:
            assert png.size == PNG_SIZE
    with open(out / "inputs.csv") as fh:
        key = {r["pseudonym"]: r["image"] for r in csv.DictReader(fh)}
    assert key == {f"ct{i:04d}": str((folder / d.name).absolute()) for i, d in enumerate(model["dicoms"][:3])}
    with open(out / "predictions.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["subject"] for r in rows] == ["ct0000", "ct0001", "ct0002"]
    assert {"probability", "confidence", "referred", "entropy"} <= set(rows[0])
    r = _runs(model, **{TAG_INFERENCE: "predict", TAG_PARENT: model["run"].info.run_id})[0]
    assert r.data.params["n_inputs"] == "3" and r.info.status == "FINISHED"
    gallery = [a.path for g in model["client"].list_artifacts(r.info.run_id, "gallery")
               for a in model["client"].list_artifacts(r.info.run_id, g.path)]
    assert gallery and all(p.endswith(".png") for p in gallery)
    assert str(folder) not in _mlflow_text(model, r.info.run_id, tmp_path / "dl")

    # a datalist whose rows hold only an image (relative to it): no label, site or split
    datalist = folder / "new.json"
    datalist.write_text(json.dumps({"rows": [{"image": d.name} for d in model["dicoms"][:3]]}))
    out2 = tmp_path / "datalist_out"
    assert _predict(model, datalist, out2, "--no-pictures", "--refer-below", "0.99") == 0
    assert len(_answers(capsys)) == 3
    cases = [json.loads((out2 / "cases" / f"ct{i:04d}.json").read_text()) for i in range(3)]
    assert not list((out2 / "cases").glob("*.png"))
    assert all(c["referral"]["source"] == "refer_below" and c["referral"]["threshold"] == 0.99 for c in cases)
    assert all(c["referral"]["refer"] == (c["confidence"] < 0.99) for c in cases)
    # the same CTs, the same probabilities as from the folder
    first = json.loads((out / "cases" / "ct0000.json").read_text())
    assert cases[0]["probability"] == pytest.approx(first["probability"], abs=1e-9)


def test_bad_input_exits_2_in_one_line_and_leaves_no_run(model, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    before = len(_runs(model, **{TAG_INFERENCE: "predict"}))
    for argv in (["predict", str(empty), "--run", model["run"].info.run_id],
                 ["predict", str(model["dicoms"][0]), "--run", "0123456789abcdef0123456789abcdef"],
                 ["predict", str(tmp_path / "missing.nii.gz"), "--run", model["run"].info.run_id]):
        rc = main([*argv, "--output-dir", str(model["store"]), "--output", str(tmp_path / "out")])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("lungcal predict: error:")]
        assert rc == 2 and len(errors) == 1, err
        assert "Fix:" in errors[0] or "fix" in errors[0].lower()
    assert not (tmp_path / "out").exists()
    assert len(_runs(model, **{TAG_INFERENCE: "predict"})) == before
    exp = model["client"].get_experiment_by_name("nlst")
    assert not model["client"].search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")


def test_inference_bundle_is_the_same_code_path_and_a_linked_run(model, tmp_path, monkeypatch):
    folder = tmp_path / "cts"
    for d in model["dicoms"][3:5]:
        shutil.copytree(d, folder / d.name)
    out = tmp_path / "bundle_out"
    monkeypatch.chdir(ROOT)
    run(config_file="bundles/inference.json", logging_file=False, inputs=str(folder), output=str(out),
        output_dir=str(model["store"]), num_workers=0, stage1_run_id=model["run"].info.run_id,
        qc={"_target_": "lungcal.ct.qc.QCConfig", **TINY_QC})
    for name in ("ct0000", "ct0001"):
        assert (out / "cases" / f"{name}.png").is_file() and (out / "cases" / f"{name}.json").is_file()
    assert (out / "inputs.csv").is_file() and (out / "candidates" / "ct0000.csv").is_file()
    r = _runs(model, **{TAG_INFERENCE: "bundle", TAG_PARENT: model["run"].info.run_id})[0]
    assert r.info.status == "FINISHED" and r.data.params["n_inputs"] == "2"
    assert {"predictions.csv", "qc.csv", "gallery"} <= {a.path for a in model["client"].list_artifacts(r.info.run_id)}


def test_member_samples_fill_the_uncertainty_fields(model, tmp_path):
    """A predict function that returns MC samples (issue 18 item 1) gets MI, sd and an interval per CT."""
    seen = []

    def with_samples(network, loader, device):
        out = predict(network, loader, device)
        g = torch.Generator().manual_seed(0)
        noise = 0.5 * torch.randn((8, *out["logits"].shape), generator=g, dtype=torch.float64)
        out["samples"] = torch.softmax(out["logits"].double()[None] + noise, dim=-1)
        seen.append(out["samples"].numpy())
        return out

    res = InferenceRun(inputs=str(model["dicoms"][5]), stage1_run_id=model["run"].info.run_id,
                       output=str(tmp_path / "mc"), output_dir=str(model["store"]), num_workers=0, device="cpu",
                       qc={**TINY_QC}, pictures=False, predict_fn=with_samples).run()
    unc = res["cases"][0]["uncertainty"]
    assert unc["samples"] == 8 and unc["mutual_information"] > 0 and unc["probability_sd"] > 0
    lo, hi = unc["interval"]
    assert lo < hi and 0.0 <= lo and hi <= 1.0
    ref = reference_calibrator(model["uri"], model["run"])  # members go through the same calibrator
    members = np.array([calibrated_probs(ref, np.log(s))[0, 1] for s in seen[0]])
    assert [lo, hi] == pytest.approx([np.quantile(members, 0.1), np.quantile(members, 0.9)])
    assert unc["probability_sd"] == pytest.approx(members.std())
    assert json.loads((tmp_path / "mc" / "cases" / "ct0000.json").read_text())["uncertainty"] == unc


def test_site_applies_the_site_calibrator_and_its_referral_threshold(model, tmp_path, capsys):
    """``--site NAME``: the calibrator ``lungcal recalibrate`` stored there, and the threshold its run stored."""
    platt = PlattScaler().load_state_dict({"name": "platt", "slope": 0.6, "intercept": -0.8, "n_classes": 2})
    tags = {"lungcal.stage1": "ce", "lungcal.stage2": "platt", "lungcal.calibrator": "platt",
            "lungcal.site": "site-x", "lungcal.recalibration": "local"}
    with RunTracker("nlst", "ce+platt@site-x", tracking_uri=model["uri"], tags=tags,
                    parent_run_id=model["run"].info.run_id) as tr:
        tr.log_artifact(atomic_write_text(tmp_path / "platt.json", platt.to_json()), "calibrator")
        tr.log_metrics({REFERRAL_METRIC: 0.8})
    assert _predict(model, model["dicoms"][6], tmp_path / "site", "--site", "site-x", "--no-pictures") == 0
    capsys.readouterr()
    case = json.loads((tmp_path / "site" / "cases" / "ct0000.json").read_text())
    assert case["calibrator"] == "platt" and case["referral"]["threshold"] == pytest.approx(0.8)
    assert case["referral"]["refer"] == (case["confidence"] < 0.8)
    assert case["decision"] is None  # the site's run stored no guaranteed threshold: nothing changes
    r = _runs(model, **{TAG_INFERENCE: "predict", "lungcal.site": "site-x"})[0]
    assert r.data.params["calibrator"] == "platt" and r.info.status == "FINISHED"


def test_site_with_a_guaranteed_threshold_decides_work_up_and_states_the_guarantee(model, tiny_cohort, tmp_path,
                                                                                    capsys):
    """``recalibrate --miss-rate`` then ``predict --site``: each CT's JSON holds the decision block (the
    threshold of the site's recalibration run, the guarantee's statement), the line says work-up or not, the
    CSV has the column; the tiny cohort's test split has a cancer or two, so the guarantee asked is loose. The
    model was trained on the same cohort, whose val split chose its checkpoint: the threshold is certified on
    test (``--certify-split test``; on val it is refused)."""
    argv = ["recalibrate", "--model", model["run"].info.run_id, "--datalist", str(tiny_cohort),
            "--tracking-uri", model["uri"], "--output-dir", str(model["store"]), "--site", "site-g",
            "--method", "ts", "--miss-rate", "0.5", "--confidence", "0.5", "--n-bootstrap", "0", "--no-qc"]
    assert main(argv) == 2
    assert "the val split cannot certify the threshold" in capsys.readouterr().err
    assert main([*argv, "--certify-split", "test"]) == 0
    assert "-> work-up, chosen on the test split" in capsys.readouterr().out
    site_run = linked_calibrator_run(model["uri"], model["run"], site="site-g")
    stored = json.loads(Path(model["client"].download_artifacts(site_run.info.run_id, "guarantee.json",
                                                                str(tmp_path))).read_text())
    out = tmp_path / "decided"
    assert _predict(model, model["dicoms"][7], out, "--site", "site-g") == 0
    printed = capsys.readouterr().out
    case = json.loads((out / "cases" / "ct0000.json").read_text())
    dec = case["decision"]
    assert dec == {"positive": case["probability"] >= stored["threshold"], "threshold": stored["threshold"],
                   "statement": stored["statement"], "covered": True, "alpha": 0.5, "delta": 0.5,
                   "n_cancers": stored["n_cancers"]}
    assert dec["threshold"] == pytest.approx(site_run.data.metrics["val/threshold_missrate"])
    assert "at most 50% of cancers fall below it, with probability at least 50%" in dec["statement"]
    # the site's calibration CTs joined the reference this CT was placed against
    assert "site site-g's calibration CTs" in case["out_of_distribution"]["reference"]
    line = [a for a in printed.splitlines() if a.startswith("ct0000")][0]
    assert ("  work-up  " in line) if dec["positive"] else ("no work-up (below the guaranteed threshold)" in line)
    assert f"decision at site site-g: {stored['statement']}" in printed
    with open(out / "predictions.csv") as fh:
        assert next(csv.DictReader(fh))["work_up"] == str(int(dec["positive"]))
    with Image.open(out / "cases" / "ct0000.png") as png:
        assert png.size == PNG_SIZE
    r = _runs(model, **{TAG_INFERENCE: "predict", "lungcal.site": "site-g"})[0]
    assert r.data.metrics["n_work_up"] == int(dec["positive"]) and r.info.status == "FINISHED"
    # without --site: the reference calibrator, no decision
    assert _predict(model, model["dicoms"][7], tmp_path / "plain", "--no-pictures") == 0
    assert "work-up" not in capsys.readouterr().out
    assert json.loads((tmp_path / "plain" / "cases" / "ct0000.json").read_text())["decision"] is None


# ----------------------------------------------------------------------------- no model needed
def test_referral_threshold_is_the_confidence_of_the_least_confident_case_kept():
    p1 = np.array([0.05, 0.5, 0.9, 0.6, 0.3, 0.99, 0.45, 0.8, 0.2, 0.7])
    conf = np.maximum(p1, 1 - p1)
    t = referral_threshold(p1, 0.9)
    assert t == pytest.approx(np.sort(conf)[1])  # 9 of 10 kept: only the least confident (0.5) is below
    assert (conf < t).sum() == 1
    assert referral_threshold(np.stack([1 - p1, p1], axis=1), 0.8) == pytest.approx(np.sort(conf)[2])
    with pytest.raises(ConfigError):
        ReferralRule.given(0.3)
    rule = ReferralRule.given(0.7)
    assert rule.refer(0.65) is True and rule.refer(0.7) is False and ReferralRule(None).refer(0.6) is None


def test_picture_orientation_and_centring():
    """Axial/coronal put the patient's right on the image's left; each patch is centred on its candidate."""
    arr = np.full((40, 30, 20), -1000.0, dtype=np.float32)
    arr[35, 20, 15] = 500.0  # towards the patient's right (high x), anterior (high y), superior (high z)
    axial = _plane(arr, "axial", 15)
    r, c = np.unravel_index(axial.argmax(), axial.shape)
    assert c < axial.shape[1] / 2 and r < axial.shape[0] / 2  # image left = patient right; top = anterior
    coronal = _plane(arr, "coronal", 20)
    r, c = np.unravel_index(coronal.argmax(), coronal.shape)
    assert c < coronal.shape[1] / 2 and r < coronal.shape[0] / 2  # top = superior
    sagittal = _plane(arr, "sagittal", 35)
    r, c = np.unravel_index(sagittal.argmax(), sagittal.shape)
    assert c < sagittal.shape[1] / 2 and r < sagittal.shape[0] / 2  # left = anterior, top = superior
    for view in ("axial", "coronal", "sagittal"):
        patch = _patch(arr, view, np.array([35.0, 20.0, 15.0]), np.array([6.0, 6.0, 6.0]), -1000.0)
        assert patch.shape == (13, 13) and patch[6, 6] == 500.0
    edge = _patch(arr, "axial", np.array([0.0, 0.0, 0.0]), np.array([6.0, 6.0, 6.0]), -2000.0)
    assert edge.shape == (13, 13) and (edge == -2000.0).any()  # padded beyond the volume


def test_gallery_groups_and_a_figure_without_candidates():
    cases = [{"pseudonym": f"ct{i:04d}", "probability": p, "referral": {"refer": r, "confidence": max(p, 1 - p)}}
             for i, (p, r) in enumerate([(0.9, False), (0.55, True), (0.1, False), (0.6, True), (0.8, False)])]
    g = gallery_selection(cases, n=2)
    assert g == {"highest_probability": ["ct0000", "ct0004"], "lowest_probability": ["ct0002"],
                 "referred": ["ct0001", "ct0003"]}
    affine = np.diag([2.0, 2.0, 3.0, 1.0])
    fig = case_figure((np.full((30, 30, 20), -800.0, np.float32), affine),
                      {"pseudonym": "ct0000", "probability": 0.4, "calibrator": "none", "candidates": [],
                       "uncertainty": {"interval": None}, "referral": {"refer": None, "threshold": None}})
    fig.canvas.draw()
    assert tuple(int(v) for v in fig.canvas.get_width_height()) == PNG_SIZE


def test_decision_block_line_and_picture_for_both_verdicts():
    """A CT at or above the site's guaranteed threshold is work-up, one below is not; the block holds the
    guarantee's statement; the picture draws either (and none without a threshold)."""
    g = MissedCancerGuarantee(threshold=0.2, alpha=0.05, delta=0.1, n=300, n_cancers=60, positive_rate=0.4,
                              sensitivity=0.97)
    cand = {"world": np.array([[10.0, 10.0, 10.0]]), "score": np.array([1.0]), "radius_mm": np.array([4.0])}
    scores = {"subjects": ["ct0000", "ct0001"], "probs": np.array([[0.8, 0.2], [0.81, 0.19]]),
              "attention": np.ones((2, 1)), "candidates": [cand, cand], "member_probs": None}
    rule = ReferralRule.given(0.7)
    up, down = (case_record(scores, i, rule, calibrator="platt", decision=g) for i in (0, 1))
    assert up["decision"] == {"positive": True, "threshold": 0.2, "statement": g.statement(), "covered": True,
                              "alpha": 0.05, "delta": 0.1, "n_cancers": 60}
    assert down["decision"]["positive"] is False
    assert "  work-up  top candidate" in answer_line(up)
    assert "no work-up (below the guaranteed threshold)" in answer_line(down)
    plain = case_record(scores, 0, rule, calibrator="platt")
    assert plain["decision"] is None and "work-up" not in answer_line(plain)
    image = (np.full((30, 30, 20), -800.0, np.float32), np.diag([2.0, 2.0, 3.0, 1.0]))
    for case in (up, down, plain):
        fig = case_figure(image, case)
        fig.canvas.draw()
        texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
        assert ("WORK-UP: p >= 0.200" in texts) == (case is up) and ("no work-up: p < 0.200" in texts) == (case is down)


def test_split_pictures_draw_the_gallery_cases_with_their_known_outcome(tmp_path):
    """The stage-1 test split's pictures: only the gallery's CTs in ``gallery`` mode, every CT in
    ``all``, each case record carrying the label; an unknown mode is a one-line ConfigError."""
    images = []
    for i in range(5):
        path = tmp_path / f"ct{i}.nii.gz"
        img = sitk.GetImageFromArray(np.full((12, 20, 20), -800.0, np.float32))
        img.SetSpacing((5.0, 5.0, 5.0))
        sitk.WriteImage(img, str(path))
        images.append({"image": str(path), "series_uid": None})
    cand = {"world": np.array([[10.0, 10.0, 10.0]]), "score": np.array([1.0]), "radius_mm": np.array([4.0])}
    split = {"subjects": [f"S{i}" for i in range(5)], "labels": torch.tensor([1, 0, 1, 0, 0]),
             "candidates": [cand] * 5, "images": images}
    p1 = np.array([0.95, 0.05, 0.55, 0.5, 0.2])
    logged = []

    class Tracker:
        def log_artifact(self, path, artifact_path=None):
            logged.append((Path(path), artifact_path))

    rule = ReferralRule.from_threshold(0.6)
    gallery = log_split_pictures(Tracker(), split, np.stack([1 - p1, p1], 1), np.ones((5, 1)), rule=rule,
                                 calibrator="ts", folder=tmp_path / "g", mode="gallery")
    assert gallery["referred"] == ["S3", "S2"]  # confidence 0.5 and 0.55 < 0.6, least confident first
    assert gallery["highest_probability"] == ["S0", "S4", "S1"]  # the three kept, most probable first
    shown = {n for names in gallery.values() for n in names}
    assert {p.stem for p in (tmp_path / "g").glob("*.png")} == shown
    assert {(p.stem, a) for p, a in logged} == {(n, f"gallery/{g}") for g, names in gallery.items() for n in names}
    with Image.open(tmp_path / "g" / "S0.png") as im:
        assert im.size == PNG_SIZE
    log_split_pictures(Tracker(), split, p1, np.ones((5, 1)), rule=rule, calibrator="ts", folder=tmp_path / "all",
                       mode="all")
    assert len(list((tmp_path / "all").glob("*.png"))) == 5
    assert log_split_pictures(Tracker(), split, p1, np.ones((5, 1)), rule=rule, calibrator="ts",
                              folder=tmp_path / "none", mode="none") == {}
    assert not (tmp_path / "none").exists()
    with pytest.raises(ConfigError, match="test_pictures"):
        check_picture_mode("every")


# --------------------------------------------------------------------------------------------
# a folder as a user has it (issue 34 item 6)
def _nifti_of(dicom: Path, path: Path) -> sitk.Image:
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(dicom)))
    img = reader.Execute()
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(img, str(path))
    return img


def _case_folder(model, root: Path, bad: bool = True) -> Path:
    """ct.nii.gz, its reader-count nodule mask, annotation XML and CSV; with ``bad`` also an unreadable
    CT and a single slice of the CT."""
    img = _nifti_of(model["dicoms"][0], root / "ct.nii.gz")
    mask = np.zeros(sitk.GetArrayViewFromImage(img).shape, np.uint8)
    mask[20:24, 30:36, 30:36] = [[[1, 2, 3, 4, 4, 2]]]
    lab = sitk.GetImageFromArray(mask)
    lab.CopyInformation(img)
    sitk.WriteImage(lab, str(root / "nodule_mask_nreaders.nii.gz"))
    (root / "lidc_annotation_069.xml").write_text("<LidcReadMessage/>")
    (root / "nodules_consensus.csv").write_text("cluster,n_readers\n0,4\n")
    if bad:
        (root / "broken.nii.gz").write_bytes(b"\x1f\x8b not really gzip")
        sitk.WriteImage(img[:, :, 20:21], str(root / "thin.nii.gz"))
    return root


SKIPPED = ["skipped lidc_annotation_069.xml: not a CT image (.xml)",
           "skipped nodule_mask_nreaders.nii.gz: a label map (values 0, 1, 2, 3, 4), not a CT image: a CT holds air "
           "at about -1000 HU",
           "skipped nodules_consensus.csv: not a CT image (.csv)"]


def test_predict_a_case_folder_scores_the_ct_skips_the_rest_and_refuses_bad_cts(model, tmp_path, capsys):
    folder = _case_folder(model, tmp_path / "LIDC-case")
    out = tmp_path / "case_out"
    capsys.readouterr()
    assert _predict(model, folder, out) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("lungcal predict: error:")]
    assert len(errors) == 1 and "Traceback" not in captured.err, captured.err
    assert "2 of 3 CT(s) refused (first: ct0000: cannot read image" in errors[0]
    assert f"the 1 other(s) are scored and written to {out}" in errors[0] and str(out / "inputs.csv") in errors[0]
    lines = [line.strip() for line in captured.out.splitlines()]
    assert [line for line in lines if line.startswith("skipped")] == SKIPPED
    assert any(line.startswith("ct0001  p(cancer) ") for line in lines)
    refused = {line.split()[0]: line for line in lines if "  refused: " in line}
    assert set(refused) == {"ct0000", "ct0002"}
    assert "ct0000  refused: cannot read image" in refused["ct0000"]
    assert "series check 'geometry' failed: not a 3D volume: 1 voxel(s) along one axis" in refused["ct0002"]
    assert "1 of 3 CT(s) scored, 2 refused, 3 other file(s) skipped" in captured.out
    # the key: every CT with what became of it, then every skipped file
    with open(out / "inputs.csv") as fh:
        key = list(csv.DictReader(fh))
    assert [(r["pseudonym"], Path(r["image"]).name, r["status"].split(":")[0]) for r in key] == [
        ("ct0000", "broken.nii.gz", "refused"), ("ct0001", "ct.nii.gz", "scored"), ("ct0002", "thin.nii.gz", "refused"),
        ("", "lidc_annotation_069.xml", "skipped"), ("", "nodule_mask_nreaders.nii.gz", "skipped"),
        ("", "nodules_consensus.csv", "skipped")]
    # the scored CT is written; the refused ones are not
    assert sorted(p.name for p in (out / "cases").glob("*.json")) == ["ct0001.json"]
    with open(out / "predictions.csv") as fh:
        assert [r["subject"] for r in csv.DictReader(fh)] == ["ct0001"]
    with open(out / "qc.csv") as fh:
        assert {r["pseudonym"] for r in csv.DictReader(fh)} == {"ct0001", "ct0002"}  # ct0000 could not be read
    r = _runs(model, **{TAG_INFERENCE: "predict", TAG_PARENT: model["run"].info.run_id})[0]
    assert r.info.status == "FINISHED" and r.data.tags[TAG_OUTCOME] == "partial"
    assert r.data.params["n_inputs"] == "3" and r.data.params["n_refused"] == "2" and r.data.params["n_skipped"] == "3"
    assert r.data.metrics["n_scored"] == 1 and r.data.metrics["n_refused"] == 2
    text = _mlflow_text(model, r.info.run_id, tmp_path / "dl")
    assert str(folder) not in text and "LIDC-case" not in text


def test_qc_reads_the_folder_as_predict_does(model, tmp_path, capsys):
    folder = _case_folder(model, tmp_path / "LIDC-case")
    settings = [x for k, v in TINY_QC.items() for x in ("--set", f"{k}={v}")]
    capsys.readouterr()
    assert main(["qc", str(folder), *settings]) == 2
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    assert [line for line in lines if line.startswith("skipped")] == SKIPPED
    assert f"ct0000 {folder / 'broken.nii.gz'}: FAIL (cannot be read)" in out
    assert any(line.startswith(f"ct0001 {folder / 'ct.nii.gz'}: ") and "FAIL" not in line for line in lines)
    assert f"ct0002 {folder / 'thin.nii.gz'}: FAIL" in out
    assert "3 CT(s): " in out and "2 fail; 3 other file(s) skipped" in out
    # a clean case folder passes: the mask and the annotations no longer count as CTs
    clean = _case_folder(model, tmp_path / "clean", bad=False)
    assert main(["qc", str(clean), *settings]) == 0
    assert "1 CT(s): " in capsys.readouterr().out


def test_a_folder_whose_every_ct_is_refused_writes_the_key_and_opens_no_run(model, tmp_path, capsys):
    folder = tmp_path / "only_thin"
    img = _nifti_of(model["dicoms"][1], tmp_path / "full.nii.gz")
    folder.mkdir()
    sitk.WriteImage(img[:, :, 10:11], str(folder / "thin.nii.gz"))
    (folder / "notes.txt").write_text("x")
    before = len(_runs(model, **{TAG_INFERENCE: "predict"}))
    out = tmp_path / "thin_out"
    capsys.readouterr()
    assert _predict(model, folder, out) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lungcal predict: error:")]
    assert len(err) == 1 and "no CT scored: 1 of 1 refused (first: ct0000: series check 'geometry' failed" in err[0]
    with open(out / "inputs.csv") as fh:
        key = list(csv.DictReader(fh))
    assert [(r["pseudonym"], r["status"].split(":")[0]) for r in key] == [("ct0000", "refused"), ("", "skipped")]
    assert not (out / "cases").exists() and not (out / "predictions.csv").exists()
    assert len(_runs(model, **{TAG_INFERENCE: "predict"})) == before


def test_a_run_that_breaks_off_is_tagged_failed(model, tmp_path):
    def broken(network, loader, device):
        raise RuntimeError("the accelerator went away")

    with pytest.raises(RuntimeError, match="went away"):
        InferenceRun(inputs=str(model["dicoms"][2]), stage1_run_id=model["run"].info.run_id,
                     output=str(tmp_path / "broken"), output_dir=str(model["store"]), num_workers=0, device="cpu",
                     qc={**TINY_QC}, pictures=False, predict_fn=broken, mode="predict").run()
    r = _runs(model, **{TAG_INFERENCE: "predict"})[0]
    assert r.info.status == "FAILED" and r.data.tags[TAG_OUTCOME] == "failed"
    with open(tmp_path / "broken" / "inputs.csv") as fh:
        assert [row["status"] for row in csv.DictReader(fh)] == ["pending"]  # checked, never scored


def test_partly_refused_carries_the_result(model, tmp_path):
    folder = _case_folder(model, tmp_path / "case")
    with pytest.raises(PartlyRefused) as err:
        InferenceRun(inputs=str(folder), stage1_run_id=model["run"].info.run_id, output=str(tmp_path / "o"),
                     output_dir=str(model["store"]), num_workers=0, device="cpu", qc={**TINY_QC},
                     pictures=False).run()
    assert isinstance(err.value, DataError)
    res = err.value.result
    assert res is not None and [c["pseudonym"] for c in res["cases"]] == ["ct0001"]
    assert set(res["refused"]) == {"ct0000", "ct0002"} and len(res["skipped"]) == 3


def test_predict_a_folder_around_a_real_scan(model, shared_dir, tmp_path, capsys):
    """The real LIDC case folder as shared (CT, reader-count mask, XML, CSVs): the CT alone is scored."""
    src = shared_dir / "data" / "ct" / "LIDC-IDRI-0001"
    if not (src / "ct.nii.gz").is_file() or not (src / "nodule_mask_nreaders.nii.gz").is_file():
        pytest.skip(f"the real LIDC case folder is not in {src}")
    folder = tmp_path / "LIDC-IDRI-0001"
    folder.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (folder / f.name).symlink_to(f)
    out = tmp_path / "lidc_out"
    capsys.readouterr()
    assert _predict(model, folder, out, "--no-pictures") == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    skipped = [line for line in lines if line.startswith("skipped")]
    assert any(line.startswith("skipped nodule_mask_nreaders.nii.gz: a label map (values 0, 1, 2, 3, 4)")
               for line in skipped)
    assert {line.split(":")[0] for line in skipped} >= {
        "skipped lidc_annotation_069.xml", "skipped nodules_consensus.csv", "skipped nodules_per_reader.csv"}
    assert any(line.startswith("ct0000  p(cancer) ") for line in lines)
    with open(out / "inputs.csv") as fh:
        key = list(csv.DictReader(fh))
    assert key[0]["pseudonym"] == "ct0000" and key[0]["status"] == "scored"
    assert Path(key[0]["image"]).name == "ct.nii.gz" and all(r["status"].startswith("skipped") for r in key[1:])


# --------------------------------------------------------------------------------------------
# out of its depth (issue 32 item 7)
def test_a_real_ct_is_flagged_outside_the_training_data_and_referred(model, shared_dir, tmp_path, capsys):
    """The real LIDC scan against a model trained on 5 mm phantoms: its pixel size and slice thickness lie
    outside everything the training split held, so it is flagged and referred, whatever its confidence."""
    ct = shared_dir / "data" / "ct" / "LIDC-IDRI-0001" / "ct.nii.gz"
    if not ct.is_file():
        pytest.skip(f"the real LIDC scan is not in {ct.parent}")
    out = tmp_path / "real"
    capsys.readouterr()
    assert _predict(model, ct, out) == 0
    printed = capsys.readouterr().out
    (line,) = [a for a in printed.splitlines() if a.startswith("ct0000")]
    case = json.loads((out / "cases" / "ct0000.json").read_text())
    ood = case["out_of_distribution"]
    assert ood["flagged"] and ood["reason"] == OOD_REASON and ood["checked"]["acquisition"]
    fields = {a["field"]: a for a in ood["acquisition_outside"]}
    assert {"pixel_mm", "slice_thickness_mm"} <= set(fields)
    assert fields["pixel_mm"]["value"] == pytest.approx(0.703, abs=0.01) and fields["pixel_mm"]["low"] > 4
    assert case["referral"]["refer"] is True and OOD_REASON in case["referral"]["reasons"]
    assert "REFER (" in line and f"{OOD_REASON}: " in line and "pixel_mm 0.703 (training" in line
    assert line.endswith(f"[{DEMO_NOTICE}]") and case["notice"] == DEMO_NOTICE
    assert "1 of 1 CT(s) outside the model's training data" in printed and f"NOTE: {DEMO_NOTICE}" in printed
    with open(out / "predictions.csv") as fh:
        row = next(csv.DictReader(fh))
    assert row["outside_training"] == "1" and row["referred"] == "1"
    with Image.open(out / "cases" / "ct0000.png") as png:
        assert png.size == PNG_SIZE
    r = _runs(model, **{TAG_INFERENCE: "predict", TAG_PARENT: model["run"].info.run_id})[0]
    assert r.data.metrics["n_outside_training"] == 1 and r.data.metrics["n_referred"] == 1
    assert str(ct.parent) not in _mlflow_text(model, r.info.run_id, tmp_path / "dl")


def _texts(fig) -> str:
    return "\n".join(t.get_text() for t in [*fig.texts, *(t for ax in fig.axes for t in ax.texts)])


def test_a_flagged_case_is_referred_with_its_reason_on_the_line_and_the_picture():
    scores = {"probs": np.array([[0.02, 0.98]]), "attention": np.array([[1.0]]), "subjects": ["ct0000"],
              "candidates": [{"world": [[10.0, -5.0, 20.0]], "radius_mm": [4.0], "score": [0.9]}],
              "member_probs": None}
    ood = {"flagged": True, "reason": OOD_REASON, "acquisition_outside": [
        {"field": "pixel_mm", "value": 0.7, "low": 4.9, "high": 5.1}], "embedding_distance": 3.0,
        "embedding_threshold": 1.0, "checked": {"acquisition": True, "embedding": True}, "not_checked": {}}
    for rule in (ReferralRule(0.7, "validation"), ReferralRule(None)):  # confident, or no rule: referred anyway
        case = case_record(scores, 0, rule, calibrator="ts", ood=ood, notice=DEMO_NOTICE)
        assert case["referral"]["refer"] is True and case["referral"]["reasons"] == [OOD_REASON]
        line = answer_line(case)
        assert (f"REFER ({OOD_REASON}: pixel_mm 0.7 (training 4.9-5.1), embedding distance 3 > 1)" in line
                and line.endswith(f"[{DEMO_NOTICE}]"))
    arr = np.full((40, 40, 30), -1000.0, np.float32)
    arr[8:32, 8:32, 5:25] = 40.0
    text = _texts(case_figure((arr, np.diag([1.0, 1.0, 2.0, 1.0])), case))
    assert "OUTSIDE THE MODEL'S TRAINING DATA: pixel_mm 0.7" in text and DEMO_NOTICE in text
    assert f"REFER for review: {OOD_REASON}" in text
    inside = case_record(scores, 0, ReferralRule(0.7, "validation"), calibrator="ts",
                         ood={**ood, "flagged": False, "acquisition_outside": [], "embedding_distance": 0.5})
    assert inside["referral"]["refer"] is False and inside["notice"] is None
    assert "OUTSIDE" not in _texts(case_figure((arr, np.diag([1.0, 1.0, 2.0, 1.0])), inside))


def test_training_range_flags_acquisition_and_embedding_and_says_what_it_could_not_check():
    def stats(px):
        return AcquisitionStats(5.0, 5.0, px, -1000.0, 20.0, 1.0)

    summary = summarize_acquisitions([stats(4.8), stats(5.0), stats(5.2)])
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(200, 4))  # a 99th-percentile range needs about 99 validation cases
    tr = TrainingRange(summary, EmbeddingRange(ref))
    inside = tr.block(stats(5.0), ref[0] + 0.01)
    assert not inside["flagged"] and inside["acquisition_outside"] == [] and "note" not in inside
    assert inside["embedding_distance"] <= inside["embedding_threshold"]
    px = tr.block(stats(0.7), ref[0])
    assert px["flagged"] and [a["field"] for a in px["acquisition_outside"]] == ["pixel_mm"]
    far = tr.block(stats(5.0), ref[0] + 50.0)
    assert far["flagged"] and far["embedding_distance"] > far["embedding_threshold"]
    unmeasured = tr.block(None, None)
    assert not unmeasured["flagged"] and unmeasured["checked"] == {"acquisition": False, "embedding": False}
    assert unmeasured["note"].startswith("the check was not possible: ")
    none = TrainingRange.from_run("sqlite:///unused.db", None).block(stats(0.7), ref[0])
    assert not none["flagged"] and "checkpoint file" in none["note"] and none["acquisition_outside"] is None


def test_a_sites_calibration_cts_join_the_range_and_a_ct_outside_it_is_not_covered_by_the_guarantee():
    def stats(px):
        return AcquisitionStats(5.0, 5.0, px, -1000.0, 20.0, 1.0)

    rng = np.random.default_rng(0)
    ref = rng.normal(size=(200, 4))
    site_feats = rng.normal(size=(120, 4)) + np.array([40.0, 0, 0, 0])  # another scanner's embeddings
    training = TrainingRange(summarize_acquisitions([stats(4.8), stats(5.0), stats(5.2)]), None, features=ref)
    training = training._fit("validation split")
    site_summary = summarize_acquisitions([stats(0.68), stats(0.7), stats(0.72)])
    assert training.block(stats(0.7), site_feats[0])["flagged"]  # before: every CT of the site is outside
    joined = training.joined(site_summary, site_feats, "site-x")
    summary = joined.summary
    assert summary["n"] == 6 and summary["fields"]["pixel_mm"]["min"] == 0.68
    assert summary["fields"]["pixel_mm"]["max"] == 5.2
    assert summary["fields"]["pixel_mm"]["quantiles"] == training.summary["fields"]["pixel_mm"]["quantiles"]
    block = joined.block(stats(0.7), site_feats[0] + 0.01)
    assert not block["flagged"], block
    assert block["reference"] == ("the training data and site site-x's calibration CTs "
                                  "(3 CTs' acquisition, 120 CTs' embeddings)")
    assert joined.block(stats(9.0), site_feats[0])["flagged"]  # outside both
    assert joined.block(stats(0.7), site_feats[0] + 200.0)["flagged"]
    assert training.joined(None, None, "site-y") is training  # a run that logged neither changes nothing

    # a CT flagged outside the reference keeps its decision, but the guarantee says it does not cover it
    g = MissedCancerGuarantee(threshold=0.2, alpha=0.05, delta=0.1, n=300, n_cancers=60, positive_rate=0.4,
                              sensitivity=0.97)
    cand = {"world": np.array([[10.0, 10.0, 10.0]]), "score": np.array([1.0]), "radius_mm": np.array([4.0])}
    scores = {"subjects": ["ct0000"], "probs": np.array([[0.7, 0.3]]), "attention": np.ones((1, 1)),
              "candidates": [cand], "member_probs": None}
    out = joined.block(stats(9.0), site_feats[0])
    case = case_record(scores, 0, ReferralRule.given(0.6), calibrator="ts", decision=g, ood=out)
    dec = case["decision"]
    assert dec["positive"] is True and dec["covered"] is False and case["referral"]["refer"] is True
    assert dec["statement"].startswith("NOT COVERED by the guarantee: this CT lies outside the training data and "
                                       "site site-x's calibration CTs") and g.statement() in dec["statement"]
    assert "pixel_mm 9" in dec["statement"]
    assert f"work-up ({NOT_COVERED})" in answer_line(case)
    inside = case_record(scores, 0, ReferralRule.given(0.6), calibrator="ts", decision=g,
                         ood=joined.block(stats(0.7), site_feats[0] + 0.01))
    assert inside["decision"]["covered"] is True and inside["decision"]["statement"] == g.statement()


def _prior_site(model, tmp_path, site: str, params: dict, tags: dict) -> None:
    """A site recalibration run that stored a prior adjustment, with what its site check recorded."""
    prior = PriorAdjusted(None, 0.5, 0.2)
    with RunTracker("nlst", f"ce+prior@{site}", tracking_uri=model["uri"], parent_run_id=model["run"].info.run_id,
                    tags={"lungcal.stage1": "ce", "lungcal.stage2": "prior", "lungcal.calibrator": "prior",
                          "lungcal.site": site, "lungcal.recalibration": "local", **tags}) as tr:
        tr.log_params(params)
        tr.log_artifact(atomic_write_text(tmp_path / site / "prior.json", prior.to_json()), "calibrator")


def test_a_prior_adjustment_after_a_scanner_shift_is_refused_unless_forced(model, tmp_path, capsys):
    shifted = {SITE_CHECK_PARAM: "scanner_shift", SITE_CHECK_RUN_PARAM: "chk"}
    _prior_site(model, tmp_path, "site-s", shifted, {})
    before = len(_runs(model, **{TAG_INFERENCE: "predict"}))
    capsys.readouterr()
    assert _predict(model, model["dicoms"][5], tmp_path / "refused", "--site", "site-s", "--no-pictures") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lungcal")]
    assert len(err) == 1 and "the prior adjustment stored at site site-s" in err[0] and "scanner_shift" in err[0]
    assert len(_runs(model, **{TAG_INFERENCE: "predict"})) == before and not (tmp_path / "refused").exists()
    _prior_site(model, tmp_path, "site-f", shifted, {TAG_FORCED: "scanner_shift"})
    assert _predict(model, model["dicoms"][5], tmp_path / "forced", "--site", "site-f", "--no-pictures") == 0
    printed = capsys.readouterr().out
    assert printed.count("WARNING: the prior adjustment stored at site site-f") == 2  # before scoring, in the summary
    r = _runs(model, **{TAG_INFERENCE: "predict", "lungcal.site": "site-f"})[0]
    assert r.data.tags[TAG_FORCED] == "scanner_shift" and r.data.params["calibrator"] == "prior"
