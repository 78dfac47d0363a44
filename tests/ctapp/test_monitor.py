"""``lungcal monitor DATALIST --run ID``, end to end on the tiny cohort (the statistics: test_monitoring.py).

A 1-epoch model is trained on the session's tiny cohort with the real bundle, recalibrated at a site with a loose
guaranteed threshold (``recalibrate --miss-rate``, as tests/bundles/test_predict_command.py does); the monitor then
reads a datalist of the cohort's CTs with acquisition dates (each CT listed twice so that a month holds 22 CTs):
one month big enough, an empty one, one too small, rows without a date, with a date in an unknown format and with a
missing image, labels on some rows only. Checked: exit code 0, each bad row and the small month in one line naming
the row or the chunk, the chunk's statistics (the tiny references are too small for a site check, so its CBPE
estimate is marked not valid), the observed metrics on the labelled CTs, one MLflow run linked to the model's with
its JSON and picture, and that no date reaches the run's params, tags, metrics or artifacts.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from monai.bundle import run

from lungcal.cli import main
from lungcal.data.manifest import load_manifest
from lungcal.tracking import (
    MONITOR_ARTIFACT,
    TAG_MONITOR,
    TAG_MONITOR_ALERTS,
    TAG_PARENT,
    TAG_STAGE2,
    default_tracking_uri,
)

ROOT = Path(__file__).resolve().parents[2]
TINY_QC = {"max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0, "max_pixel_mm": 6.0}
SET = [x for k, v in TINY_QC.items() for x in ("--set", f"{k}={v}")]
#: the acquisition dates written into the datalist: none of them, in any form, may reach MLflow
DATES = ["2031-03-04", "2031-03-19", "20310327", "2031-05-02"]
FORMS = ["2031-03", "203103", "2031-05", "203105", "20310304", "20310319", "2031-03-27", "20310502", "03/2031"]


@pytest.fixture(scope="module")
def site(tiny_cohort, tmp_path_factory):
    """A 1-epoch model trained on the tiny cohort, recalibrated at site-m with a guaranteed threshold."""
    store = tmp_path_factory.mktemp("monitor_runs")
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    try:
        run(config_file=["bundles/nlst_focal.json", "bundles/nlst_ce.json"], logging_file=False,
            datalist=str(tiny_cohort), output_dir=str(store), epochs=1, n_bootstrap=20, num_workers=0,
            spacing=[5.0, 5.0, 5.0], patch_size=8, batch_size=4, run_name="tiny-monitor",
            qc={"_target_": "lungcal.ct.qc.QCConfig", **TINY_QC})
    finally:
        mp.undo()
    uri = default_tracking_uri(store)
    client = MlflowClient(uri)
    s1 = client.search_runs([client.get_experiment_by_name("nlst").experiment_id], f"tags.`{TAG_STAGE2}` = 'none'")[0]
    assert main(["recalibrate", "--model", s1.info.run_id, "--datalist", str(tiny_cohort), "--tracking-uri", uri,
                 "--output-dir", str(store), "--site", "site-m", "--method", "ts", "--miss-rate", "0.5",
                 "--confidence", "0.5", "--certify-split", "test", "--n-bootstrap", "0", "--no-qc"]) == 0
    return {"store": store, "uri": uri, "run": s1, "client": client, "cohort": tiny_cohort}


def _datalist(site, tmp_path) -> Path:
    rows = load_manifest(site["cohort"])
    out = []
    for k in range(2):  # every CT twice: 22 in March, 5 in May (too few), 4 bad rows
        for i, r in enumerate(rows):
            j = k * len(rows) + i
            date = DATES[j % 3] if j < 22 else DATES[3]
            row = {"image": r["image"], "site": "site-m", "study_date": date}
            if j < 10:
                row["label"] = r["label"]  # the labels of the first ten have arrived
            out.append(row)
    out[25]["study_date"] = "03/27/2031"  # a date in an unknown format
    del out[26]["study_date"]  # no date
    out[27]["study_date"] = ""
    out.append({"image": "missing/ct.nii.gz", "site": "site-m", "study_date": DATES[0]})
    path = tmp_path / "site_m_monitor.json"
    path.write_text(json.dumps({"version": 1, "source": "site:site-m", "rows": out}))
    return path


def _mlflow_text(site, run_id: str, tmp: Path) -> str:
    r = site["client"].get_run(run_id)
    parts = [json.dumps(r.data.params), json.dumps(r.data.tags), json.dumps(r.data.metrics), r.info.run_name]
    local = Path(site["client"].download_artifacts(run_id, "", str(tmp)))
    for f in local.rglob("*"):
        if f.is_file():
            parts.append(str(f.relative_to(local)))
            if f.suffix in (".json", ".txt", ".csv"):
                parts.append(f.read_text())
    return "\n".join(parts)


def test_monitor_reports_each_chunk_and_bad_input_in_one_line_and_logs_no_date(site, tmp_path, capsys):
    datalist = _datalist(site, tmp_path)
    js = tmp_path / "out" / "monitor.json"
    code = main(["monitor", str(datalist), "--run", site["run"].info.run_id, "--tracking-uri", site["uri"],
                 "--output-dir", str(site["store"]), "--json", str(js), "--n-bootstrap", "50", *SET])
    printed = capsys.readouterr().out
    assert code == 0, printed
    lines = printed.splitlines()
    assert any(line.startswith("== lungcal monitor: site site-m") for line in lines)
    left = [line for line in lines if line.startswith("  left out")]
    assert "  left out      row 30: image not found: left out" in left
    assert any("row 25: study_date in an unknown format" in line for line in left)
    assert any("row 26: no study_date" in line for line in left) and any("row 27: no study_date" in line
                                                                         for line in left)
    assert any("chunk 3 (month +2): 5 CTs, too few to say anything (a chunk needs 20): skipped" in line
               for line in left)
    assert any(line.startswith("  chunk   1 (month +0, 22 CTs): vs site not checked") for line in lines)
    assert any(line.startswith("  chunk   2 (month +1, 0 CTs): skipped") for line in lines)
    assert "NOT VALID" in printed and "alert rule    a chunk alerts when" in printed
    assert not any(d in printed for d in DATES + FORMS)  # the terminal names chunks by ordinal too

    res = json.loads(js.read_text())
    c1 = res["chunks"][0]
    assert c1["chunk"] == 1 and c1["n"] == 22 and not c1["skipped"]
    s = c1["stats"]
    assert s["site_check"]["verdict"] is None and "reference" in s["site_check"]["note"]  # 3 calibration CTs
    assert s["estimate"]["valid"] is False and s["work_up"]["rate"] is not None
    assert s["observed"]["n"] == 10 and s["observed"]["ece"] is not None
    assert res["threshold"] is not None and res["rule"]["promise"] == pytest.approx(0.5)
    assert [c["skipped"] for c in res["chunks"]] == [False, True, True]

    r = site["client"].get_run(res["run_id"])
    assert r.info.status == "FINISHED" and r.data.tags[TAG_PARENT] == site["run"].info.run_id
    assert r.data.tags[TAG_MONITOR] in ("quiet", "alert") and r.data.tags["lungcal.site"] == "site-m"
    assert r.data.tags[TAG_MONITOR_ALERTS] == ("none" if r.data.tags[TAG_MONITOR] == "quiet" else
                                              r.data.tags[TAG_MONITOR_ALERTS])
    hist = site["client"].get_metric_history(res["run_id"], "monitor/work_up_rate")
    assert [m.step for m in hist] == [1]
    arts = {a.path for a in site["client"].list_artifacts(res["run_id"])} | {
        a.path for a in site["client"].list_artifacts(res["run_id"], "plots")}
    assert {MONITOR_ARTIFACT, "plots/monitor.png"} <= arts
    text = _mlflow_text(site, res["run_id"], tmp_path / "dl")
    assert not any(d in text for d in DATES + FORMS), [d for d in DATES + FORMS if d in text]
    assert str(datalist.parent) not in text


def test_monitor_refuses_in_one_line(site, tmp_path, capsys):
    datalist = _datalist(site, tmp_path)
    base = ["monitor", str(datalist), "--run", site["run"].info.run_id, "--tracking-uri", site["uri"],
            "--output-dir", str(site["store"]), *SET]
    assert main([*base, "--site", "nowhere"]) == 2
    err = [e for e in capsys.readouterr().err.strip().splitlines() if "Downloading artifacts" not in e]
    assert len(err) == 1 and "no finished run recalibrated at site 'nowhere'" in err[0]  # (progress bars aside)
    assert main([*base, "--chunk", "5"]) == 2
    assert "--chunk" in capsys.readouterr().err
    undated = tmp_path / "undated.json"
    undated.write_text(json.dumps({"rows": [{"image": str(datalist), "site": "site-m"}]}))
    assert main(["monitor", str(undated), *base[2:]]) == 2
    assert "no row has a usable study_date" in capsys.readouterr().err
