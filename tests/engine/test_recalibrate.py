"""``lungcal recalibrate``: TS fitted on the site's validation split only, logged as a linked run.

The bag pipeline is replaced by fixed logits (the end-to-end run on real synthetic CTs is
``tests/test_hospital_workflow.py``); the model loading, the TS fit, the reports, the CLI and the
MLflow run are the real ones.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from lungcal.calibration.metrics import ece
from lungcal.calibration.scaling import TemperatureScaler
from lungcal.cli import main
from lungcal.engine import recalibrate as recalibrate_module
from lungcal.engine.evaluate import probabilities
from lungcal.engine.recalibrate import format_summary, recalibrate
from lungcal.errors import ConfigError, DataError
from lungcal.mil.models import build_mil_model
from lungcal.tracking import RunTracker, linked_temperature


def _overconfident(n, seed, scale):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(int)
    margin = rng.normal(0.8, 1.5, n) * np.where(y == 1, 1, -1)
    logits = np.stack([np.zeros(n), scale * margin], 1)
    return torch.tensor(logits, dtype=torch.float32), torch.tensor(y)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A datalist, a stage-1 checkpoint, a stage-1 MLflow run holding it, and fake predictions."""
    rows = [{"image": f"ct{i}.nii.gz", "label": i % 2, "subject": f"s{i:03d}", "site": "site-b",
             "split": ("train", "val", "test")[i % 3]} for i in range(30)]
    for r in rows:
        (tmp_path / r["image"]).write_bytes(b"")
    dl = tmp_path / "site.json"
    dl.write_text(json.dumps({"version": 1, "source": "site:site-b", "rows": rows}))
    cfg = {"encoder": "small", "head": "attention", "embed_dim": 16, "attn_dim": 8, "dropout": 0.0,
           "patch_size": 16, "num_classes": 2}
    net = build_mil_model(**cfg)
    ck = tmp_path / "best.pt"
    torch.save({"state_dict": net.state_dict(), "model_config": cfg, "bag_params": json.dumps({"k": 4}),
                "method": "focal", "epoch": 1, "metric": 0.8}, ck)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with RunTracker("nlst", "stage1", tracking_uri=uri,
                    tags={"lungcal.stage1": "focal", "lungcal.stage2": "none"}) as tr:
        tr.log_artifact(ck, "checkpoint")
        parent = tr.run_id
    fake = {"val": _overconfident(400, 1, 4.0), "test": _overconfident(400, 2, 4.0)}

    def fake_predict(net, rows, bag_params, cache_dir, num_workers, batch_size=16):
        assert bag_params == {"k": 4}
        split = rows[0]["split"]
        assert {r["split"] for r in rows} == {split} and split in ("val", "test")
        logits, y = fake[split]
        return {"logits": logits, "labels": y, "attention": torch.full((len(y), 4), 0.25),
                "subjects": [f"p{i}" for i in range(len(y))], "candidates": None}

    monkeypatch.setattr(recalibrate_module, "_predict", fake_predict)
    return {"datalist": dl, "checkpoint": ck, "uri": uri, "parent": parent, "fake": fake, "tmp": tmp_path}


