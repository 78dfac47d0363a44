"""``lungcal report --sections classes,posthoc``: accuracy by class and the post-hoc fixes, read back from MLflow."""
from __future__ import annotations

import ast

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from sklearn.metrics import recall_score

from cifar_baselines.bundle import run_bundle
from lungcal.calibration.posthoc import POSTHOC_METHODS
from lungcal.cli import main
from lungcal.errors import ConfigError
from lungcal.study.report import build_report
from lungcal.study.sections import SECTIONS, parse_sections
from lungcal.tracking import TAG_DATASET, TAG_STAGE1, TAG_STAGE2, RunTracker, default_tracking_uri
from tests.calibration.test_class_accuracy import fading_tail
from tests.cifar_baselines.cifar_fakes import tiny_stage1_run, write_fake_cifar


def test_sections_parse_in_report_order():
    assert parse_sections(None) == ("study",)
    assert parse_sections("posthoc, classes") == ("classes", "posthoc")
    assert parse_sections("all") == SECTIONS
    with pytest.raises(ConfigError, match="unknown report section.*fancy"):
        parse_sections("classes,fancy")


def _log_predictions(uri, tmp_path, pred, y):
    """A finished CE stage-1 run of cifar10lt whose logged test predictions have argmax ``pred``."""
    probs = np.full((len(y), 10), 0.01)
    probs[np.arange(len(y)), pred] = 0.91
    np.savez(tmp_path / "test_predictions.npz", logits=np.log(probs), probs=probs, labels=y)
    tags = {TAG_DATASET: "cifar10lt", TAG_STAGE1: "ce", TAG_STAGE2: "none"}
    with RunTracker("cifar10lt", "ce-none", tracking_uri=uri, tags=tags) as tr:
        tr.log_metrics({"test/ece": 0.1})
        tr.log_artifact(tmp_path / "test_predictions.npz", "predictions")


def test_classes_section_is_sklearn_recall_per_class_and_group(tmp_path, capsys):
    uri = default_tracking_uri(tmp_path)
    pred, y = fading_tail(1)
    _log_predictions(uri, tmp_path, pred, y)
    with RunTracker("cifar10lt", "ce-las", tracking_uri=uri,
                    tags={TAG_DATASET: "cifar10lt", TAG_STAGE1: "ce", TAG_STAGE2: "las"}) as tr:
        tr.log_metrics({"test/ece": 0.1})  # finished, but no predictions: listed as left out
    assert main(["report", "--experiment", "cifar10lt", "--tracking-uri", uri, "--out", str(tmp_path / "r"),
                 "--no-log", "--sections", "classes", "--n-bootstrap", "50"]) == 0
    out = capsys.readouterr().out
    recall = recall_score(y, pred, average=None)
    row = next(line for line in out.splitlines() if line.startswith("| CE + none | 600 |"))
    assert f"| {100 * (pred == y).mean():.2f} | {100 * recall[:3].mean():.2f} [" in row
    assert f"{100 * recall[7:].mean():.2f} [" in row
    per_class = [line for line in out.splitlines() if line.startswith("| CE + none |")][1]
    assert per_class == "| CE + none | " + " | ".join(f"{100 * r:.1f}" for r in recall) + " |"
    assert "| configuration | n | ACC | many (0-2) | medium (3-6) | few (7-9) |" in out
    assert "left out): CE + LAS." in out
    assert "| stage 1 |" not in out  # the study tables are not asked for
    page = (tmp_path / "r" / "report.html").read_text()
    assert "<h2>Accuracy by class (test)</h2>" in page and "<th>many (0-2)</th>" in page
    assert main(["report", "--experiment", "cifar10lt", "--tracking-uri", uri, "--sections", "nope"]) == 2
    assert "unknown report section(s) nope" in capsys.readouterr().err


@pytest.fixture(scope="module")
def lt_folder(tmp_path_factory):
    return write_fake_cifar(tmp_path_factory.mktemp("fake_cifar"), n_train_per_class=40, n_test_per_class=8)


def test_posthoc_section_on_a_stage1_run_and_its_las_run(lt_folder, tmp_path, monkeypatch):
    run_id, uri = tiny_stage1_run("cifar10lt_focal", lt_folder, tmp_path, monkeypatch)
    las = run_bundle("bundles/cifar10lt_las.json", {"data_dir": str(lt_folder), "output_dir": str(tmp_path),
                                                    "tracking_uri": uri, "batch_size": 64, "n_bootstrap": 20,
                                                    "stage1_run_id": run_id, "epochs": 1})
    res = build_report("cifar10lt", tmp_path / "rep", tracking_uri=uri, log_run=False,
                       sections=("study", "posthoc"), n_bootstrap=20)
    md = res["markdown"].read_text()
    assert "| stage 1 |" in md and md.index("| stage 1 |") < md.index("## Post-hoc")  # study first
    part = md[md.index("## Post-hoc fixes side by side (test)"):]
    client = MlflowClient(uri)
    assert part.count("| post-hoc |") == 1  # one stage-1 run; the TS and LAS runs get no table of their own
    rows = [line for line in part.splitlines() if line.startswith("| ") and not line.startswith("| post-hoc")]
    las_name = client.get_run(las["run_id"]).info.run_name
    assert [r.split(" | ")[0][2:] for r in rows] == [*POSTHOC_METHODS, f"LAS: {las_name}"]
    logged = client.get_run(run_id).data.metrics
    assert rows[0].split(" | ")[2] == f"{100 * logged['test/acc']:.2f}"  # none = the run's own test score
    assert rows[-1].split(" | ")[2] == f"{100 * client.get_run(las['run_id']).data.metrics['test/acc']:.2f}"
    assert "0 (same argmax)" in rows[1]  # TS: the accuracy difference is exactly 0
    assert f"vector − LAS {las_name} (pp): ΔECE " in part and "; ΔACC " in part
    counts = ast.literal_eval(client.get_run(run_id).data.params["class_counts"])
    assert f"training class counts {[int(c) for c in counts]}" in part and counts[0] > counts[-1]
    assert "<h2>Post-hoc fixes side by side (test)</h2>" in res["html"].read_text()
