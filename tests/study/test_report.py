"""The study report, against an MLflow store filled with fake runs through RunTracker."""
from __future__ import annotations

import csv
import math

import matplotlib.pyplot as plt
import pytest
from mlflow.tracking import MlflowClient

from lungcal.cli import main
from lungcal.errors import TrackingError
from lungcal.study.report import (
    Cell,
    best_calibrated,
    build_report,
    collect_tables,
    load_published,
)
from lungcal.tracking import TAG_DATASET, TAG_STAGE1, TAG_STAGE2, RunTracker
from lungcal.tracking.commands import ui_command


def _log(uri, experiment, dataset, s1, s2, acc, auc, ece, half=0.01, status="ok", png=False):
    tags = {TAG_DATASET: dataset, TAG_STAGE1: s1, TAG_STAGE2: s2}
    try:
        with RunTracker(experiment, f"{s1}-{s2}", tracking_uri=uri, tags=tags) as t:
            t.log_metrics({"val/ece": 0.5}, step=1)
            t.log_report("test", {"acc": acc, "acc_ci_low": acc - half, "acc_ci_high": acc + half,
                                  "auc": auc, "auc_ci_low": auc - half, "auc_ci_high": auc + half,
                                  "ece": ece, "ece_ci_low": ece - half, "ece_ci_high": ece + half})
            if png:
                fig, ax = plt.subplots(figsize=(2, 2))
                ax.plot([0, 1], [0, 1])
                t.log_figure(fig, "plots/test_reliability.png")
            if status == "fail":
                raise RuntimeError("boom")
            return t.run_id
    except RuntimeError:
        return None


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlf') / 'mlflow.db'}"
    # nlst: focal+ts clearly best (CIs separate); ce has an older duplicate and a failed run
    _log(uri, "nlst", "synthetic", "ce", "none", 0.70, 0.80, 0.30)  # older, superseded
    _log(uri, "nlst", "synthetic", "ce", "none", 0.72, 0.81, 0.20, png=True)
    _log(uri, "nlst", "synthetic", "ce", "ts", 0.72, 0.81, 0.10)
    _log(uri, "nlst", "synthetic", "focal", "none", 0.74, 0.83, 0.15)
    _log(uri, "nlst", "synthetic", "focal", "ts", 0.74, 0.83, 0.03)
    _log(uri, "nlst", "synthetic", "focal", "las", 0.75, 0.84, 0.0, status="fail")
    # cifar10: overlapping CIs -> nothing marked; published numbers alongside
    _log(uri, "cifar10", "cifar10", "ce", "none", 0.93, 0.99, 0.036, half=0.01)
    _log(uri, "cifar10", "cifar10", "focal", "none", 0.93, 0.99, 0.030, half=0.01)
    return uri


def test_published_numbers_shipped():
    pub = load_published()
    assert pub["cifar10"][("ce", "none", "acc")] == pytest.approx(93.32)
    assert pub["cifar10"][("ce", "none", "ece")] == pytest.approx(3.60)
    assert pub["cifar10"][("focal_mixup", "none", "ece")] == pytest.approx(27.92)
    assert pub["cifar10lt"][("mixup", "las", "acc")] == pytest.approx(81.54)
    assert ("focal_mixup", "none", "acc") not in pub["cifar10"]  # not published: stays empty
    # every number the study's text quotes is shipped
    assert pub["cifar10"][("focal", "none", "acc")] == pytest.approx(92.95)
    assert pub["cifar10"][("mixup", "none", "acc")] == pytest.approx(93.83)
    assert pub["cifar10lt"][("focal", "none", "ece")] == pytest.approx(12.22)
    assert pub["cifar10lt"][("mixup", "las", "ece")] == pytest.approx(5.18)
    assert pub["nlst"][("focal", "none", "ece")] == pytest.approx(16.16)
    assert pub["nlst"][("focal", "ts", "ece")] == pytest.approx(1.54)
    assert pub["ucd"][("ce", "las", "ece")] == pytest.approx(31.03)


def test_best_calibrated_needs_separated_cis():
    a = Cell("d", "ce", "none", "a", {"ece": (0.10, 0.08, 0.12)})
    b = Cell("d", "ce", "ts", "b", {"ece": (0.03, 0.02, 0.04)})
    c = Cell("d", "focal", "ts", "c", {"ece": (0.05, 0.035, 0.07)})
    assert best_calibrated([a, b]) is b
    assert best_calibrated([a, b, c]) is None  # b's high 0.04 > c's low 0.035
    assert best_calibrated([b]) is None


def test_collect_tables_latest_finished_runs(store):
    tables = {t.dataset: t for t in collect_tables("nlst", tracking_uri=store)}
    assert set(tables) == {"synthetic"}
    t = tables["synthetic"]
    assert set(t.cells) == {("ce", "none"), ("ce", "ts"), ("focal", "none"), ("focal", "ts")}  # failed las dropped
    ce = t.cells[("ce", "none")]
    assert ce.n_runs == 2 and ce.get("ece") == pytest.approx((0.20, 0.19, 0.21))
    assert best_calibrated(t.cells.values()) is t.cells[("focal", "ts")]