def test_recalibrate_fits_on_val_only_and_logs_linked_run(site, capsys):
    rc = main(["recalibrate", "--model", site["parent"], "--datalist", str(site["datalist"]),
               "--tracking-uri", site["uri"], "--output-dir", str(site["tmp"] / "out"), "--n-bootstrap", "200"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "site site-b" in out and "uncalibrated" in out and "local TS" in out
    assert "reference TS" not in out  # the stage-1 run has no linked TS run
    client = MlflowClient(site["uri"])
    runs = client.search_runs([client.get_experiment_by_name("nlst").experiment_id], "tags.`lungcal.stage2` = 'ts'")
    assert len(runs) == 1
    run = runs[0]
    t_val = float(TemperatureScaler().fit(*site["fake"]["val"]).temperature)
    t_test = float(TemperatureScaler().fit(*site["fake"]["test"]).temperature)
    m = run.data.metrics
    assert m["temperature"] == pytest.approx(t_val, rel=1e-5) and abs(t_val - t_test) > 1e-3
    assert m["temperature"] > 1.5  # overconfident logits are softened
    assert m["test/ece"] < m["test_uncalibrated/ece"]
    assert m["test_uncalibrated/ece_pvalue"] < 0.01 < m["test/ece_pvalue"]  # miscalibrated before, not after
    assert m["test/auc"] == pytest.approx(m["test_uncalibrated/auc"]) and m["test/acc"] == m["test_uncalibrated/acc"]
    assert m["test/ece_ci_low"] <= m["test/ece"] <= m["test/ece_ci_high"]
    tags = run.data.tags
    assert tags["lungcal.site"] == "site-b" and tags["lungcal.parent_run"] == site["parent"]
    assert tags["lungcal.stage1"] == "focal" and tags["lungcal.dataset"] == "site:site-b"
    assert run.data.params["fit_split"] == "val" and run.data.params["retrained"] == "False"
    assert str(site["datalist"]) not in json.dumps(run.data.params)  # paths never logged
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert arts == {"plots/test_reliability.png", "plots/test_uncalibrated_reliability.png"}


def test_recalibrate_from_checkpoint_without_logging(site):
    res = recalibrate(str(site["checkpoint"]), site["datalist"], tracking_uri=site["uri"], n_bootstrap=0, log=False,
                        output_dir=site["tmp"] / "out")
    assert res["run_id"] is None and res["parent_run"] is None and res["stage1"] == "focal"
    assert res["after"]["ece"] < res["before"]["ece"] and res["n_val"] == 10 and res["n_test"] == 10
    assert "local TS" in format_summary(res) and res["reference"] is None


def test_recalibrate_user_errors(site, tmp_path):
    with pytest.raises(DataError, match="datalist not found"):
        recalibrate(str(site["checkpoint"]), tmp_path / "nope.json", tracking_uri=site["uri"])
    bad = tmp_path / "noval.json"
    rows = [r for r in json.loads(site["datalist"].read_text())["rows"] if r["split"] != "val"]
    for r in rows:
        r["image"] = str(site["tmp"] / r["image"])
    bad.write_text(json.dumps({"version": 1, "source": "x", "rows": rows}))
    with pytest.raises(DataError, match="no 'val' rows"):
        recalibrate(str(site["checkpoint"]), bad, tracking_uri=site["uri"])
    with pytest.raises(ConfigError):
        recalibrate("0123456789abcdef", site["datalist"], tracking_uri=site["uri"])
    notck = tmp_path / "x.pt"
    torch.save({"weights": 1}, notck)
    with pytest.raises(ConfigError, match="not a lungcal stage-1 checkpoint"):
        recalibrate(str(notck), site["datalist"], tracking_uri=site["uri"])


def test_recalibrate_scores_the_reference_temperature_and_inference_picks_by_site(site, capsys):
    """With a reference TS run linked to the stage-1 run, the site's test split is also scored with
    the reference temperature; afterwards the site's own temperature is found by site name."""
    client = MlflowClient(site["uri"])
    with RunTracker("nlst", "stage1+ts", tracking_uri=site["uri"], parent_run_id=site["parent"],
                    tags={"lungcal.stage1": "focal", "lungcal.stage2": "ts"}) as tr:
        tr.log_metrics({"temperature": 1.25})
    stage1 = client.get_run(site["parent"])
    assert linked_temperature(site["uri"], stage1) == pytest.approx(1.25)
    assert linked_temperature(site["uri"], stage1, site="site-b") is None

    rc = main(["recalibrate", "--model", site["parent"], "--datalist", str(site["datalist"]),
               "--tracking-uri", site["uri"], "--output-dir", str(site["tmp"] / "out"), "--n-bootstrap", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "reference TS" in out and "reference T   1.250" in out
    run = client.search_runs([stage1.info.experiment_id], "tags.`lungcal.site` = 'site-b'")[0]
    m = run.data.metrics
    logits, y = site["fake"]["test"]
    expected = ece(probabilities(logits, 1.25), y.numpy(), n_bins=10)
    assert m["reference_temperature"] == pytest.approx(1.25)
    assert m["test_reference_ts/ece"] == pytest.approx(expected, abs=1e-6)
    assert m["test_reference_ts/auc"] == pytest.approx(m["test/auc"])
    # the reference stays the reference; the site's temperature is found by its name
    assert linked_temperature(site["uri"], stage1) == pytest.approx(1.25)
    assert linked_temperature(site["uri"], stage1, site="site-b") == pytest.approx(m["temperature"])
    assert linked_temperature(site["uri"], stage1, site="elsewhere") is None
