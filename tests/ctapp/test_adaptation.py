"""``lungcal adapt-curve``: nested stratified draws, every route scored on the same test CTs, paired differences
against the shipped model, the table, the JSON and the MLflow run.

The bag pipeline is replaced by fixed logits and the training routes by a stand-in that returns a stage-1 run
(the real curve on synthetic sites is in docs/results.md); the draws, the recalibration, the reports, the
paired differences and the run are the real ones. Oracles: select_calibrator fitted directly,
paired_bootstrap_diff, evaluate_probs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from lungcal.calibration.metrics import draws_bootstrap_diff, paired_bootstrap_diff
from lungcal.calibration.scaling import calibrated_probs, probabilities, select_calibrator
from lungcal.cli import main
from lungcal.ctapp.site import adaptation as adaptation_module
from lungcal.ctapp.site.adaptation import TAG_ADAPTATION, adaptation_curve, format_curve, nested_draws
from lungcal.mil.models import build_mil_model
from lungcal.tracking import RunTracker


def test_draws_are_nested_stratified_and_leave_out_sizes_above_the_pool():
    rows = [{"subject": f"s{i}", "label": int(i % 4 == 0)} for i in range(200)]
    draws = nested_draws(rows, [50, 100, 150, 400], seed=3)
    assert sorted(draws) == [50, 100, 150]
    for n, d in draws.items():
        assert len(d) == n and sum(r["label"] for r in d) == round(n * 0.25)
    ids = {n: {r["subject"] for r in d} for n, d in draws.items()}
    assert ids[50] <= ids[100] <= ids[150]
    assert nested_draws(rows, [50], seed=3)[50] == draws[50]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A stage-1 run, a labelled site datalist (240 train + val, 100 test) and fixed logits: the shipped
    network ranks the site's CTs but is overconfident on them."""
    cfg = {"encoder": "small", "head": "attention", "embed_dim": 16, "attn_dim": 8, "dropout": 0.0,
           "patch_size": 16, "num_classes": 2}
    ck = tmp_path / "best.pt"
    torch.save({"state_dict": build_mil_model(**cfg).state_dict(), "model_config": cfg,
                "bag_params": json.dumps({"k": 4}), "method": "focal", "epoch": 1, "metric": 0.8}, ck)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with RunTracker("nlst", "stage1", tracking_uri=uri,
                    tags={"lungcal.stage1": "focal", "lungcal.stage2": "none"}) as tr:
        tr.log_artifact(ck, "checkpoint")
        parent = tr.run_id
    rng = np.random.default_rng(0)
    rows = []
    for i in range(340):
        split = "test" if i < 100 else ("val" if i < 160 else "train")
        rows.append({"image": f"ct{i}.nii.gz", "label": int(rng.random() < 0.3), "subject": f"p{i:03d}",
                     "site": "site-b", "split": split})
    for r in rows:
        (tmp_path / r["image"]).write_bytes(b"")
    dl = tmp_path / "site.json"
    dl.write_text(json.dumps({"version": 1, "source": "site:site-b", "rows": rows}))
    margin = {r["subject"]: rng.normal(1.0, 1.2) * (1 if r["label"] else -1) for r in rows}

    def fake_score_rows(net, rows, bag_params, calibrator, *, cache_dir, num_workers=0, batch_size=16):
        z = np.stack([np.zeros(len(rows)), [4.0 * margin[r["subject"]] for r in rows]], 1)
        return {"logits": torch.tensor(z, dtype=torch.float32), "probs": calibrated_probs(calibrator, z),
                "labels": np.array([r["label"] for r in rows]), "subjects": [r["subject"] for r in rows]}

    trained: list[dict] = []

    def fake_train(bundle, datalist, *, output_dir, tracking_uri, init_run_id, run_name, epochs, overrides):
        doc = json.loads(datalist.read_text())
        trained.append({"rows": doc["rows"], "init": init_run_id, "epochs": epochs, "overrides": overrides})
        return parent

    monkeypatch.setattr(adaptation_module, "score_rows", fake_score_rows)
    monkeypatch.setattr(adaptation_module, "_train", fake_train)
    return {"uri": uri, "parent": parent, "dl": dl, "tmp": tmp_path, "rows": rows, "margin": margin,
            "trained": trained}