def test_unknown_experiment_is_a_user_error(store):
    with pytest.raises(TrackingError, match="nlst"):
        collect_tables("nope", tracking_uri=store)


def test_build_report_writes_and_logs(store, tmp_path):
    res = build_report("nlst", tmp_path / "rep", tracking_uri=store)
    md = res["markdown"].read_text()
    assert "| CE | 72.00 [71.00, 73.00] | 0.810 [0.800, 0.820] | 20.00 [19.00, 21.00] |" in md
    assert "**3.00 [2.00, 4.00]**" in md and "Best calibrated: **Focal + TS**" in md
    assert md.count("**") == 2 * 3 + 2  # the three focal+ts cells and the note
    # the synthetic NLST-like cohort beside the numbers published on real NLST, never called NLST itself
    assert "## synthetic (our NLST-like synthetic cohort, not NLST)" in md and "## nlst" not in md.lower()
    header = next(line for line in md.splitlines() if line.startswith("| stage 1"))
    assert "none: ECE % (published on real NLST)" in header and "TS: ECE % (published on real NLST)" in header
    assert "(published)" not in md and "ACC % (published" not in header  # only the ECEs were published
    focal = next(line for line in md.splitlines() if line.startswith("| Focal |")).split("|")
    cols = [c.strip() for c in header.split("|")]
    assert focal[cols.index("none: ECE % (published on real NLST)")].strip() == "16.16"
    assert "the study's numbers on real NLST, shown as a reference" in md
    rows = list(csv.DictReader(res["csv"].open()))
    by = {(r["stage1"], r["stage2"]): r for r in rows}
    assert float(by[("focal", "ts")]["ece"]) == pytest.approx(0.03) and by[("focal", "ts")]["best_calibrated"] == "1"
    assert by[("focal", "ts")]["published_on"] == "nlst" and by[("ce", "ts")]["published_on"] == ""
    assert by[("ce", "none")]["best_calibrated"] == "0"
    page = res["html"].read_text()
    assert page.count("data:image/png;base64,") == 1  # only ce/none logged a diagram
    assert "src='http" not in page and "<link" not in page  # self-contained
    assert page.count("no diagram") == 3
    # the report run carries the three files

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(res["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["lungcal.report"] == "true"
    names = sorted(a.path for a in client.list_artifacts(res["run_id"], "report"))
    assert names == ["report/report.csv", "report/report.html", "report/report.md"]
    # ... and is itself never tabulated
    again = collect_tables("nlst", tracking_uri=store)
    assert sum(len(t.cells) for t in again) == 4


def test_cifar_report_shows_published_side_by_side(store, tmp_path):
    res = build_report("cifar10", tmp_path / "c", tracking_uri=store, log_run=False)
    md = res["markdown"].read_text()
    header = next(line for line in md.splitlines() if line.startswith("| stage 1"))
    assert "none: ACC % (published)" in header and "none: ECE % (published)" in header
    ce = next(line for line in md.splitlines() if line.startswith("| CE |"))
    assert "93.32" in ce and "3.60" in ce
    focal = next(line for line in md.splitlines() if line.startswith("| Focal |")).split("|")
    cols = [c.strip() for c in header.split("|")]
    assert focal[cols.index("none: ACC % (published)")].strip() == "92.95"
    fmix = next(line for line in md.splitlines() if line.startswith("| Focal+Mixup |")).split("|")
    assert fmix[cols.index("none: ACC % (published)")].strip() == ""  # not published: empty
    assert focal[cols.index("none: ECE % (published)")].strip() == "1.22"
    assert "**" not in ce and "No configuration is marked best calibrated" in md
    # published-only rows (mixup, focal_mixup) appear with empty measured cells
    assert any(line.startswith("| Focal+Mixup |") and "27.92" in line for line in md.splitlines())
    rows = list(csv.DictReader(res["csv"].open()))
    fm = next(r for r in rows if r["stage1"] == "focal_mixup")
    assert fm["run_id"] == "" and fm["ece"] == "" and math.isclose(float(fm["published_ece"]), 27.92)
    assert fm["published_on"] == "cifar10"
    assert res["run_id"] is None


def test_cli_report(store, tmp_path, capsys):

    assert main(["report", "--experiment", "nlst", "--tracking-uri", store, "--out", str(tmp_path), "--no-log"]) == 0
    out = capsys.readouterr().out
    assert "# Calibration study report" in out and (tmp_path / "report.html").exists()
    assert main(["report", "--experiment", "missing", "--tracking-uri", store, "--out", str(tmp_path)]) == 2
    assert "no MLflow experiment named 'missing'" in capsys.readouterr().err


def test_ui_command_opens_the_store_on_loopback(store, tmp_path, capsys):

    cmd = ui_command(store, port=5123)
    assert cmd[1:] == ["ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", "5123"]
    assert main(["ui", "--tracking-uri", store, "--print-only"]) == 0
    assert f"mlflow ui --backend-store-uri {store} --host 127.0.0.1 --port 5000" in capsys.readouterr().out
    assert main(["ui", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}", "--print-only"]) == 2
    assert "no MLflow store here yet" in capsys.readouterr().err
