import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from cifar_baselines.bundle import load_bundle, main, run_bundle
from cifar_baselines.workflow import Stage1, Stage2LAS
from lungcal.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["ce", "focal", "mixup", "focal_mixup"]


@pytest.fixture(autouse=True)
def _project_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # '%' macros resolve from the project root


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
@pytest.mark.parametrize("method", METHODS)
def test_stage1_bundles_instantiate_recipe(dataset, method):
    raw = json.loads((ROOT / "bundles" / f"{dataset}_{method}.json").read_text())
    assert "_target_" not in json.dumps(raw)  # wiring lives only in cifar_common.json
    wf = load_bundle(f"bundles/{dataset}_{method}.json").get_parsed_content("workflow")
    assert isinstance(wf, Stage1)
    assert (wf.dataset, wf.method, wf.epochs, wf.batch_size, wf.lr, wf.lr_milestones) == (
        dataset, method, 200, 128, 0.1, [160, 180])
    assert wf.wd == (2e-4 if dataset == "cifar10lt" else 5e-4)
    assert wf.warmup_epochs == 5 and wf.n_bins == 15
    if dataset == "cifar10lt":
        assert wf.imb_factor == 0.01
    if "mixup" in method:
        assert wf.mixup_alpha == 1.0


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
def test_las_bundles(dataset):
    wf = load_bundle(f"bundles/{dataset}_las.json").get_parsed_content("workflow")
    assert isinstance(wf, Stage2LAS) and wf.epochs == 10 and wf.head_lr == 0.05 and wf.shift_bn
    if dataset == "cifar10lt":
        assert (wf.smooth_head, wf.smooth_tail) == (0.3, 0.0)


def test_unknown_override_is_config_error():
    with pytest.raises(ConfigError, match="epochz"):
        load_bundle("bundles/cifar10_ce.json", {"epochz": 3})
    assert main(["bundles/nope.json"]) == 2


def test_stage1_ts_and_las_runs_are_tracked(fake_cifar, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = {"data_dir": str(fake_cifar), "output_dir": str(tmp_path), "tracking_uri": uri,
              "batch_size": 64, "workflow#n_bootstrap": 20, "workflow#val_per_class": 5, "workflow#progress": False}
    res = run_bundle("bundles/cifar10lt_focal_mixup.json", {**common, "epochs": 2, "warmup_epochs": 1,
                                                            "lr_milestones": [1], "imb_factor": 0.1})
    assert res["temperature"] > 0 and Path(res["checkpoint"]).is_file()
    assert res["test_ts"]["acc"] == pytest.approx(res["test"]["acc"])  # TS never changes the argmax
    c = MlflowClient(uri)
    r1, r2 = c.get_run(res["run_id"]), c.get_run(res["ts_run_id"])
    exp = c.get_experiment(r1.info.experiment_id)
    assert exp.name == "cifar10lt"
    assert r1.data.tags["lungcal.dataset"] == "cifar10lt" and r1.data.tags["lungcal.stage1"] == "focal_mixup"
    assert r1.data.tags["lungcal.stage2"] == "none" and r2.data.tags["lungcal.stage2"] == "ts"
    assert r2.data.tags["lungcal.parent_run"] == r1.info.run_id
    for key in ("test/ece", "test/acc", "test/ece_ci_low", "test/mean_confidence", "val/ece"):
        assert key in r1.data.metrics and key in r2.data.metrics
    assert "temperature" in r2.data.metrics
    assert r1.data.params["method"] == "focal_mixup" and r1.data.params["epochs"] == "2"
    hist = c.get_metric_history(r1.info.run_id, "val/ece")
    assert [m.step for m in hist][:2] == [0, 1]
    arts = {a.path for a in c.list_artifacts(r1.info.run_id)}
    assert {"model", "predictions", "config"} <= arts
    assert {a.path for a in c.list_artifacts(r1.info.run_id, "predictions")} == {"predictions/val.npz", "predictions/test.npz"}
    assert r1.info.status == "FINISHED" and r2.info.status == "FINISHED"

    las = run_bundle("bundles/cifar10lt_las.json", {**{k: v for k, v in common.items() if "val_per" not in k},
                                                    "parent_run": res["run_id"], "epochs": 1})
    r3 = c.get_run(las["run_id"])
    assert r3.data.tags["lungcal.stage2"] == "las" and r3.data.tags["lungcal.parent_run"] == res["run_id"]
    assert r3.data.tags["lungcal.stage1"] == "focal_mixup" and "test/ece" in r3.data.metrics
    # LAS from a checkpoint file, cached-feature path (no BN shift)
    las2 = run_bundle("bundles/cifar10lt_las.json", {**{k: v for k, v in common.items() if "val_per" not in k},
                                                     "checkpoint": res["checkpoint"], "epochs": 1, "shift_bn": False})
    assert c.get_run(las2["run_id"]).data.tags["lungcal.parent_run"] == res["run_id"]
