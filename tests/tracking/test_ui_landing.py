"""The MLflow UI opens where the comparison is (issue 35 item 6).

Without a browser: the address's form, the experiment tags a new or an old experiment gets (model-training
kind, lungcal's saved runs-table view in the envelope MLflow 3.17's UI reads), what ``lungcal ui`` and a run's
summary print, and that the installed UI still knows the names this relies on. With chromium installed:
``scripts/ui_check.py`` opens the printed address in headless chromium against a real ``mlflow ui`` and checks
the screenshot exists and the rendered page is the runs table with the study's columns, each TS run right
under its stage-1 run (``-m slow``: about 2.5 minutes on two busy cores, starting ``mlflow ui`` and two page
loads; skipped where no chromium is installed).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from lungcal.cli import main
from lungcal.tracking import (
    EXPERIMENT_KIND_TRAINING,
    MLFLOW_EXPERIMENT_KIND,
    MLFLOW_SAVED_VIEW_PREFIX,
    RUNS_VIEW_ID,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
)
from lungcal.tracking.runs_view import VIEW_VERSION, runs_url, saved_view_tag, view_state
from lungcal.tracking.ui import open_with_lines
from lungcal.workflow.summary import summary_lines

ROOT = Path(__file__).resolve().parents[2]
VIEW_TAG = MLFLOW_SAVED_VIEW_PREFIX + RUNS_VIEW_ID
QUERY = "workflowType=machine_learning&viewStateShareKey=lungcal-study"
STUDY_COLUMNS = ["metrics.`test/ece`", "metrics.`test/ece_ci_low`", "metrics.`test/ece_ci_high`",
                 "metrics.`temperature`", "metrics.`test/auc`", "metrics.`test/auc_ci_low`",
                 "metrics.`test/auc_ci_high`", f"tags.`{TAG_STAGE1}`", f"tags.`{TAG_STAGE2}`"]


def _stage1_and_ts(uri: str, experiment: str = "nlst") -> tuple[str, str]:
    with RunTracker(experiment, "focal-20261204-083100", tracking_uri=uri,
                    tags={TAG_STAGE1: "focal", TAG_STAGE2: "none"}) as s1:
        s1.log_report("test", {"auc": 0.74, "auc_ci_low": 0.67, "auc_ci_high": 0.81, "ece": 0.08,
                               "ece_ci_low": 0.05, "ece_ci_high": 0.12})
    with RunTracker(experiment, "focal-20261204-083100+ts", tracking_uri=uri, parent_run_id=s1.run_id,
                    tags={TAG_STAGE1: "focal", TAG_STAGE2: "ts"}) as ts:
        ts.log_metrics({"temperature": 1.37})
    return s1.run_id, ts.run_id


def _view(tags: dict) -> dict:
    """The saved view as MLflow 3.17's UI reads it: an envelope with a string name, a number createdAt and a
    string state, the state being the JSON of the search facets and the table's state."""
    envelope = json.loads(tags[VIEW_TAG])
    assert isinstance(envelope["name"], str) and isinstance(envelope["createdAt"], int)
    assert isinstance(envelope["state"], str)
    return json.loads(envelope["state"])


def test_runs_url_names_the_training_mode_and_the_saved_view():
    assert runs_url("7", "http://127.0.0.1:5123") == f"http://127.0.0.1:5123/#/experiments/7/runs?{QUERY}"
    assert runs_url("7") == f"http://127.0.0.1:5000/#/experiments/7/runs?{QUERY}"


def test_a_new_experiment_gets_the_training_kind_and_the_study_view(tmp_path):
    uri = default_tracking_uri(tmp_path)
    _stage1_and_ts(uri)
    tags = MlflowClient(uri).get_experiment_by_name("nlst").tags
    assert tags[MLFLOW_EXPERIMENT_KIND] == EXPERIMENT_KIND_TRAINING == "custom_model_development"
    state = _view(tags)
    assert state["selectedColumns"][:len(STUDY_COLUMNS)] == STUDY_COLUMNS
    # ordered by run name, ascending: each `<stage-1 name>+ts` run is the row right under its stage-1 run
    assert (state["orderByKey"], state["orderByAsc"]) == ("tags.`mlflow.runName`", True)
    assert state["columnOrder"][0] == "attributes.`Run Name`"
    assert state["columnOrder"][1:len(STUDY_COLUMNS) + 1] == STUDY_COLUMNS
    assert set(state["columnWidths"]) == set(state["columnOrder"])
    assert not state["searchFilter"] and state["lifecycleFilter"] == "Active"


def test_cifar_experiments_show_accuracy_where_ct_shows_auc():
    cols = view_state("cifar10lt")["selectedColumns"]
    assert "metrics.`test/acc`" in cols and "metrics.`test/acc_ci_low`" in cols
    assert not any("auc" in c for c in cols) and "tags.`lungcal.site`" not in cols


