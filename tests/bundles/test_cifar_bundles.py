"""The CIFAR bundles: a complete base and recipes that state what differs (as the CT bundles), recipe values
(the same as before issue 44 item 3), the objects they define, the keys they share with the CT bundles, swaps by
config alone, nested overrides, tiny runs of each."""
import json
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from monai.bundle import ConfigParser, ckpt_export
from monai.bundle import run as monai_run
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.networks.nets import ResNet

from cifar_baselines.bundle import LAS_BASE, STAGE1_BASE, load_bundle, main, recipe_files, run_bundle
from cifar_baselines.resnet import resnet32
from cifar_baselines.stages import LASRun, Stage1Run
from lungcal.calibration.handlers import CalibrationMetrics
from lungcal.calibration.losses import FocalLoss, LabelAwareSmoothingLoss
from lungcal.errors import ConfigError
from lungcal.runtime.exit_hook import find_lungcal_error
from lungcal.tracking import CONFIG_ARTIFACT, TAG_CALIBRATOR, TAG_PARENT
from lungcal.workflow import Evaluation, Store

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["ce", "focal", "mixup", "focal_mixup"]
TINY = {"epochs": 1, "warmup_epochs": 1, "lr_milestones": [1], "batch_size": 32, "subset": 100,
        "n_bootstrap": 10, "val_per_class": 5}
STAGE1_BUNDLES = [f"{d}_{m}" for d in ("cifar10", "cifar10lt") for m in METHODS]
RECIPES = [*STAGE1_BUNDLES, "cifar10_las", "cifar10lt_las"]
#: the keys of the shared skeleton (lungcal.workflow), the same in the CT and the CIFAR bundles
SHARED_KEYS = ("workflow", "post_hoc", "initialize", "settings", "store", "evaluation")


@pytest.fixture(autouse=True)
def _project_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # bundle paths (bundles/...) resolve from the project root


@pytest.fixture(scope="module")
def store(tmp_path_factory, fake_cifar):
    out = tmp_path_factory.mktemp("cifar_runs")
    return {"data_dir": str(fake_cifar), "output_dir": str(out), "tracking_uri": f"sqlite:///{out}/mlflow.db"}


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
@pytest.mark.parametrize("method", METHODS)
def test_stage1_bundles_define_the_recipe(dataset, method, fake_cifar):
    p = load_bundle(recipe_files(f"{dataset}_{method}"), {"data_dir": str(fake_cifar), "val_per_class": 5})
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
    raw = load_bundle(recipe_files(f"{dataset}_las")).get()
    assert (raw["epochs"], raw["lr"], raw["shift_bn"], raw["las_shape"]) == (10, 0.05, True, "concave")
    assert (raw["smooth_head"], raw["smooth_tail"]) == ((0.3, 0.0) if dataset == "cifar10lt" else (0.1, 0.1))
    assert raw["stage1_run_id"] is None and "parent_run" not in raw and "head_lr" not in raw


def test_the_ce_base_is_complete_and_the_recipes_state_only_what_differs():
    """Issue 44 item 3: the CIFAR family is composed as the CT family: a complete base per stage (its own sections,
    no '%' macro, no bundles/cifar_common.json) and recipes of only the keys that differ, every one a key of the
    base (a mistyped key in a recipe would add a key nothing reads)."""
    assert not (ROOT / "bundles" / "cifar_common.json").exists()
    for base_file in (STAGE1_BASE, LAS_BASE):
        base = json.loads((ROOT / base_file).read_text())
        assert not [k for k, v in base.items() if isinstance(v, str) and v.startswith("%")], base_file
        for key in ("network_def", "loss", "optimizer", "lr_scheduler", "store", "evaluation", "workflow"):
            assert "_target_" in base[key], (base_file, key)
        assert base["train"]["trainer"]["_target_"] == "monai.engines.SupervisedTrainer"
    for name in RECIPES:
        files = recipe_files(name)
        if len(files) == 1:
            continue
        base, cfg = (json.loads((ROOT / f).read_text()) for f in files)
        keys = [k for k in cfg if k not in ("_comment", "+initialize")]
        assert 1 <= len(keys) <= 6, name
        assert set(keys) <= set(base), f"{name}.json: {set(keys) - set(base)} name no key of {files[0]}"
        assert not [k for k in keys if cfg[k] == base[k]], f"{name}.json restates keys of {files[0]}"