def test_the_curve_scores_every_route_on_the_same_test_cts_with_paired_differences(site, capsys):
    out = site["tmp"] / "curve.json"
    assert main(["adapt-curve", str(site["dl"]), "--run", site["parent"], "--tracking-uri", site["uri"],
                 "--output-dir", str(site["tmp"] / "out"), "--sizes", "50,100,400", "--n-bootstrap", "200",
                 "--epochs", "3", "--override", "patch_size=8", "--json", str(out), "--draws", "1"]) == 0
    printed = capsys.readouterr().out
    assert "sizes left out" in printed and "[400]" in printed
    doc = json.loads(out.read_text())
    assert [(r["route"], r["n"]) for r in doc["rows"]] == [
        ("shipped", 0), ("recalibrate", 50), ("finetune", 50), ("scratch", 50),
        ("recalibrate", 100), ("finetune", 100), ("scratch", 100)]
    # the recalibration row is select_calibrator fitted on the draw, scored on the fixed test split
    test = [r for r in site["rows"] if r["split"] == "test"]
    pool = [r for r in site["rows"] if r["split"] == "train"] + [r for r in site["rows"] if r["split"] == "val"]
    draw = nested_draws(pool, [50], seed=0)[50]
    z = lambda rs: np.stack([np.zeros(len(rs)), [4.0 * site["margin"][r["subject"]] for r in rs]], 1)  # noqa: E731
    _, cal, _ = select_calibrator(torch.tensor(z(draw), dtype=torch.float32), np.array([r["label"] for r in draw]))
    y = np.array([r["label"] for r in test])
    p = calibrated_probs(cal, z(test))[:, 1]
    shipped = probabilities(z(test))[:, 1]
    rec = doc["rows"][1]
    d = paired_bootstrap_diff("ece", p, shipped, y, n_bootstrap=200, seed=0, n_bins=10)
    assert rec["d_ece"] == pytest.approx(d["diff"], abs=1e-6)
    assert rec["d_ece_ci_low"] == pytest.approx(d["ci_low"], abs=1e-6)
    assert rec["d_ece"] < 0  # recalibration fixes the overconfidence ...
    assert abs(rec["d_auc"]) < 0.05  # ... and a monotone map keeps the ranking (up to an isotonic fit's ties)
    assert rec["d_auc"] == pytest.approx(paired_bootstrap_diff("auc", p, shipped, y, n_bootstrap=200, seed=0)["diff"])
    # the training routes got the draw (75/25 train/val, stratified) plus the same test rows
    tr = site["trained"]
    assert [t["init"] for t in tr] == [site["parent"], None, site["parent"], None]
    first = tr[0]["rows"]
    assert sum(r["split"] == "test" for r in first) == 100
    assert sum(r["split"] == "val" for r in first) == pytest.approx(12.5, abs=1.5)
    assert tr[0]["epochs"] == 3 and tr[0]["overrides"] == {"patch_size": 8, "seed": 0}
    client = MlflowClient(site["uri"])
    run = client.get_run(doc["run_id"])
    assert run.data.tags[TAG_ADAPTATION] == "curve"
    assert "recalibrate_50/d_ece" in run.data.metrics
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} == {"plots/adaptation_curve.png"}


