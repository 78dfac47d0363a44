"""What the CIFAR runs record in MLflow (names per DESIGN.md), what they print, and what the LAS stage changes."""
import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from cifar_baselines.bundle import load_bundle, recipe_files, run_bundle
from cifar_baselines.data import COPY_UNVERIFIED, load_splits, pixel_hash
from cifar_baselines.stages import load_stage1
from lungcal.calibration.metrics import calibration_report
from lungcal.errors import ConfigError
from lungcal.study.differences import load_predictions
from lungcal.study.posthoc import load_logits
from lungcal.study.report import reliability_png, risk_coverage_png
from lungcal.tracking import TAG_CALIBRATOR, plot_artifact, predictions_artifact

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _project_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def stage1(fake_cifar, tmp_path_factory):
    out = tmp_path_factory.mktemp("cifar_wf")
    common = {"data_dir": str(fake_cifar), "output_dir": str(out), "tracking_uri": f"sqlite:///{out}/mlflow.db",
              "batch_size": 64, "n_bootstrap": 20, "val_per_class": 5}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        res = run_bundle(recipe_files("cifar10lt_focal_mixup"), {**common, "epochs": 2, "warmup_epochs": 1,
                                                                "lr_milestones": [1], "imb_factor": 0.1})
    return common, res, printed.getvalue()


def test_stage1_and_ts_runs_are_tracked(stage1):
    common, res, _ = stage1
    assert res["temperature"] > 0 and Path(res["checkpoint"]).is_file()
    assert res["test_ts"]["acc"] == pytest.approx(res["test"]["acc"])  # TS never changes the argmax
    c = MlflowClient(common["tracking_uri"])
    r1, r2 = c.get_run(res["run_id"]), c.get_run(res["ts_run_id"])
    assert c.get_experiment(r1.info.experiment_id).name == "cifar10lt"
    assert r1.data.tags["lungcal.dataset"] == "cifar10lt" and r1.data.tags["lungcal.stage1"] == "focal_mixup"
    assert r1.data.tags["lungcal.site"] == "cifar"
    assert r1.data.tags["lungcal.stage2"] == "none" and r2.data.tags["lungcal.stage2"] == "ts"
    assert r2.data.tags["lungcal.parent_run"] == r1.info.run_id and r2.data.tags[TAG_CALIBRATOR] == "ts"
    for key in ("test/ece", "test/acc", "test/ece_ci_low", "test/mean_confidence", "val/ece"):
        assert key in r1.data.metrics and key in r2.data.metrics
    assert "temperature" in r2.data.metrics and "train_wall_s" in r1.data.metrics
    assert r2.data.params["fit_split"] == "val" and r1.data.params["post_hoc"] == '["ts"]'
    params = r1.data.params
    assert params["method"] == "focal_mixup" and params["epochs"] == "2" and params["weight_decay"] == "0.0002"
    assert params["focal_alpha"] == "None" and params["mixup_alpha"] == "1.0" and "wd" not in params
    assert params["data_dir"].startswith("path:")  # privacy filter: no paths in params
    assert {"train_precision", "class_counts", "n_train", "split_fingerprint"} <= set(params)
    for name in ("train/loss", "train/acc", "lr", "val/ece", "val/acc", "val/nll", "val/mean_confidence"):
        assert [m.step for m in c.get_metric_history(r1.info.run_id, name)][:2] == [0, 1], name
    arts = {a.path for a in c.list_artifacts(r1.info.run_id)}
    assert {"model", "predictions", "config", "plots"} <= arts
    for run in (r1, r2):  # the shared names (lungcal.tracking.names), so that `lungcal report` finds them
        assert {a.path for a in c.list_artifacts(run.info.run_id, "predictions")} == {
            predictions_artifact("val", "npz"), predictions_artifact("test", "npz")}
        assert {a.path for a in c.list_artifacts(run.info.run_id, "plots")} == {
            plot_artifact(s, k) for s in ("val", "test") for k in ("reliability", "risk_coverage")}
    assert {a.path for a in c.list_artifacts(r2.info.run_id, "calibrator")} == {
        "calibrator/ts.json", "calibrator/temperature.json"}
    assert r1.info.status == "FINISHED" and r2.info.status == "FINISHED"


