"""The CIFAR bundles: recipe values, the objects they define, the keys they share with the CT bundles, swaps by
config alone, tiny runs of each."""
import json
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from monai.bundle import ckpt_export
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.networks.nets import ResNet

from cifar_baselines.bundle import load_bundle, main, run_bundle
from cifar_baselines.resnet import resnet32
from cifar_baselines.workflow import LASRun, Stage1Run
from lungcal.calibration.handlers import CalibrationMetrics
from lungcal.calibration.losses import FocalLoss, LabelAwareSmoothingLoss
from lungcal.errors import ConfigError
from lungcal.runtime.exit_hook import find_lungcal_error
from lungcal.tracking import TAG_CALIBRATOR, TAG_PARENT
from lungcal.workflow import Evaluation, Store

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["ce", "focal", "mixup", "focal_mixup"]
TINY = {"epochs": 1, "warmup_epochs": 1, "lr_milestones": [1], "batch_size": 32, "subset": 100,
        "n_bootstrap": 10, "val_per_class": 5}
STAGE1_BUNDLES = [f"{d}_{m}" for d in ("cifar10", "cifar10lt") for m in METHODS]
#: the keys of the shared skeleton (lungcal.workflow), the same in the CT and the CIFAR bundles
SHARED_KEYS = ("workflow", "post_hoc", "initialize", "settings", "store", "evaluation")


@pytest.fixture(autouse=True)
def _project_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # '%' macros resolve from the project root


@pytest.fixture(scope="module")
def store(tmp_path_factory, fake_cifar):
    out = tmp_path_factory.mktemp("cifar_runs")
    return {"data_dir": str(fake_cifar), "output_dir": str(out), "tracking_uri": f"sqlite:///{out}/mlflow.db"}


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
@pytest.mark.parametrize("method", METHODS)
def test_stage1_bundles_define_the_recipe(dataset, method, fake_cifar):
    p = load_bundle(f"bundles/{dataset}_{method}.json", {"data_dir": str(fake_cifar), "val_per_class": 5})
    raw = p.get()
    assert (raw["dataset"], raw["method"], raw["epochs"], raw["batch_size"], raw["lr"], raw["lr_milestones"]) == (
        dataset, method, 200, 128, 0.1, [160, 180])
    assert raw["weight_decay"] == (2e-4 if dataset == "cifar10lt" else 5e-4) and raw["warmup_epochs"] == 5
    assert raw["mixup_alpha"] == (1.0 if "mixup" in method else 0.0) and raw["focal_gamma"] == 3.0
    trainer = p.get_parsed_content("train#trainer")
    assert isinstance(trainer, SupervisedTrainer) and trainer.state.max_epochs == 200
    loss = trainer.loss_function
    if method.startswith("focal"):
        assert isinstance(loss, FocalLoss) and loss.gamma == 3.0 and loss.alpha is None
    else:
        assert isinstance(loss, torch.nn.CrossEntropyLoss)
    opt = trainer.optimizer
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9
    assert opt.defaults["weight_decay"] == raw["weight_decay"]
    assert p.get_parsed_content("train#step").mixup_alpha == raw["mixup_alpha"]
    evaluator = p.get_parsed_content("validate#evaluator")
    assert isinstance(evaluator, SupervisedEvaluator)
    metric = p.get_parsed_content("validate#key_metric")["val/ece"]
    assert isinstance(metric, CalibrationMetrics) and metric.n_bins == 15
    ev = p.get_parsed_content("evaluation")
    assert isinstance(ev, Evaluation) and (ev.n_bins, ev.n_bootstrap, ev.seed, ev.post_hoc) == (15, 1000, 0, ["ts"])
    assert isinstance(p.get_parsed_content("store"), Store)
    assert isinstance(p.get_parsed_content("workflow"), Stage1Run)


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
def test_las_bundles_define_the_recipe(dataset):
    raw = load_bundle(f"bundles/{dataset}_las.json").get()
    assert (raw["epochs"], raw["lr"], raw["shift_bn"], raw["las_shape"]) == (10, 0.05, True, "concave")
    assert (raw["smooth_head"], raw["smooth_tail"]) == ((0.3, 0.0) if dataset == "cifar10lt" else (0.1, 0.1))
    assert raw["stage1_run_id"] is None and "parent_run" not in raw and "head_lr" not in raw