#: the resolved settings of bundles/cifar10lt_ce.json, and what each stage-1 recipe changes: the values the
#: '%'-macro files gave before issue 44 item 3 (ConfigParser on the old files at 3425549)
STAGE1_SETTINGS = {
    "dataset": "cifar10lt", "method": "ce", "imb_factor": 0.01, "val_per_class": 500, "subset": None, "seed": 0,
    "epochs": 200, "batch_size": 128, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0002, "warmup_epochs": 5,
    "lr_milestones": [160, 180], "lr_gamma": 0.1, "focal_gamma": 3.0, "focal_alpha": None, "mixup_alpha": 0.0,
    "device": "auto", "amp": True, "channels_last": True, "data_dir": None, "download": False, "output_dir": None,
    "tracking_uri": None, "run_name": None, "resume": True, "n_bins": 15, "n_bootstrap": 1000, "post_hoc": ["ts"],
    "val_interval": 1}
_BALANCED = {"dataset": "cifar10", "imb_factor": 1.0, "weight_decay": 0.0005}
STAGE1_CHANGES = {
    "cifar10lt_ce": {}, "cifar10lt_focal": {"method": "focal"},
    "cifar10lt_mixup": {"method": "mixup", "mixup_alpha": 1.0},
    "cifar10lt_focal_mixup": {"method": "focal_mixup", "mixup_alpha": 1.0},
    "cifar10_ce": _BALANCED, "cifar10_focal": {**_BALANCED, "method": "focal"},
    "cifar10_mixup": {**_BALANCED, "method": "mixup", "mixup_alpha": 1.0},
    "cifar10_focal_mixup": {**_BALANCED, "method": "focal_mixup", "mixup_alpha": 1.0}}
#: the resume identity of each stage-1 recipe at its defaults (Stage1Run.identity: the settings without paths,
#: the network's and the loss's specs), as the old files gave it: unchanged, so a run resumes across the change
STAGE1_IDENTITY = {
    "cifar10_ce": "34655dfacb2bff90", "cifar10_focal": "22e93fd419dd6013", "cifar10_mixup": "d4ac8bb0c01cc298",
    "cifar10_focal_mixup": "112ce2c0eadfb219", "cifar10lt_ce": "bf6eeda75aaed28e",
    "cifar10lt_focal": "cdb9b37f3b8f8632", "cifar10lt_mixup": "df68b1dc3e644950",
    "cifar10lt_focal_mixup": "117fbff138eddc37"}
LAS_SETTINGS = {
    "stage1_run_id": None, "checkpoint": None, "epochs": 10, "batch_size": 128, "lr": 0.05, "momentum": 0.9,
    "weight_decay": 0.0002, "smooth_head": 0.3, "smooth_tail": 0.0, "las_shape": "concave", "shift_bn": True,
    "seed": 0, "device": "auto", "amp": True, "channels_last": True, "data_dir": None, "download": False,
    "output_dir": None, "tracking_uri": None, "run_name": None, "resume": True, "n_bins": 15, "n_bootstrap": 1000}
LAS_CHANGES = {"cifar10lt_las": {}, "cifar10_las": {"weight_decay": 0.0005, "smooth_head": 0.1, "smooth_tail": 0.1}}


def _plain(parser: ConfigParser, value) -> bool:
    """Whether ``value`` resolves without building an object or evaluating an expression."""
    if isinstance(value, str):
        if value.startswith("$@run_settings["):  # a switch parsed once (lungcal.runtime.settings): a value
            return True
        return not value.startswith("$") and (not value.startswith("@") or _plain(parser, parser[value[1:]]))
    if isinstance(value, dict):
        return "_target_" not in value and all(_plain(parser, v) for v in value.values())
    if isinstance(value, list):
        return all(_plain(parser, v) for v in value)
    return True