def test_draws_each_their_own_draw_and_seed_with_contrasts_paired_by_draw(site):
    curve = adaptation_curve(site["parent"], site["dl"], sizes=[50, 100], tracking_uri=site["uri"],
                             output_dir=site["tmp"] / "out", n_bootstrap=100, draws=2,
                             json_path=site["tmp"] / "c.json")
    assert curve.draws == 2 and len(curve.draw_rows) == 2 * 3 * 2
    assert [(r["route"], r["n"], r["draw"]) for r in curve.draw_rows[:6]] == [
        ("recalibrate", 50, 0), ("finetune", 50, 0), ("scratch", 50, 0),
        ("recalibrate", 50, 1), ("finetune", 50, 1), ("scratch", 50, 1)]
    # draw d: its own nested draw (seed + d) and its own training seed
    tr = site["trained"]
    assert [t["overrides"]["seed"] for t in tr] == [0, 0, 1, 1, 0, 0, 1, 1]
    pool = [r for r in site["rows"] if r["split"] == "train"] + [r for r in site["rows"] if r["split"] == "val"]
    for d in (0, 1):
        drawn = {r["subject"] for r in tr[2 * d]["rows"] if r["split"] != "test"}
        assert drawn == {r["subject"] for r in nested_draws(pool, [50], seed=d)[50]}
    assert {r["subject"] for r in tr[0]["rows"]} != {r["subject"] for r in tr[2]["rows"]}
    # the main rows: the mean over the draws, CIs over draws and test CTs, against shipped as the fixed arm
    y = np.array(curve.test_labels)
    stack = lambda route, n: np.array([curve.test_probs[f"{route}/{n}/{d}"] for d in (0, 1)])  # noqa: E731
    rec = next(r for r in curve.rows if r["route"] == "recalibrate" and r["n"] == 50)
    assert rec["draws"] == 2 and len(rec["calibrators"]) == 2
    each = [r["ece"] for r in curve.draw_rows if r["route"] == "recalibrate" and r["n"] == 50]
    assert rec["ece"] == pytest.approx(np.mean(each))
    ref = draws_bootstrap_diff("ece", stack("recalibrate", 50), np.array(curve.test_probs["shipped"]), y,
                               n_bootstrap=100, seed=0, n_bins=10)
    assert (rec["d_ece"], rec["d_ece_ci_low"], rec["d_ece_ci_high"]) == pytest.approx(
        (ref["diff"], ref["ci_low"], ref["ci_high"]))
    # contrasts: each pair of the routes run, later minus earlier, paired by draw
    assert [(c["n"], c["a"], c["b"]) for c in curve.contrasts] == [
        (n, a, b) for n in (50, 100) for a, b in (("finetune", "recalibrate"), ("scratch", "recalibrate"),
                                                   ("scratch", "finetune"))]
    c = curve.contrasts[0]
    ref = draws_bootstrap_diff("auc", stack("finetune", 50), stack("recalibrate", 50), y, n_bootstrap=100, seed=0,
                               n_bins=10)
    assert (c["d_auc"], c["d_auc_ci_low"], c["d_auc_ci_high"]) == pytest.approx(
        (ref["diff"], ref["ci_low"], ref["ci_high"]))
    assert c["d_ece"] > 0 and "d_ece_significant" in c  # the stand-in trainings are the overconfident shipped net
    same = curve.contrasts[2]  # scratch - finetune: the same stand-in model in every draw
    assert same["d_auc"] == same["d_auc_ci_low"] == same["d_auc_ci_high"] == 0.0
    doc = json.loads((site["tmp"] / "c.json").read_text())
    assert len(doc["draw_rows"]) == 12 and len(doc["contrasts"]) == 6 and doc["draws"] == 2
    assert not (site["tmp"] / "c.json.partial").exists()
    printed = format_curve(curve)
    assert "route against route" in printed and "finetune - recalibrate" in printed
    run = MlflowClient(site["uri"]).get_run(curve.run_id)
    assert run.data.params["draws"] == "2" and "contrast_50/finetune_vs_recalibrate/d_ece" in run.data.metrics


def test_bad_routes_sizes_and_a_site_without_both_labels_are_one_line_errors(site, capsys):
    base = ["adapt-curve", str(site["dl"]), "--run", site["parent"], "--tracking-uri", site["uri"]]
    assert main([*base, "--routes", "shipped,magic"]) == 2
    assert "magic" in capsys.readouterr().err
    assert main([*base, "--sizes", "5"]) == 2
    assert main([*base, "--sizes", "a,b"]) == 2
    assert main([*base, "--draws", "0"]) == 2
    rows = [{**r, "label": 0} for r in site["rows"]]
    one = site["tmp"] / "one.json"
    one.write_text(json.dumps({"version": 1, "source": "site:x", "rows": rows}))
    assert main(["adapt-curve", str(one), "--run", site["parent"], "--tracking-uri", site["uri"]]) == 2
    assert "cancer and non-cancer" in capsys.readouterr().err
