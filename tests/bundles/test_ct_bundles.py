"""Run the real CT bundle JSONs end to end with tiny overrides (as the MONAI model zoo's CI does).

A 15-CT synthetic cohort at 5 mm (64x64x48 voxels) keeps each run to seconds of compute; every
stage-1 variant, an encoder swap and a loss swap made in config alone, the LAS bundle and the
inference bundle go through ``monai.bundle.run`` with the JSON files of ``bundles/`` and a
temporary ``output_dir``; a user error under ``python -m monai.bundle run`` ends in one line.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from monai.bundle import ckpt_export, run

from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.data.manifest import load_manifest
from lungcal.errors import ConfigError
from lungcal.runtime.exit_hook import find_lungcal_error
from lungcal.tracking import (
    SELECTION_ARTIFACT,
    TAG_CALIBRATOR,
    TAG_DATASET,
    TAG_PARENT,
    TAG_STAGE1,
    TAG_STAGE2,
    default_tracking_uri,
    linked_temperature,
)

ROOT = Path(__file__).resolve().parents[2]
BUNDLES = ROOT / "bundles"
STAGE1 = ["nlst_ce", "nlst_focal", "nlst_mixup", "nlst_focal_mixup"]
#: the stage-1 recipes that state only what differs from bundles/nlst_focal.json
VARIANTS = ("nlst_ce", "nlst_mixup", "nlst_focal_mixup", "nlst_ensemble")
OBJECTS = ("preprocessing", "detector", "cohort", "network_def", "loss", "optimizer", "lr_scheduler")
RESNET10 = {
    "_target_": "lungcal.mil.LogSumExpMIL",
    "encoder": {"_target_": "lungcal.runtime.bundle_config.build", "target": "monai.networks.nets.resnet10",
                "spatial_dims": 3, "n_input_channels": 1, "num_classes": "@embed_dim"},
    "embed_dim": "@embed_dim", "attn_dim": "@attn_dim", "dropout": "@dropout", "tta_flips": "@tta_flips",
}
#: the tiny cohort is at 5 mm: series checks that accept its slices and pixels (the defaults refuse both)
TINY_QC = {"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0,
           "max_pixel_mm": 6.0}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def config_files(name: str) -> str | list[str]:
    """The files of a CT bundle: a stage-1 variant goes over the complete focal bundle, as the README runs it."""
    path = str(Path("bundles") / f"{name}.json")
    return [str(Path("bundles") / "nlst_focal.json"), path] if name in VARIANTS else path


def run_bundle(name: str, monkeypatch, **overrides):
    """``python -m monai.bundle run --config_file <files of name> --k v ...`` in-process, from the root."""
    monkeypatch.chdir(ROOT)  # % macros resolve from the working directory
    run(config_file=config_files(name), logging_file=False, **overrides)


def tiny(cohort: Path, store: Path, **kw):
    return {"datalist": str(cohort), "output_dir": str(store), "epochs": 1, "n_bootstrap": 20, "num_workers": 0,
            "spacing": [5.0, 5.0, 5.0], "patch_size": 8, "batch_size": 4, "qc": TINY_QC, **kw}


def _runs(store: Path, **tags):
    client = MlflowClient(default_tracking_uri(store))
    exp = client.get_experiment_by_name("nlst")
    flt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    return client, client.search_runs([exp.experiment_id], filter_string=flt, order_by=["attributes.start_time DESC"])


def _stage1_run(store: Path, run_name: str):
    _, runs = _runs(store, **{TAG_STAGE2: "none"})
    return [r for r in runs if r.info.run_name == run_name][0]


def test_the_focal_bundle_is_complete_and_the_variants_state_only_what_differs():
    base = json.loads((BUNDLES / "nlst_focal.json").read_text())
    for key in OBJECTS + ("workflow", "store", "evaluation"):
        assert "_target_" in base[key], key
    assert not [k for k, v in base.items() if isinstance(v, str) and v.startswith("%")], "no macro sections"
    assert base["train"]["trainer"]["_target_"] == "monai.engines.SupervisedTrainer"
    assert base["validate"]["evaluator"]["_target_"] == "monai.engines.SupervisedEvaluator"
    assert base["validate"]["key_metric"]["val_auc"]["_target_"].endswith("CalibrationMetrics")
    targets = re.findall(r'"_target_": "([^"]+)"', json.dumps(base))
    assert all("." in t for t in targets), f"one _target_ style (fully qualified): {targets}"
    # every named hyperparameter reaches the run through settings, by reference
    values = [k for k, v in base.items() if not k.startswith("_") and not isinstance(v, dict)
              and k not in ("imports", "initialize", "run", "network", "run_settings")]
    assert base["settings"] == {k: f"@{k}" for k in values}
    assert base["run_settings"] == "$lungcal.runtime.settings.typed_settings(@settings)"  # its switches, parsed once
    for name in VARIANTS:
        cfg = json.loads((BUNDLES / f"{name}.json").read_text())
        assert len([k for k in cfg if not k.startswith("_")]) <= 15, name
        same = [k for k in cfg if k in base and cfg[k] == base[k]]
        assert not same, f"{name}.json restates {same} of nlst_focal.json"
    for f in ("metadata.json", "logging.conf", "nlst_las.json", "inference.json"):
        assert (BUNDLES / f).is_file()


def test_a_nested_override_reaches_the_object_and_the_run_logs_the_resolved_config(tiny_cohort, store, monkeypatch):
    run_bundle("nlst_focal", monkeypatch, **tiny(tiny_cohort, store, run_name="t-nested"),
               **{"network_def#encoder#embed_dim": 24, "train#dataloader#batch_size": 3, "loss#gamma": 3.5})
    s1 = _stage1_run(store, "t-nested")
    ck = torch.load(store / "checkpoints" / s1.info.run_id / "best.pt", weights_only=True)
    assert ck["network_def"]["encoder"]["embed_dim"] == 24
    assert ck["state_dict"]["encoder.proj.0.weight"].shape[0] == 24
    client = MlflowClient(default_tracking_uri(store))
    resolved = json.loads(Path(client.download_artifacts(s1.info.run_id, "config/resolved.json")).read_text())
    assert resolved["settings"]["epochs"] == 1 and resolved["settings"]["patch_size"] == 8
    assert resolved["network_def"]["encoder"]["embed_dim"] == 24
    assert resolved["loss"]["_target_"] == "lungcal.calibration.losses.FocalLoss"
    # the nested overrides of the loss and the loader reach the record, the params and the resume identity
    assert resolved["loss"]["gamma"] == 3.5 and resolved["train_loader"]["batch_size"] == 3
    params = client.get_run(s1.info.run_id).data.params
    assert params["loss.gamma"] == "3.5" and params["train_loader.batch_size"] == "3"
    assert "output_dir" not in resolved["settings"] and "datalist" not in resolved["settings"]  # no paths


def test_las_without_stage1_run_is_a_config_error(tiny_cohort, tmp_path, monkeypatch):
    with pytest.raises(Exception) as info:
        run_bundle("nlst_las", monkeypatch, datalist=str(tiny_cohort), output_dir=str(tmp_path), num_workers=0)
    error = find_lungcal_error(info.value)
    assert isinstance(error, ConfigError) and "stage-1" in str(error)


@pytest.mark.parametrize("name", STAGE1)
def test_stage1_bundle_trains_evaluates_and_links_a_ts_run(name, tiny_cohort, store, monkeypatch, capsys):
    run_bundle(name, monkeypatch, **tiny(tiny_cohort, store, run_name=f"t-{name}"))
    out = capsys.readouterr().out
    assert "mlflow ui --backend-store-uri sqlite:///" in out and "ECE" in out and "temperature" in out
    # the TS difference is a paired one, with its CI and a plain verdict
    assert re.search(r"ECE TS - none  [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]  paired bootstrap: "
                     r"(not )?significant", out), out
    method = name[len("nlst_"):]
    client, runs = _runs(store, **{TAG_STAGE1: method})
    s1 = [r for r in runs if r.data.tags[TAG_STAGE2] == "none"][0]
    ts = [r for r in runs if r.data.tags[TAG_STAGE2] == "ts"][0]
    assert s1.info.status == ts.info.status == "FINISHED"
    assert s1.info.run_name == f"t-{name}"
    assert ts.data.tags[TAG_PARENT] == s1.info.run_id and ts.data.tags[TAG_CALIBRATOR] == "ts"
    assert s1.data.tags[TAG_DATASET] == "synthetic"
    for r in (s1, ts):
        for k in ("test/ece", "test/ece_ci_low", "test/ece_ci_high", "test/auc", "test/acc"):
            assert k in r.data.metrics, k
    assert "val/auc" in s1.data.metrics and "train/loss" in s1.data.metrics
    # the prevalences the shipped probabilities are calibrated to (lungcal recalibrate --prevalence reads them)
    assert 0 < s1.data.metrics["train/prevalence"] < 1 and 0 < s1.data.metrics["val/prevalence"] < 1
    # TS never changes AUC or ACC
    assert ts.data.metrics["test/auc"] == pytest.approx(s1.data.metrics["test/auc"], abs=1e-9)
    assert ts.data.metrics["test/acc"] == pytest.approx(s1.data.metrics["test/acc"], abs=1e-9)
    assert ts.data.metrics["temperature"] > 0
    arts = {a.path for a in client.list_artifacts(s1.info.run_id)}
    assert {"plots", "predictions", "config", "model", "checkpoint"} <= arts
    # the reference (TS) run holds the test split's gallery, drawn at its calibrated probabilities
    shown = {g.path.split("/")[1]: [a.path for a in client.list_artifacts(ts.info.run_id, g.path)]
             for g in client.list_artifacts(ts.info.run_id, "gallery")}
    assert set(shown) <= {"highest_probability", "lowest_probability", "referred"} and shown
    assert all(p.endswith(".png") for paths in shown.values() for p in paths)
    test_cts = {row["subject"] for row in load_manifest(tiny_cohort) if row["split"] == "test"}
    assert {Path(p).stem for paths in shown.values() for p in paths} <= test_cts
    # which CTs made the checkpoint (recalibrate --miss-rate never certifies a threshold on them): pseudonyms only
    sel = json.loads(Path(client.download_artifacts(s1.info.run_id, SELECTION_ARTIFACT)).read_text())
    by_split = {s: {r["subject"] for r in load_manifest(tiny_cohort) if r["split"] == s} for s in ("train", "val")}
    assert sel["val"] and set(sel["val"]) <= by_split["val"] and set(sel["train"]) <= by_split["train"]
    assert sel["selected_by"] == "the best val_auc over epochs on the val split"
    params = s1.data.params
    assert params["datalist.source"] == "synthetic" and params["epochs"] == "1" and params["method"] == method
    assert params["network_def._target_"] == "lungcal.mil.models.LogSumExpMIL"
    assert params["network_def.attn_dim"] == "64"
    assert all(str(tiny_cohort.parent) not in v for v in params.values())
    ckdir = store / "checkpoints" / s1.info.run_id
    assert (ckdir / "best.pt").is_file() and (ckdir / "last.pt").is_file()
    assert not list(ckdir.glob(".*.tmp"))
    ck = torch.load(ckdir / "best.pt", weights_only=True)
    assert ck["network_def"]["encoder"] == {"_target_": "lungcal.mil.encoders.SmallCNNEncoder", "embed_dim": 64,
                                            "width": 16, "in_channels": 1}
    assert json.loads(ck["bag_params"])["patch_size"] == 8


def test_ckpt_export_writes_the_trained_network_as_torchscript(tiny_cohort, store, tmp_path, monkeypatch):
    run_bundle("nlst_focal", monkeypatch, **tiny(tiny_cohort, store, run_name="t-export"))
    best = store / "checkpoints" / _stage1_run(store, "t-export").info.run_id / "best.pt"
    ckpt_export(net_id="network_def", filepath=str(tmp_path / "model.ts"), ckpt_file=str(best),
                key_in_ckpt="state_dict", config_file="bundles/nlst_focal.json", meta_file="bundles/metadata.json")
    exported = torch.jit.load(str(tmp_path / "model.ts")).eval()
    trained = load_stage1(str(best), default_tracking_uri(store)).network
    torch.manual_seed(0)
    bags, mask = torch.rand(3, 8, 1, 8, 8, 8), torch.rand(3, 8) > 0.4
    mask[2] = False  # an empty bag too
    with torch.no_grad():
        for got, want in zip(exported(bags, mask), trained(bags, mask)):
            assert torch.allclose(got, want, atol=1e-6)


def test_encoder_swap_by_config_trains_and_las_and_inference_rebuild_it(tiny_cohort, store, tmp_path, monkeypatch):
    run_bundle("nlst_focal", monkeypatch, **tiny(tiny_cohort, store, run_name="t-resnet10", network_def=RESNET10,
                                                   embed_dim=16))
    s1 = _stage1_run(store, "t-resnet10")
    ck = torch.load(store / "checkpoints" / s1.info.run_id / "best.pt", weights_only=True)
    assert ck["network_def"]["encoder"]["target"] == "monai.networks.nets.resnet10"
    assert ck["network_def"]["encoder"]["num_classes"] == 16
    assert any(k.startswith("encoder.layer4.") for k in ck["state_dict"])
    assert s1.data.params["network_def.encoder.target"] == "monai.networks.nets.resnet10"
    run_bundle("nlst_las", monkeypatch, datalist=str(tiny_cohort), output_dir=str(store), epochs=2, n_bootstrap=20,
               num_workers=0, stage1_run_id=s1.info.run_id, run_name="t-resnet10-las")
    _, las = _runs(store, **{TAG_PARENT: s1.info.run_id, TAG_STAGE2: "las"})
    assert las and las[0].info.status == "FINISHED"
    out = tmp_path / "pred"
    run_bundle("inference", monkeypatch, inputs=str(tiny_cohort), output=str(out), output_dir=str(store),
               num_workers=0, stage1_run_id=s1.info.run_id, qc=TINY_QC, pictures=False)
    assert len(list(csv.DictReader(open(out / "predictions.csv")))) == 15


def test_loss_swap_by_config_is_the_loss_the_trainer_uses(tiny_cohort, store, monkeypatch):
    adaptive = {"_target_": "lungcal.calibration.losses.FocalLossAdaptiveGamma"}
    run_bundle("nlst_ce", monkeypatch, **tiny(tiny_cohort, store, run_name="t-ce-ref"))
    run_bundle("nlst_ce", monkeypatch, **tiny(tiny_cohort, store, run_name="t-ce-adaptive", loss=adaptive))
    ref, swapped = _stage1_run(store, "t-ce-ref"), _stage1_run(store, "t-ce-adaptive")
    assert ref.data.params["loss._target_"] == "torch.nn.modules.loss.CrossEntropyLoss"  # the class the run used
    assert swapped.data.params["loss._target_"] == "lungcal.calibration.losses.FocalLossAdaptiveGamma"
    # same seed, same first batches: focal terms (1 - p)^gamma < 1 make every per-sample loss smaller than CE's
    assert swapped.data.metrics["train/loss"] < ref.data.metrics["train/loss"]


def test_las_bundle_from_latest_stage1_run(tiny_cohort, store, monkeypatch):
    run_bundle("nlst_ce", monkeypatch, **tiny(tiny_cohort, store, run_name="t-las-parent"))
    s1 = _stage1_run(store, "t-las-parent")
    run_bundle("nlst_las", monkeypatch, datalist=str(tiny_cohort), output_dir=str(store), epochs=2, n_bootstrap=20,
               num_workers=0, las_shape="linear")
    _, las = _runs(store, **{TAG_STAGE2: "las"})
    assert las and las[0].info.status == "FINISHED"
    assert las[0].data.tags[TAG_PARENT] == s1.info.run_id
    assert "test/ece" in las[0].data.metrics
    assert las[0].data.params["class_counts"].startswith("[") and las[0].data.params["las_shape"] == "linear"


def test_inference_bundle_writes_probabilities_and_candidates(tiny_cohort, store, tmp_path, monkeypatch):
    if not (store / "mlflow.db").exists():
        run_bundle("nlst_ce", monkeypatch, **tiny(tiny_cohort, store))
    out = tmp_path / "pred"
    run_bundle("inference", monkeypatch, inputs=str(tiny_cohort), output=str(out), output_dir=str(store),
               num_workers=0, qc=TINY_QC, pictures=False)
    rows = list(csv.DictReader(open(out / "predictions.csv")))
    assert len(rows) == 15
    assert all(0.0 <= float(r["probability"]) <= 1.0 for r in rows)
    tables = sorted((out / "candidates").glob("*.csv"))
    assert len(tables) == 15
    cand = list(csv.DictReader(open(tables[0])))
    assert cand and {"x_mm", "y_mm", "z_mm", "attention"} <= set(cand[0])
    assert sum(float(c["attention"]) for c in cand) == pytest.approx(1.0, abs=1e-4)
    # the temperature is the reference one unless a site's own recalibration is asked for
    temps = {float(r["temperature"]) for r in rows}
    latest = _runs(store, **{TAG_STAGE2: "none"})[1][0]
    assert len(temps) == 1
    assert temps.pop() == pytest.approx(linked_temperature(default_tracking_uri(store), latest), abs=6e-5)
    with pytest.raises(Exception) as info:
        run_bundle("inference", monkeypatch, inputs=str(tiny_cohort), output=str(tmp_path / "p2"),
                   output_dir=str(store), num_workers=0, site="nowhere", qc=TINY_QC, pictures=False)
    assert "recalibrate" in str(find_lungcal_error(info.value))


def test_user_error_under_monai_bundle_run_is_one_line_and_exit_code_2(tmp_path):
    missing = tmp_path / "no_such_datalist.json"
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/inference.json",
           "--inputs", str(missing), "--output_dir", str(tmp_path / "runs")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "RuntimeError" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1
    assert str(missing) in errors[0] and "field 'inputs'" in errors[0] and "not found" in errors[0]
    assert "Fix:" in errors[0]