def _arguments(parser: ConfigParser, section: str) -> dict:
    """A section's arguments, each reference to a value resolved (``"@lr"`` -> 0.1); objects and expressions as
    written."""
    return {k: parser.get_parsed_content(f"{section}#{k}") if _plain(parser, v) and isinstance(v, str) else v
            for k, v in parser[section].items()}


@pytest.mark.parametrize("name", STAGE1_BUNDLES)
def test_each_stage1_recipe_resolves_to_the_values_of_the_old_files(name):
    p = load_bundle(recipe_files(name))
    want = {**STAGE1_SETTINGS, **STAGE1_CHANGES[name]}
    settings = p.get_parsed_content("settings")
    assert settings == want
    assert _arguments(p, "optimizer") == {"_target_": "torch.optim.SGD", "params": "$@network.parameters()",
                                          "lr": 0.1, "momentum": 0.9, "weight_decay": want["weight_decay"]}
    assert _arguments(p, "lr_scheduler") == {
        "_target_": "cifar_baselines.schedule.warmup_step_lr", "optimizer": "@optimizer",
        "steps_per_epoch": "$len(@train::data)", "warmup_epochs": 5, "milestones": [160, 180], "gamma": 0.1}
    focal = want["method"].startswith("focal")
    assert _arguments(p, "loss") == ({"_target_": "lungcal.calibration.losses.FocalLoss", "gamma": 3.0, "alpha": None}
                                     if focal else {"_target_": "torch.nn.CrossEntropyLoss"})
    assert _arguments(p, "data") == {
        "_target_": "cifar_baselines.data.load_splits", "dataset": want["dataset"], "data_dir": None,
        "output_dir": None, "download": False, "imb_factor": want["imb_factor"], "val_per_class": 500, "seed": 0,
        "subset": None, "device": "auto"}
    assert _arguments(p, "train#step") == {
        "_target_": "cifar_baselines.steps.TrainStep", "num_classes": 10, "mixup_alpha": want["mixup_alpha"],
        "augment": True, "amp": True, "channels_last": True, "seed": 0}
    assert p.get_parsed_content("train#data#batch_size") == 128
    assert p.get_parsed_content("train#trainer#max_epochs") == 200
    # the resume identity is what it was: a run started from the old files resumes from the new ones
    workflow = Stage1Run(p.get_parsed_content("network_def"), None, settings["dataset"], settings["method"],
                         settings=settings, loss=p.get_parsed_content("loss"))
    assert workflow.identity() == STAGE1_IDENTITY[name]


@pytest.mark.parametrize("name", ["cifar10_las", "cifar10lt_las"])
def test_each_las_recipe_resolves_to_the_values_of_the_old_files(name):
    p = load_bundle(recipe_files(name))
    want = {**LAS_SETTINGS, **LAS_CHANGES[name]}
    assert p.get_parsed_content("settings") == want
    assert _arguments(p, "optimizer") == {
        "_target_": "torch.optim.SGD", "params": "$cifar_baselines.stages.trainable_head(@network)", "lr": 0.05,
        "momentum": 0.9, "weight_decay": want["weight_decay"]}
    assert _arguments(p, "loss") == {
        "_target_": "lungcal.calibration.losses.LabelAwareSmoothingLoss", "class_counts": "$@data.class_counts",
        "smooth_head": want["smooth_head"], "smooth_tail": want["smooth_tail"], "shape": "concave"}
    assert _arguments(p, "lr_scheduler") == {
        "_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "optimizer": "@optimizer",
        "T_max": "$max(1, @epochs * len(@train::data))"}
    assert _arguments(p, "train#data") == {
        "_target_": "cifar_baselines.batches.BatchIterator", "x": "$@data.train_x", "y": "$@data.train_y",
        "batch_size": 128, "sampler": "balanced", "seed": 0}
    assert p.get_parsed_content("train#trainer#max_epochs") == 10
    assert p.get_parsed_content("workflow#shift_bn") is True