def test_stage1_prints_its_test_numbers_run_ids_and_the_las_command(stage1):
    """A run that ends hours after it started says what it measured, what TS changed (a paired difference)
    and the ID the LAS stage needs."""
    common, res, printed = stage1
    lines = printed.splitlines()
    start = lines.index("== cifar_baselines cifar10lt focal_mixup ==")
    summary = "\n".join(lines[start:])
    for report, name in ((res["test"], "focal_mixup"), (res["test_ts"], f"+ TS (T {res['temperature']:.3f})")):
        row = next(line for line in lines[start:] if line.strip().startswith(name))
        assert f"test ACC {100 * report['acc']:.2f}% [{100 * report['acc_ci_low']:.2f}, " in row
        assert f"ECE15 {100 * report['ece']:.2f}% [{100 * report['ece_ci_low']:.2f}, " in row
        assert f"(n={int(report['n'])})" in row
    assert f"{res['run_id']} (stage 1), {res['ts_run_id']} (+TS)" in summary
    assert f"mlflow ui --backend-store-uri {common['tracking_uri']}" in summary
    assert (f"python -m monai.bundle run --config_file bundles/cifar10lt_las.json "
            f"--stage1_run_id {res['run_id']} --output_dir {common['output_dir']} "
            f"--tracking_uri {common['tracking_uri']}") in summary
    d = res["post_hoc"]["ts"]["ece_diff"]
    assert f"ECE TS - none  {100 * d['diff']:+.2f}% [{100 * d['ci_low']:+.2f}, {100 * d['ci_high']:+.2f}]" in summary
    assert d["diff"] == pytest.approx(res["test_ts"]["ece"] - res["test"]["ece"])


def test_the_report_finds_the_cifar_plots_and_predictions_by_name(stage1):
    """``lungcal report`` reads a CIFAR run by the shared artifact names, as it reads a CT run."""
    common, res, _ = stage1
    c = MlflowClient(common["tracking_uri"])
    for run_id in (res["run_id"], res["ts_run_id"]):
        for split in ("val", "test"):
            assert reliability_png(c, run_id, split).startswith(b"\x89PNG")
            assert risk_coverage_png(c, run_id, split).startswith(b"\x89PNG")
    _, probs, labels = load_predictions(c, res["ts_run_id"], "test")
    logits, labels2 = load_logits(c, res["run_id"], "test")
    assert probs.shape == logits.shape == (len(labels), 10) and (labels == labels2).all()
    assert reliability_png(c, res["run_id"], "train") is None  # a plot the run did not log


def test_epoch_metrics_match_the_final_report(stage1):
    """The evaluator's last-epoch val metrics are the final val report's (same float32 logits)."""
    common, res, _ = stage1
    c = MlflowClient(common["tracking_uri"])
    npz = np.load(c.download_artifacts(res["run_id"], predictions_artifact("val", "npz")))
    rep = calibration_report(npz["probs"].astype(np.float64), npz["labels"], n_bins=15, n_bootstrap=0)
    last = {n: c.get_metric_history(res["run_id"], n) for n in ("val/mean_confidence", "val/acc")}
    last = {n: [m.value for m in h if m.step == 1][0] for n, h in last.items()}
    assert last["val/mean_confidence"] == pytest.approx(rep["mean_confidence"], abs=1e-4)
    assert last["val/acc"] == pytest.approx(rep["acc"])


