"""RunTracker: names, statuses, privacy filtering, parent links (against a real SQLite store)."""
from __future__ import annotations

import multiprocessing as mp

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch
from mlflow.tracking import MlflowClient

from lungcal import paths, tracking
from lungcal.errors import ConfigError, TrackingError
from lungcal.tracking import ACQUISITION_ARTIFACT, RunTracker, run_acquisition_summary


def test_default_uri_and_output_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LUNGCAL_HOME", str(tmp_path / "home"))
    assert paths.default_output_dir() == (tmp_path / "home").resolve()
    assert tracking.default_tracking_uri() == f"sqlite:///{(tmp_path / 'home' / 'mlflow.db').resolve().as_posix()}"
    assert tracking.default_tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve().as_posix()}/mlflow.db"
    monkeypatch.delenv("LUNGCAL_HOME")
    monkeypatch.chdir(tmp_path)
    assert paths.default_output_dir() == (tmp_path / "runs").resolve()


def test_flatten_and_privacy_filter():
    flat = tracking.flatten_config({"a": {"b": 1, "c": [1, 2]}, "d": [{"e": "x"}], "f": None, "g": {}})
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "d.0.e": "x", "f": "None", "g": "{}"}
    filt = tracking.privacy_filter({"datalist": "/data/DOE^JOHN/list.json", "loss": "focal", "lr": "0.01",
                             "img": "scan_12345.nii.gz", "uri": "http://server:5000"})
    assert filt["datalist"].startswith("path:") and "DOE" not in filt["datalist"]
    assert filt["img"].startswith("path:")
    assert filt["loss"] == "focal" and filt["lr"] == "0.01" and filt["uri"] == "http://server:5000"


def test_run_finished_with_everything(tmp_path):
    uri = tracking.default_tracking_uri(tmp_path)
    with tracking.RunTracker("unit", "stage1-ce", tracking_uri=uri, tags={tracking.TAG_STAGE1: "ce"}) as tr:
        tr.log_params({"loss": {"name": "focal", "gamma": 2.0}, "datalist": "/secret/PATIENT_X/d.json"})
        tr.log_metrics({"train/loss": 0.5}, step=1)
        tr.log_report("test", {"ece": 0.1, "auc": 0.8, "ece_ci_low": 0.05, "ece_mode": "top_label"})
        fig = plt.figure()
        tr.log_figure(fig, "plots/rel.png")
        tr.log_dict({"a": 1}, "config/resolved.json")
        tr.log_model(torch.nn.Linear(3, 2), extra={"in": 3})
        parent = tr.run_id
    with tracking.RunTracker("unit", "stage2-ts", tracking_uri=uri, parent_run_id=parent,
                             tags={tracking.TAG_STAGE2: "ts"}) as child:
        child_id = child.run_id
    c = MlflowClient(uri)
    run = c.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.params["loss.gamma"] == "2.0"
    assert "PATIENT_X" not in run.data.params["datalist"]
    assert run.data.metrics["test/ece"] == pytest.approx(0.1)
    assert run.data.params["test/ece_mode"] == "top_label"
    assert run.info.run_name == "stage1-ce"
    arts = {a.path for a in c.list_artifacts(parent)}
    assert {"plots", "config", "model"} <= arts
    assert {a.path for a in c.list_artifacts(parent, "model")} == {"model/state_dict.pt", "model/architecture.json"}
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").resolve().as_uri())
    ch = c.get_run(child_id)
    assert ch.data.tags[tracking.TAG_PARENT] == parent and ch.data.tags["mlflow.parentRunId"] == parent


def test_failed_run_is_marked_failed(tmp_path):
    uri = tracking.default_tracking_uri(tmp_path)
    with pytest.raises(RuntimeError):
        with tracking.RunTracker("unit", "boom", tracking_uri=uri) as tr:
            rid = tr.run_id
            raise RuntimeError("boom")
    assert MlflowClient(uri).get_run(rid).info.status == "FAILED"


def test_bad_uri_is_tracking_error(tmp_path):

    with pytest.raises(TrackingError):
        tracking.RunTracker("unit", "x", tracking_uri=str(tmp_path / "mlruns"))


def test_experiments_open_on_the_training_runs_table(tmp_path):
    """MLflow 3's UI opens an untagged experiment on the GenAI overview, where no runs show."""
    uri = tracking.default_tracking_uri(tmp_path)
    client = MlflowClient(uri)
    old = client.create_experiment("legacy")  # made before the tag existed
    with tracking.RunTracker("fresh", "r", tracking_uri=uri):
        pass
    with tracking.RunTracker("legacy", "r", tracking_uri=uri):
        pass
    for exp in (client.get_experiment_by_name("fresh"), client.get_experiment(old)):
        kind = exp.tags[tracking.MLFLOW_EXPERIMENT_KIND]
        assert kind == tracking.EXPERIMENT_KIND_TRAINING == "custom_model_development"


def test_run_acquisition_summary_reads_what_a_stage1_run_logged(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = {"version": 1, "split": "train", "n": 3, "fields": {"noise_hu": {"n": 3, "mean": 20.0}},
               "profiles": {"vendor_a": 2, "vendor_b": 1}}
    with RunTracker("nlst", "stage1", tracking_uri=uri) as tr:
        tr.log_dict(summary, ACQUISITION_ARTIFACT)
        logged = tr.run_id
    with RunTracker("nlst", "older", tracking_uri=uri) as tr:
        tr.log_dict({"x": 1}, "config/resolved.json")
        older = tr.run_id
    assert ACQUISITION_ARTIFACT == "data/acquisition.json"
    assert run_acquisition_summary(uri, logged) == summary
    assert run_acquisition_summary(uri, older) is None  # a run made before the summary existed
    with pytest.raises(ConfigError, match="no MLflow run"):
        run_acquisition_summary(uri, "0" * 32)


def _open_at_once(uri: str, name: str, barrier) -> str:
    barrier.wait()  # every process opens the new store at the same moment
    try:
        with RunTracker("cifar10lt", name, tracking_uri=uri):
            pass
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def test_runs_started_at_once_on_a_new_sqlite_store_all_open_it(tmp_path):
    """Two study lanes started together on a fresh store raced MLflow's table creation ("Online migration
    expected to match one row"); the creation lock beside the database serialises the first opening."""
    ctx = mp.get_context("fork")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    barrier = ctx.Manager().Barrier(3)
    with ctx.Pool(3) as pool:
        results = pool.starmap(_open_at_once, [(uri, f"lane{i}", barrier) for i in range(3)])
    assert results == ["ok", "ok", "ok"]
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("cifar10lt").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["lane0", "lane1", "lane2"]