def test_an_older_experiment_gets_the_view_and_a_user_view_is_kept(tmp_path):
    uri = default_tracking_uri(tmp_path)
    client = MlflowClient(uri)
    exp_id = client.create_experiment("nlst")  # as lungcal made them before: no kind, no view
    _stage1_and_ts(uri)
    tags = client.get_experiment(exp_id).tags
    assert tags[MLFLOW_EXPERIMENT_KIND] == EXPERIMENT_KIND_TRAINING and _view(tags)["lungcalView"] == VIEW_VERSION

    mine = json.dumps({"name": "mine", "createdAt": 1, "updatedAt": 1, "state": json.dumps({"orderByKey": "x"})})
    client.set_experiment_tag(exp_id, VIEW_TAG, mine)  # saved over lungcal's from the UI: left alone
    _stage1_and_ts(uri)
    assert client.get_experiment(exp_id).tags[VIEW_TAG] == mine

    key, value = saved_view_tag("nlst")
    old = json.loads(value)
    old["state"] = json.dumps({**json.loads(old["state"]), "lungcalView": VIEW_VERSION - 1})
    client.set_experiment_tag(exp_id, key, json.dumps(old))  # written by an older lungcal: brought up to date
    _stage1_and_ts(uri)
    assert _view(client.get_experiment(exp_id).tags)["lungcalView"] == VIEW_VERSION


def test_lungcal_ui_prints_each_experiments_runs_table(tmp_path, capsys):
    uri = default_tracking_uri(tmp_path)
    _stage1_and_ts(uri, "nlst")
    _stage1_and_ts(uri, "cifar10")
    client = MlflowClient(uri)
    ids = {n: client.get_experiment_by_name(n).experiment_id for n in ("nlst", "cifar10")}
    client.delete_experiment_tag(ids["cifar10"], VIEW_TAG)  # lungcal ui writes a missing view
    assert main(["ui", "--tracking-uri", uri, "--port", "5123", "--print-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5123"
    assert out[1:] == [f"then open nlst     http://127.0.0.1:5123/#/experiments/{ids['nlst']}/runs?{QUERY}",
                       f"then open cifar10  http://127.0.0.1:5123/#/experiments/{ids['cifar10']}/runs?{QUERY}"]
    assert VIEW_TAG in client.get_experiment(ids["cifar10"]).tags

    assert main(["ui", "--tracking-uri", uri, "--experiment", "cifar10", "--print-only"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        f"then open cifar10  http://127.0.0.1:5000/#/experiments/{ids['cifar10']}/runs?{QUERY}"]
    assert main(["ui", "--tracking-uri", uri, "--experiment", "cifar10lt", "--print-only"]) == 2
    assert "no MLflow experiment named 'cifar10lt'" in capsys.readouterr().err


def test_the_end_of_run_summary_prints_the_same_address(tmp_path):
    uri = default_tracking_uri(tmp_path)
    s1, ts = _stage1_and_ts(uri)
    exp_id = MlflowClient(uri).get_run(s1).info.experiment_id
    text = summary_lines("focal (stage 1) + TS", [], tmp_path, uri, [("stage 1", s1), ("+ TS", ts)])
    assert f"  open with      mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000" in text
    assert f"  then open      http://127.0.0.1:5000/#/experiments/{exp_id}/runs?{QUERY}" in text
    # a run the store does not hold: the UI's front page, never a traceback
    assert open_with_lines(uri, "0" * 32)[1].endswith(" http://127.0.0.1:5000")


def test_the_installed_ui_still_reads_what_lungcal_writes():
    """The names come from MLflow 3.17's UI bundle; a later MLflow that drops one breaks the landing."""
    js = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(p.read_text(encoding="utf-8", errors="replace") for p in js.glob("*.js"))
    for needle in ('"viewStateShareKey"', f'"{MLFLOW_SAVED_VIEW_PREFIX}"', 'get("workflowType")',
                   'MACHINE_LEARNING="machine_learning"', '"selectedColumns","columnOrder","columnWidths"',
                   'RUN_NAME:"tags.`mlflow.runName`"', '"mlflow.experimentKind"'):
        assert needle in text, f"MLflow {mlflow.__version__}'s UI no longer has {needle}"


def _chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if name and (path := shutil.which(name)):
            return path
    return None


@pytest.mark.slow  # about 2.5 min on two busy cores: `mlflow ui` starting, two page loads (scripts/ui_check.py)
@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (apt-get install chromium, or set $CHROMIUM): "
                                                "the headless-browser check of the MLflow UI's landing page is skipped")
def test_the_printed_address_opens_the_runs_table_in_a_browser(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ui_check.py"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "ui_check.json").read_text())
    assert result["url"].endswith(QUERY) and "/#/experiments/1/runs?" in result["url"]
    assert (tmp_path / "ui_check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = (tmp_path / "ui_check_dom.html").read_text()
    assert result["runs_table"] and not result["genai_overview"] and "ag-root" in dom
    headers = [h for h in result["headers"] if h.startswith(("test/", "temperature", "lungcal."))]
    assert headers[:7] == ["test/ece", "test/ece_ci_low", "test/ece_ci_high", "temperature", "test/auc",
                           "test/auc_ci_low", "test/auc_ci_high"]
    assert {TAG_STAGE1, TAG_STAGE2} <= set(headers) and not any(h.startswith(("train/", "val/")) for h in headers)
    names = result["run_names"]
    assert names[1] == names[0] + "+ts" and names[3] == names[2] + "+ts"