def _targets(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == "_target_" else _targets(value)
    elif isinstance(node, list):
        for value in node:
            yield from _targets(value)


@pytest.mark.parametrize("name", RECIPES)
def test_cifar_and_ct_bundles_share_the_skeleton_keys(name):
    """Issue 33: both halves run the skeleton from the same keys: ``workflow`` (the run object), a ``post_hoc``
    list (stage 1), seeding in ``initialize``, ``settings`` by reference, ``store``, ``evaluation``, and only
    fully qualified ``_target_``s."""
    ct = json.loads((ROOT / "bundles" / "nlst_focal.json").read_text())
    cifar = load_bundle(recipe_files(name)).get()  # the recipe merged over its base
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
    p = load_bundle(STAGE1_BASE, {"post_hoc": ["vector", "ts"], "data_dir": str(fake_cifar)})
    assert p.get_parsed_content("evaluation").post_hoc == ["vector", "ts"]
    with pytest.raises(Exception) as info:
        load_bundle(STAGE1_BASE, {"post_hoc": ["tz"]}).get_parsed_content("evaluation")
    error = find_lungcal_error(info.value)  # MONAI wraps what a constructor raises
    assert isinstance(error, ConfigError) and error.field == "post_hoc"


def test_unknown_override_is_config_error():
    with pytest.raises(ConfigError, match="epochz"):
        load_bundle(recipe_files("cifar10_ce"), {"epochz": 3})
    assert main(["bundles/nope.json"]) == 2


def test_focal_alpha_is_wired(fake_cifar):
    alpha = [0.05] * 5 + [0.15] * 5
    p = load_bundle(recipe_files("cifar10lt_focal"), {"focal_alpha": alpha, "data_dir": str(fake_cifar),
                                                     "val_per_class": 5})
    loss = p.get_parsed_content("loss")
    torch.testing.assert_close(loss.alpha, torch.tensor(alpha))


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
@pytest.mark.parametrize("method", METHODS)
def test_each_stage1_bundle_runs_tiny(dataset, method, store):
    res = run_bundle(recipe_files(f"{dataset}_{method}"), {**store, **TINY, "imb_factor": 0.1})
    assert res["temperature"] > 0 and Path(res["checkpoint"]).is_file()
    assert res["test_ts"]["acc"] == pytest.approx(res["test"]["acc"])  # TS never changes the argmax
    run = MlflowClient(store["tracking_uri"]).get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["lungcal.stage1"] == method


def test_post_hoc_list_makes_one_child_run_per_name(store):
    """``post_hoc`` names the calibrators: each is fitted on validation in its own run under the stage-1 run."""
    res = run_bundle(STAGE1_BASE, {**store, **TINY, "post_hoc": ["ts", "vector"]})
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
    s1 = run_bundle(recipe_files(f"{dataset}_ce"), {**store, **TINY})
    res = run_bundle(recipe_files(f"{dataset}_las"), {**store, "checkpoint": s1["checkpoint"], "epochs": 1,
                                                     "batch_size": 32, "n_bootstrap": 10})
    run = MlflowClient(store["tracking_uri"]).get_run(res["run_id"])
    assert run.data.tags["lungcal.stage2"] == "las" and run.data.tags["lungcal.parent_run"] == s1["run_id"]
    assert 0 <= res["test"]["ece"] <= 1


def test_loss_swap_by_config_alone(store):
    """Another loss is one edit of ``loss``: here LAS's smoothing loss trains stage 1 of the CE bundle."""
    swap = {"loss": {"_target_": "lungcal.calibration.losses.LabelAwareSmoothingLoss",
                     "class_counts": "$@data.class_counts", "smooth_head": 0.2, "smooth_tail": 0.05}}
    p = load_bundle(STAGE1_BASE, {**store, **TINY, **swap})
    assert isinstance(p.get_parsed_content("train#trainer").loss_function, LabelAwareSmoothingLoss)
    res = run_bundle(STAGE1_BASE, {**store, **TINY, **swap})
    assert MlflowClient(store["tracking_uri"]).get_run(res["run_id"]).info.status == "FINISHED"


def test_network_swap_by_config_alone(store):
    """``network_def`` takes any classifier of 32x32 RGB images, here MONAI's 2D ResNet-10."""
    swap = {"network_def": {"_target_": "monai.networks.nets.resnet10", "spatial_dims": 2, "n_input_channels": 3,
                            "num_classes": 10}}
    p = load_bundle(recipe_files("cifar10_mixup"), {**store, **TINY, **swap})
    assert isinstance(p.get_parsed_content("network"), ResNet)
    res = run_bundle(recipe_files("cifar10_mixup"), {**store, **TINY, **swap})
    assert 0 <= res["test"]["acc"] <= 1


def test_monai_bundle_run_cli(store):
    """``python -m monai.bundle run`` (what ``lungcal study`` calls) runs a CIFAR bundle end to end."""
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(recipe_files("cifar10lt_focal"))]
    for k, v in {**store, **TINY}.items():
        cmd += [f"--{k}", v if isinstance(v, str) else json.dumps(v)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(store["tracking_uri"])
    exp = client.get_experiment_by_name("cifar10lt")
    runs = client.search_runs([exp.experiment_id], "tags.`lungcal.stage1` = 'focal'")
    assert any(r.data.tags["lungcal.stage2"] == "ts" and r.info.status == "FINISHED" for r in runs)


def test_a_nested_override_reaches_the_object_the_params_and_the_resolved_config(store):
    """Issue 44 item 3: ``--optimizer#momentum``, ``--loss#gamma`` and ``--train#data#batch_size`` over a recipe
    reach the objects, the run's params and ``config/resolved.json`` (so the resume identity too), as the CT
    bundles' nested overrides do (tests/bundles/test_ct_bundles.py)."""
    nested = {"optimizer#momentum": 0.8, "loss#gamma": 2.0, "train#data#batch_size": 16}
    files = recipe_files("cifar10lt_focal")
    p = load_bundle(files, {**store, **TINY, **nested})
    assert p.get_parsed_content("optimizer").defaults["momentum"] == 0.8
    assert p.get_parsed_content("loss").gamma == 2.0 and p.get_parsed_content("train#data").batch_size == 16
    over = {**store, **TINY, **nested, "run_name": "t-nested"}
    monai_run(config_file=files, logging_file=False, **over)  # python -m monai.bundle run, in process
    client = MlflowClient(store["tracking_uri"])
    exp = client.get_experiment_by_name("cifar10lt")
    run = client.search_runs([exp.experiment_id], "attributes.run_name = 't-nested'")[0]
    params = run.data.params
    assert (params["momentum"], params["loss.gamma"], params["batch_size"]) == ("0.8", "2.0", "16")
    resolved = json.loads(Path(client.download_artifacts(run.info.run_id, CONFIG_ARTIFACT)).read_text())
    assert resolved["settings"]["momentum"] == 0.8 and resolved["settings"]["batch_size"] == 16
    assert resolved["loss"]["_target_"] == "lungcal.calibration.losses.FocalLoss" and resolved["loss"]["gamma"] == 2.0


def test_user_error_under_monai_bundle_run_is_one_line_and_exit_2(store):
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(recipe_files("cifar10_ce")),
           "--data_dir", store["data_dir"], "--subset", "5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lungcal: error: ") and "subset=5 is too small" in last and "Traceback" not in proc.stderr


def test_a_stage1_checkpoint_feeds_las_and_ckpt_export(store, tmp_path):
    s1 = run_bundle(recipe_files("cifar10_focal"), {**store, **TINY})
    ts = tmp_path / "model.ts"  # python -m monai.bundle ckpt_export, in process
    ckpt_export(net_id="network_def", filepath=str(ts), ckpt_file=s1["checkpoint"], key_in_ckpt="state_dict",
                config_file=recipe_files("cifar10_focal"))
    exported = torch.jit.load(str(ts)).eval()
    net = resnet32().eval()
    net.load_state_dict(torch.load(s1["checkpoint"], weights_only=True)["state_dict"])
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(exported(x), net(x))
    p = load_bundle(recipe_files("cifar10_las"), {**store, "checkpoint": s1["checkpoint"]})
    assert isinstance(p.get_parsed_content("workflow"), LASRun)
    assert isinstance(p.get_parsed_content("loss"), LabelAwareSmoothingLoss)
    params = p.get_parsed_content("optimizer").param_groups[0]["params"]
    net = p.get_parsed_content("network")
    assert {id(q) for q in params} == {id(q) for q in net.head.parameters()}
    assert not any(q.requires_grad for n, q in net.named_parameters() if not n.startswith("head."))