def test_las_from_the_stage1_run_and_from_its_checkpoint(stage1, capsys):
    common, res, _ = stage1
    c = MlflowClient(common["tracking_uri"])
    las = run_bundle("bundles/cifar10lt_las.json", {**{k: v for k, v in common.items() if k != "val_per_class"},
                                                    "stage1_run_id": res["run_id"], "epochs": 1})
    printed = capsys.readouterr().out
    assert "== cifar_baselines cifar10lt focal_mixup + LAS ==" in printed
    assert f"{las['run_id']} (LAS)\n" in printed
    assert f"ECE15 {100 * las['test']['ece']:.2f}%" in printed
    assert f"lungcal report --experiment cifar10lt --tracking-uri {common['tracking_uri']}" in printed
    r3 = c.get_run(las["run_id"])
    assert r3.data.tags["lungcal.stage2"] == "las" and r3.data.tags["lungcal.parent_run"] == res["run_id"]
    assert r3.data.tags["lungcal.stage1"] == "focal_mixup" and "test/ece" in r3.data.metrics
    assert r3.data.params["imb_factor"] == "0.1" and r3.data.params["val_per_class"] == "5"  # the stage-1 splits
    assert las["stage1_run_id"] == res["run_id"]
    # from the checkpoint file, cached-feature path (no BN shift)
    las2 = run_bundle("bundles/cifar10lt_las.json", {**{k: v for k, v in common.items() if k != "val_per_class"},
                                                     "checkpoint": res["checkpoint"], "epochs": 1, "shift_bn": False})
    assert c.get_run(las2["run_id"]).data.tags["lungcal.parent_run"] == res["run_id"]


def test_las_shift_bn_changes_only_the_head_and_bn_statistics(stage1):
    common, res, _ = stage1
    p = load_bundle("bundles/cifar10lt_las.json", {**{k: v for k, v in common.items() if k != "val_per_class"},
                                                   "checkpoint": res["checkpoint"], "epochs": 1, "batch_size": 32})
    old = {k: v.clone() for k, v in load_stage1(checkpoint=res["checkpoint"]).state_dict.items()}
    p.get_parsed_content("train#trainer").run()
    new = p.get_parsed_content("network").state_dict()
    for k, v in old.items():
        if "running_" in k or "num_batches_tracked" in k:
            continue  # shifted BN statistics
        assert torch.equal(v, new[k].cpu()) != k.startswith("head."), k
    assert any(not torch.equal(old[k], new[k].cpu()) for k in old if "running_mean" in k)


def test_las_needs_a_stage1_model(tmp_path):
    with pytest.raises(ConfigError, match="stage1_run_id"):
        load_stage1(None, None)
    with pytest.raises(ConfigError, match="checkpoint"):
        load_stage1(checkpoint=str(tmp_path / "nope.pt"))


def test_stage1_records_its_data_copy_and_pixel_hashes(stage1, fake_cifar):
    """Which pixels a run saw: the copy's name and a hash of the training and test pixels, on every run."""
    common, res, _ = stage1
    params = MlflowClient(common["tracking_uri"]).get_run(res["run_id"]).data.params
    d = load_splits("cifar10lt", data_dir=fake_cifar, imb_factor=0.1, val_per_class=5)
    assert params["data_copy"] == COPY_UNVERIFIED  # the fake files are not the official archive's
    assert params["train_pixels_sha256"] == pixel_hash(d.train_x)
    assert params["test_pixels_sha256"] == pixel_hash(d.test_x)
    assert pixel_hash(d.train_x) != pixel_hash(d.train_x.flip(0))


def test_stage1_reports_the_best_validation_and_best_test_epochs(stage1):
    """The last epoch is the result; the best-val epoch and MiSLAS's best-test epoch are reported beside it."""
    common, res, printed = stage1
    c = MlflowClient(common["tracking_uri"])
    run = c.get_run(res["run_id"])
    test_acc = [m.value for m in sorted(c.get_metric_history(res["run_id"], "epoch_test/acc"), key=lambda m: m.step)]
    # val/acc's history also holds the final report's value (logged after training): the epochs come first
    val_acc = [m.value for m in sorted(c.get_metric_history(res["run_id"], "val/acc"), key=lambda m: m.timestamp)][:2]
    assert len(test_acc) == 2
    assert run.data.metrics["best_test_epoch"] == 1 + int(np.argmax(test_acc))  # the first of ties
    assert run.data.metrics["best_val_epoch"] == 1 + int(np.argmax(val_acc))
    assert run.data.metrics["test_best_test/acc"] == pytest.approx(max(test_acc))
    assert run.data.metrics["test_best_test/acc"] >= run.data.metrics["test/acc"]  # chosen on test: never below
    assert "test_best_val/ece_ci_low" in run.data.metrics
    assert f"best-test epoch [MiSLAS conv.] {int(run.data.metrics['best_test_epoch'])}" in printed
