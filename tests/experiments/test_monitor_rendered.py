"""experiments/monitor_rendered.py without rendering: the dated rows it writes, and its tables from monitor JSON."""
from __future__ import annotations

import csv
import gzip
import json

from tests.experiments.conftest import load_script

mr = load_script("monitor_rendered")


def _chunk(k: int, verdict: str, alerts: list[dict], valid: bool) -> dict:
    return {"chunk": k, "name": f"month +{k - 1}", "n": 50, "skipped": False, "alerts": alerts,
            "stats": {"n": 50, "site_check": {"verdict": verdict, "effect": {"auc": 0.55}, "prevalence": 0.3,
                                     "reasons": ["noise_hu: 50/50 CTs outside"] if alerts else []},
                      "training_check": {"verdict": "comparable"}, "ood": {"share": 0.0},
                      "work_up": {"rate": 0.5, "ci": [0.4, 0.6]},
                      "estimate": {"sensitivity": 0.9, "interval": [0.8, 1.0], "valid": valid,
                                   "prior_adjusted": False},
                      "observed": {"n": 50, "n_cancers": 15, "sensitivity": 0.8, "sensitivity_ci": [0.5, 0.95],
                                   "oe": 1.0, "ece": 0.1}}}


def _doc(change: bool) -> dict:
    chunks = [_chunk(k, "scanner_shift" if change and k >= 4 else "comparable",
                     [{"kind": "scanner_shift", "new": k == 4}] if change and k >= 4 else [], not (change and k >= 4))
              for k in range(1, 13)]
    return {"threshold": 0.2, "rule": {"promise": 0.85}, "chunks": chunks}


def test_dated_rows_put_each_month_in_its_calendar_month(tmp_path):
    (tmp_path / "nifti").mkdir()
    rows = [{"image": f"nifti/c{i}.nii", "label": i % 2, "subject": f"S{i}", "split": "test"} for i in range(30)]
    (tmp_path / "datalist.json").write_text(json.dumps({"rows": rows}))
    out = mr.dated_rows(tmp_path / "datalist.json", 13)
    assert {r["study_date"][:7] for r in out} == {"2032-01"} and len({r["study_date"] for r in out}) == 28
    assert [r["label"] for r in out] == [i % 2 for i in range(30)] and all(r["site"] == mr.SITE for r in out)
    assert out[0]["image"].endswith("nifti/c0.nii") and out[0]["subject"] == "m13_S0"


def test_tables_read_the_monitor_json_and_write_the_rows(tmp_path, capsys):
    (tmp_path / "s.json").write_text(json.dumps(_doc(False)))
    (tmp_path / "c.json").write_text(json.dumps(_doc(True)))
    mr.main(["tables", str(tmp_path / "s.json"), str(tmp_path / "c.json"), "--csv", str(tmp_path / "rows.csv.gz")])
    out = capsys.readouterr().out
    assert "first alert: month none; alerting months: none" in out
    assert "first alert: month 4; alerting months: 4, 5, 6, 7, 8, 9, 10, 11, 12" in out
    assert "scanner_shift(still)" in out and "**not valid**" in out and "| noise_hu |" in out
    assert "| change | 4-12 | 0.900 | 0.800 (135) |" in out
    with gzip.open(tmp_path / "rows.csv.gz", "rt") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 24 and rows[15]["verdict"] == "scanner_shift" and rows[0]["site"] == "stable"