def _targets(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == "_target_" else _targets(value)
    elif isinstance(node, list):
        for value in node:
            yield from _targets(value)


@pytest.mark.parametrize("name", [*STAGE1_BUNDLES, "cifar10_las", "cifar10lt_las"])
def test_cifar_and_ct_bundles_share_the_skeleton_keys(name):
    """Issue 33: both halves run the skeleton from the same keys: ``workflow`` (the run object), a ``post_hoc``
    list (stage 1), seeding in ``initialize``, ``settings`` by reference, ``store``, ``evaluation``, and only
    fully qualified ``_target_``s."""
    ct = json.loads((ROOT / "bundles" / "nlst_focal.json").read_text())
    cifar = load_bundle(f"bundles/{name}.json").get()  # '%' macros expanded
    keys = [k for k in SHARED_KEYS if k != "post_hoc"] if name.endswith("_las") else SHARED_KEYS
    assert set(SHARED_KEYS) <= set(ct) and set(keys) <= set(cifar)
    assert "experiment" not in cifar and "posthoc" not in cifar
    for cfg in (ct, cifar):
        assert cfg["store"]["_target_"] == "lungcal.workflow.Store"
        assert cfg["evaluation"]["_target_"] == "lungcal.workflow.Evaluation"
        assert any("seed_everything(@seed)" in x for x in cfg["initialize"])
        assert all(x.startswith("$@workflow.run(") for x in cfg["run"])  # seeding is not a run step
        assert all(isinstance(v, (str, int, float, bool, list, type(None))) for v in cfg["settings"].values())
        for target in _targets(cfg):
            assert "." in target and pydoc.locate(target) is not None, target  # a full, importable path
    if "post_hoc" in keys:
        assert cifar["post_hoc"] == ct["post_hoc"] == ["ts"]
        assert cifar["evaluation"]["post_hoc"] == ct["evaluation"]["post_hoc"] == "@post_hoc"
    else:
        assert cifar["evaluation"]["post_hoc"] == []  # LAS is stage 2 itself: no post-hoc runs


def test_post_hoc_names_reach_the_evaluation(fake_cifar):
    p = load_bundle("bundles/cifar10lt_ce.json", {"post_hoc": ["vector", "ts"], "data_dir": str(fake_cifar)})
    assert p.get_parsed_content("evaluation").post_hoc == ["vector", "ts"]
    with pytest.raises(Exception) as info:
        load_bundle("bundles/cifar10lt_ce.json", {"post_hoc": ["tz"]}).get_parsed_content("evaluation")
    error = find_lungcal_error(info.value)  # MONAI wraps what a constructor raises
    assert isinstance(error, ConfigError) and error.field == "post_hoc"


def test_unknown_override_is_config_error():
    with pytest.raises(ConfigError, match="epochz"):
        load_bundle("bundles/cifar10_ce.json", {"epochz": 3})
    assert main(["bundles/nope.json"]) == 2


def test_focal_alpha_is_wired(fake_cifar):
    alpha = [0.05] * 5 + [0.15] * 5
    p = load_bundle("bundles/cifar10lt_focal.json", {"focal_alpha": alpha, "data_dir": str(fake_cifar),
                                                     "val_per_class": 5})
    loss = p.get_parsed_content("loss")
    torch.testing.assert_close(loss.alpha, torch.tensor(alpha))


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
@pytest.mark.parametrize("method", METHODS)
def test_each_stage1_bundle_runs_tiny(dataset, method, store):
    res = run_bundle(f"bundles/{dataset}_{method}.json", {**store, **TINY, "imb_factor": 0.1})
    assert res["temperature"] > 0 and Path(res["checkpoint"]).is_file()
    assert res["test_ts"]["acc"] == pytest.approx(res["test"]["acc"])  # TS never changes the argmax
    run = MlflowClient(store["tracking_uri"]).get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["lungcal.stage1"] == method


def test_post_hoc_list_makes_one_child_run_per_name(store):
    """``post_hoc`` names the calibrators: each is fitted on validation in its own run under the stage-1 run."""
    res = run_bundle("bundles/cifar10lt_ce.json", {**store, **TINY, "post_hoc": ["ts", "vector"]})
    assert list(res["post_hoc"]) == ["ts", "vector"] and res["ts_run_id"] == res["post_hoc"]["ts"]["run_id"]
    client = MlflowClient(store["tracking_uri"])
    for name, r in res["post_hoc"].items():
        run = client.get_run(r["run_id"])
        assert run.data.tags[TAG_CALIBRATOR] == name and run.data.tags["lungcal.stage2"] == name
        assert run.data.tags[TAG_PARENT] == res["run_id"] and run.data.params["fit_split"] == "val"
        assert run.data.metrics["test/ece"] == pytest.approx(r["test"]["ece"])
    assert "temperature" not in client.get_run(res["post_hoc"]["vector"]["run_id"]).data.metrics


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
def test_each_las_bundle_runs_tiny(dataset, store):
    s1 = run_bundle(f"bundles/{dataset}_ce.json", {**store, **TINY})
    res = run_bundle(f"bundles/{dataset}_las.json", {**store, "checkpoint": s1["checkpoint"], "epochs": 1,
                                                     "batch_size": 32, "n_bootstrap": 10})
    run = MlflowClient(store["tracking_uri"]).get_run(res["run_id"])
    assert run.data.tags["lungcal.stage2"] == "las" and run.data.tags["lungcal.parent_run"] == s1["run_id"]
    assert 0 <= res["test"]["ece"] <= 1


def test_loss_swap_by_config_alone(store):
    """Another loss is one edit of ``loss``: here LAS's smoothing loss trains stage 1 of the CE bundle."""
    swap = {"loss": {"_target_": "lungcal.calibration.losses.LabelAwareSmoothingLoss",
                     "class_counts": "$@data.class_counts", "smooth_head": 0.2, "smooth_tail": 0.05}}
    p = load_bundle("bundles/cifar10lt_ce.json", {**store, **TINY, **swap})
    assert isinstance(p.get_parsed_content("train#trainer").loss_function, LabelAwareSmoothingLoss)
    res = run_bundle("bundles/cifar10lt_ce.json", {**store, **TINY, **swap})
    assert MlflowClient(store["tracking_uri"]).get_run(res["run_id"]).info.status == "FINISHED"


def test_network_swap_by_config_alone(store):
    """``network_def`` takes any classifier of 32x32 RGB images, here MONAI's 2D ResNet-10."""
    swap = {"network_def": {"_target_": "monai.networks.nets.resnet10", "spatial_dims": 2, "n_input_channels": 3,
                            "num_classes": 10}}
    p = load_bundle("bundles/cifar10_mixup.json", {**store, **TINY, **swap})
    assert isinstance(p.get_parsed_content("network"), ResNet)
    res = run_bundle("bundles/cifar10_mixup.json", {**store, **TINY, **swap})
    assert 0 <= res["test"]["acc"] <= 1


def test_monai_bundle_run_cli(store):
    """``python -m monai.bundle run`` (what ``lungcal study`` calls) runs a CIFAR bundle end to end."""
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/cifar10lt_focal.json"]
    for k, v in {**store, **TINY}.items():
        cmd += [f"--{k}", v if isinstance(v, str) else json.dumps(v)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(store["tracking_uri"])
    exp = client.get_experiment_by_name("cifar10lt")
    runs = client.search_runs([exp.experiment_id], "tags.`lungcal.stage1` = 'focal'")
    assert any(r.data.tags["lungcal.stage2"] == "ts" and r.info.status == "FINISHED" for r in runs)


def test_user_error_under_monai_bundle_run_is_one_line_and_exit_2(store):
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/cifar10_ce.json",
           "--data_dir", store["data_dir"], "--subset", "5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lungcal: error: ") and "subset=5 is too small" in last and "Traceback" not in proc.stderr


def test_a_stage1_checkpoint_feeds_las_and_ckpt_export(store, tmp_path):
    s1 = run_bundle("bundles/cifar10_focal.json", {**store, **TINY})
    ts = tmp_path / "model.ts"  # python -m monai.bundle ckpt_export, in process
    ckpt_export(net_id="network_def", filepath=str(ts), ckpt_file=s1["checkpoint"], key_in_ckpt="state_dict",
                config_file="bundles/cifar10_focal.json")
    exported = torch.jit.load(str(ts)).eval()
    net = resnet32().eval()
    net.load_state_dict(torch.load(s1["checkpoint"], weights_only=True)["state_dict"])
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(exported(x), net(x))
    p = load_bundle("bundles/cifar10_las.json", {**store, "checkpoint": s1["checkpoint"]})
    assert isinstance(p.get_parsed_content("workflow"), LASRun)
    assert isinstance(p.get_parsed_content("loss"), LabelAwareSmoothingLoss)
    params = p.get_parsed_content("optimizer").param_groups[0]["params"]
    net = p.get_parsed_content("network")
    assert {id(q) for q in params} == {id(q) for q in net.head.parameters()}
    assert not any(q.requires_grad for n, q in net.named_parameters() if not n.startswith("head."))
