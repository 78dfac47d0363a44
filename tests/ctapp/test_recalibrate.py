"""``lungcal recalibrate``: recalibrators fitted on the site's validation split only, prior adjustment
to the site's prevalence (given, or by EM on unlabelled CTs), one linked run holding the chosen one.

The bag pipeline is replaced by fixed logits (the end-to-end run on real synthetic CTs is
``tests/test_hospital_workflow.py``); the model loading, the fits, the reports, the CLI and the
MLflow run are the real ones. Oracles: :func:`select_calibrator` / the calibrators fitted directly on
the val logits, :func:`adjust_to_prior` / :func:`estimate_prior_em`, scikit-learn's AUC.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from scipy.stats import binomtest
from sklearn.metrics import roc_auc_score

from lungcal.calibration.guarantee import cancers_needed, missed_cancer_threshold
from lungcal.calibration.metrics import calibration_slope_intercept, ece, oe_ratio
from lungcal.calibration.prior import PriorAdjusted, adjust_to_prior, estimate_prior_em
from lungcal.calibration.scaling import (
    PlattScaler,
    TemperatureScaler,
    make_calibrator,
    probabilities,
    select_calibrator,
)
from lungcal.cli import main
from lungcal.ct.acquisition import AcquisitionStats
from lungcal.ct.qc import QCCheck, QCReport
from lungcal.ctapp.evaluate import calibrators as calibrators_module
from lungcal.ctapp.evaluate.calibrators import (
    SITE_CHECK_PARAM,
    SITE_CHECK_RUN_PARAM,
    load_calibrator,
    prior_guard,
    site_calibrator,
)
from lungcal.ctapp.model.checkpoint import selection_record
from lungcal.ctapp.site import recalibrate as recalibrate_module
from lungcal.ctapp.site.recalibrate import format_summary, recalibrate
from lungcal.ctapp.site.site_check import COMPARABLE, MIN_SITE_CTS, PREVALENCE_SHIFT, SCANNER_SHIFT, SiteCheck
from lungcal.errors import ConfigError, DataError
from lungcal.mil.models import build_mil_model
from lungcal.paths import atomic_write_text
from lungcal.tracking import (
    SELECTION_ARTIFACT,
    TAG_FORCED,
    RunTracker,
    linked_calibrator,
    linked_temperature,
    run_acquisition_summary,
    run_site_reference,
)


def _overconfident(n, seed, scale, prevalence=0.3):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < prevalence).astype(int)
    margin = rng.normal(0.8, 1.5, n) * np.where(y == 1, 1, -1)
    logits = np.stack([np.zeros(n), scale * margin], 1)
    return torch.tensor(logits, dtype=torch.float32), torch.tensor(y)


def _shifted(n, seed, prevalence, source=0.4, mu=1.0):
    """Logits that are the exact Bayes posterior at prevalence ``source`` (class-conditional N(+-mu, 1)),
    for cases drawn at ``prevalence``: calibrated at the source, a pure label shift at the site."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < prevalence).astype(int)
    x = rng.normal(np.where(y == 1, mu, -mu), 1.0)
    z = 2 * mu * x + math.log(source / (1 - source))
    return torch.tensor(np.stack([np.zeros(n), z], 1), dtype=torch.float32), torch.tensor(y)


def _noise(n, seed):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.3).astype(int)
    return torch.tensor(np.stack([np.zeros(n), rng.normal(0, 0.3, n)], 1), dtype=torch.float32), torch.tensor(y)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A datalist, a stage-1 checkpoint, a stage-1 MLflow run holding it, and fake predictions
    (``site["fake"]`` may be replaced per test; ``"unlabelled"`` serves ``--unlabelled`` rows)."""
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

    def fake_score_rows(net, rows, bag_params, calibrator, *, cache_dir, num_workers=0, batch_size=16):
        assert bag_params == {"k": 4} and calibrator is None  # recalibration scores the bare network
        split = "unlabelled" if rows[0]["site"] == "unlabelled" else rows[0]["split"]
        assert split in ("val", "test", "unlabelled")
        logits, y = fake[split]
        return {"logits": logits, "labels": y, "attention": torch.full((len(y), 4), 0.25),
                "subjects": [f"p{i}" for i in range(len(y))], "candidates": None}

    monkeypatch.setattr(recalibrate_module, "score_rows", fake_score_rows)
    # the site check of the label-free routes (tested in test_site_check.py): a verdict, or an error, per test
    check = {"result": _site_check_result(COMPARABLE), "calls": []}

    def fake_check_scored(stage1, scores, features, stats, **kw):
        run = stage1.run.info.run_id if stage1.run is not None else None  # None: a checkpoint file
        check["calls"].append({"run": run, "n": len(scores), "n_stats": len(stats), **kw})
        if isinstance(check["result"], Exception):
            raise check["result"]
        return check["result"]

    monkeypatch.setattr(recalibrate_module, "check_scored", fake_check_scored)
    return {"datalist": dl, "checkpoint": ck, "uri": uri, "parent": parent, "fake": fake, "tmp": tmp_path,
            "check": check}


def _site_check_result(verdict, reasons=(), run_id="c0ffee0000000000"):
    return SiteCheck(verdict=verdict, alpha=0.05, n=20, n_reference=200, source_prevalence=0.4, prevalence=0.3,
                     prevalence_ci=(0.2, 0.4), tests={}, acquisition={}, per_ct=[], reasons=list(reasons),
                     run_id=run_id)


def _cli(site, *extra):
    return main(["recalibrate", "--model", site["parent"], "--datalist", str(site["datalist"]),
                 "--tracking-uri", site["uri"], "--output-dir", str(site["tmp"] / "out"), *extra])


def _site_runs(site):
    client = MlflowClient(site["uri"])
    return client, client.search_runs([client.get_experiment_by_name("nlst").experiment_id],
                                      "tags.`lungcal.site` = 'site-b'")


def test_auto_selects_on_val_only_logs_every_row_and_stores_the_chosen_calibrator(site, capsys):
    assert _cli(site, "--n-bootstrap", "200") == 0
    out = capsys.readouterr().out
    print(out)
    for label in ("uncalibrated", "local ts", "local platt", "local isotonic", "slope", "intercept", "O/E"):
        assert label in out
    assert "shipped" not in out  # the stage-1 run has no linked calibrator run
    client, runs = _site_runs(site)
    assert len(runs) == 1
    run = runs[0]
    zv, yv = site["fake"]["val"]
    zt, yt = site["fake"]["test"]
    chosen, oracle, cv_nll = select_calibrator(zv, yv)  # the oracle: selection on val only
    tags, m = run.data.tags, run.data.metrics
    assert tags["lungcal.calibrator"] == tags["lungcal.stage2"] == chosen == run.data.params["chosen"]
    assert tags["lungcal.recalibration"] == "local" and tags["lungcal.parent_run"] == site["parent"]
    assert tags["lungcal.stage1"] == "focal" and tags["lungcal.dataset"] == "site:site-b"
    assert "lungcal.fit_warning" not in tags
    assert run.data.params["fit_split"] == "val" and run.data.params["retrained"] == "False"
    assert str(site["datalist"]) not in json.dumps(run.data.params)  # paths never logged
    for name, v in cv_nll.items():
        assert m[f"val/cv_nll_{name}"] == pytest.approx(v, rel=1e-9)
    # the chosen row is test/..., the others test_<row>/...
    p_chosen = np.asarray(oracle.predict_proba(zt.numpy()))
    assert m["test/ece"] == pytest.approx(ece(p_chosen, yt.numpy(), n_bins=10), abs=1e-6)
    slope, intercept = calibration_slope_intercept(p_chosen, yt.numpy())
    assert m["test/cal_slope"] == pytest.approx(slope, abs=1e-6)
    assert m["test/cal_intercept"] == pytest.approx(intercept, abs=1e-6)
    assert m["test/oe_ratio"] == pytest.approx(oe_ratio(p_chosen, yt.numpy()), abs=1e-6)
    for key in {"ts", "platt", "isotonic"} - {chosen}:
        p = np.asarray(make_calibrator(key).fit(zv, yv).predict_proba(zt.numpy()))
        assert m[f"test_{key}/ece"] == pytest.approx(ece(p, yt.numpy(), n_bins=10), abs=1e-6)
        assert f"test_{key}/cal_slope_ci_low" in m
    assert m["test_uncalibrated/ece"] > m["test/ece"]
    assert m["test_uncalibrated/ece_pvalue"] < 0.01 < m["test/ece_pvalue"]  # miscalibrated before, not after
    auc = roc_auc_score(yt.numpy(), zt.numpy()[:, 1])
    assert m["test_uncalibrated/auc"] == pytest.approx(auc, abs=1e-9)
    for key in ("ts", "platt"):  # monotone maps keep the ranking
        assert m[f"test_{key}/auc" if key != chosen else "test/auc"] == pytest.approx(auc, abs=1e-9)
    # the stored calibrator is the chosen one, as plain JSON, and inference finds it by site
    name, stored = linked_calibrator(site["uri"], client.get_run(site["parent"]), site="site-b",
                                     load=load_calibrator)
    assert name == chosen
    np.testing.assert_allclose(stored.predict_proba(zt.numpy()), p_chosen, atol=1e-12)
    assert linked_calibrator(site["uri"], client.get_run(site["parent"]), site="elsewhere") is None


def test_explicit_method_is_fitted_on_val_and_ts_keeps_the_temperature_contract(site, capsys):
    assert _cli(site, "--method", "ts", "--n-bootstrap", "0") == 0
    out = capsys.readouterr().out
    assert "local ts" in out and "local platt" not in out
    client, runs = _site_runs(site)
    m = runs[0].data.metrics
    t_val = TemperatureScaler().fit(*site["fake"]["val"]).temperature
    t_test = TemperatureScaler().fit(*site["fake"]["test"]).temperature
    assert m["temperature"] == pytest.approx(t_val, rel=1e-6) and abs(t_val - t_test) > 1e-3
    assert m["test/auc"] == pytest.approx(m["test_uncalibrated/auc"]) and m["test/acc"] == m["test_uncalibrated/acc"]
    stage1 = client.get_run(site["parent"])
    assert linked_temperature(site["uri"], stage1, site="site-b") == pytest.approx(t_val, rel=1e-6)


def test_prior_adjustment_and_em_undo_a_prevalence_shift_and_method_prior_stores_it(site, capsys, tmp_path):
    """Logits calibrated at prevalence 0.4, a site at 0.11: the given prevalence and the EM estimate on
    unlabelled CTs both remove the shift; --method prior stores the adjustment for inference."""
    site["fake"].update(val=_shifted(2000, 1, 0.11), test=_shifted(2000, 2, 0.11),
                        unlabelled=_shifted(2000, 3, 0.11))
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)  # what post-hoc logs
    unl = tmp_path / "unlabelled.json"
    unl.write_text(json.dumps({"rows": [{"image": "ct0.nii.gz"}, {"image": str(tmp_path / "ct1.nii.gz")}]}))
    assert _cli(site, "--method", "prior", "--prevalence", "0.11", "--unlabelled", str(unl),
                "--n-bootstrap", "200") == 0
    out = capsys.readouterr().out
    print(out)
    assert "prior-adjusted" in out and "EM prior-adjusted" in out and "0.400 (stage-1 run val/prevalence)" in out
    client, runs = _site_runs(site)
    run = runs[0]
    m, tags = run.data.metrics, run.data.tags
    zt, yt = site["fake"]["test"]
    p0 = probabilities(zt)
    expected = adjust_to_prior(p0, 0.4, 0.11)
    em = estimate_prior_em(probabilities(site["fake"]["unlabelled"][0]), 0.4)
    assert tags["lungcal.calibrator"] == "prior" and run.data.params["chosen"] == "prior"
    assert m["source_prior"] == 0.4 and m["site_prior"] == 0.11
    assert m["em_prior"] == pytest.approx(em, rel=1e-9) and abs(em - 0.11) < 0.03
    assert m["test/ece"] == pytest.approx(ece(expected, yt.numpy(), n_bins=10), abs=1e-6)
    em_probs = adjust_to_prior(p0, 0.4, em)
    assert m["test_em/ece"] == pytest.approx(ece(em_probs, yt.numpy(), n_bins=10), abs=1e-6)
    assert m["test/ece"] < m["test_uncalibrated/ece"] and m["test_em/ece"] < m["test_uncalibrated/ece"]
    assert m["test_uncalibrated/oe_ratio"] < 0.5 and m["test/oe_ratio"] == pytest.approx(1.0, abs=0.15)
    assert m["test_uncalibrated/cal_intercept"] < -0.8 and abs(m["test/cal_intercept"]) < 0.25
    assert m["test/auc"] == pytest.approx(m["test_uncalibrated/auc"], abs=1e-12)  # Bayes re-weighting is monotone
    assert m["test_em/auc"] == pytest.approx(m["test_uncalibrated/auc"], abs=1e-12)
    stored = site_calibrator(site["uri"], client.get_run(site["parent"]), "site-b")
    assert isinstance(stored, PriorAdjusted) and stored.base is None and stored.target_prior == 0.11
    np.testing.assert_allclose(stored.predict_proba(zt.numpy()), expected, atol=1e-12)


def test_an_em_estimate_at_its_bound_is_flagged_no_signal(site, capsys, tmp_path):
    """Unlabelled CTs on which the shipped model says 'cancer' for nearly all (a covariate shift): EM runs
    to a prevalence of ~1 and the row is flagged, and tagged when it is the stored calibrator."""
    zu, _ = _shifted(500, 3, 0.11)
    site["fake"]["unlabelled"] = (zu + torch.tensor([0.0, 12.0]), torch.zeros(500, dtype=torch.long))
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)
    unl = tmp_path / "unlabelled.json"
    unl.write_text(json.dumps({"rows": [{"image": "ct0.nii.gz"}]}))
    assert _cli(site, "--method", "prior", "--unlabelled", str(unl), "--n-bootstrap", "0") == 0
    out = capsys.readouterr().out
    assert "WARNING em: EM prevalence estimate" in out and "NO SIGNAL" in out
    run = _site_runs(site)[1][0]
    assert run.data.metrics["em_prior"] > 0.99 and "at its bound" in run.data.tags["lungcal.fit_warning"]


def test_a_non_ts_reference_calibrator_is_the_shipped_row_and_its_source_prior(site, capsys, tmp_path):
    zv, yv = _overconfident(300, 7, 2.0)
    platt = PlattScaler().fit(zv, yv)
    with RunTracker("nlst", "stage1+platt", tracking_uri=site["uri"], parent_run_id=site["parent"],
                    tags={"lungcal.stage1": "focal", "lungcal.stage2": "platt", "lungcal.calibrator": "platt"}) as tr:
        tr.log_metrics({"source_prior": 0.3})
        tr.log_artifact(atomic_write_text(tmp_path / "platt.json", platt.to_json()), "calibrator")
    assert _cli(site, "--n-bootstrap", "0", "--prevalence", "0.2") == 0
    out = capsys.readouterr().out
    assert "shipped (platt)" in out and "0.300 (reference calibrator's fit split)" in out
    _, runs = _site_runs(site)
    m = runs[0].data.metrics
    zt, yt = site["fake"]["test"]
    shipped = np.asarray(platt.predict_proba(zt.numpy()))
    assert m["test_reference_platt/ece"] == pytest.approx(ece(shipped, yt.numpy(), n_bins=10), abs=1e-6)
    assert m["test_prior/ece"] == pytest.approx(ece(adjust_to_prior(shipped, 0.3, 0.2), yt.numpy(), n_bins=10),
                                                abs=1e-6)


def test_an_old_reference_ts_run_is_scored_by_its_temperature(site, capsys):
    """A reference TS run without a stored calibrator (older stores) still gives the shipped row."""
    client = MlflowClient(site["uri"])
    with RunTracker("nlst", "stage1+ts", tracking_uri=site["uri"], parent_run_id=site["parent"],
                    tags={"lungcal.stage1": "focal", "lungcal.stage2": "ts"}) as tr:
        tr.log_metrics({"temperature": 1.25})
    stage1 = client.get_run(site["parent"])
    assert linked_temperature(site["uri"], stage1) == pytest.approx(1.25)
    assert _cli(site, "--n-bootstrap", "0", "--method", "ts") == 0
    out = capsys.readouterr().out
    assert "shipped (ts)" in out and "reference T   1.250" in out
    m = _site_runs(site)[1][0].data.metrics
    logits, y = site["fake"]["test"]
    assert m["reference_temperature"] == pytest.approx(1.25)
    assert m["test_reference_ts/ece"] == pytest.approx(ece(probabilities(logits, 1.25), y.numpy(), n_bins=10),
                                                       abs=1e-6)
    assert linked_temperature(site["uri"], stage1) == pytest.approx(1.25)  # the reference stays the reference
    assert linked_temperature(site["uri"], stage1, site="site-b") == pytest.approx(m["temperature"])


def test_the_sites_calibration_cts_are_logged_for_predict_to_join_to_the_reference(site, monkeypatch, tmp_path):
    """The recalibration run logs its val CTs as a stage-1 run logs its own (``data/acquisition.json`` of the CTs
    that passed the checks, ``data/site_reference.npz`` with their embeddings): ``predict --site`` joins them to
    the range a CT is flagged against (``lungcal.ctapp.infer.ood.TrainingRange.joined``)."""
    scored = recalibrate_module.score_rows

    def with_features(net, rows, *a, **kw):
        out = scored(net, rows, *a, **kw)
        return {**out, "features": torch.arange(len(out["labels"]) * 3, dtype=torch.float32).reshape(-1, 3)}

    def measured(rows, config, cache_dir, masker=None, num_workers=0):
        return [QCReport([], acquisition=AcquisitionStats(1.0, 1.0, 0.7 + 0.01 * i, -1000.0, 30.0, 0.8))
                for i, _ in enumerate(rows)]

    monkeypatch.setattr(recalibrate_module, "score_rows", with_features)
    monkeypatch.setattr(recalibrate_module, "screen", measured)
    res = recalibrate(site["parent"], site["datalist"], method="ts", tracking_uri=site["uri"],
                      output_dir=site["tmp"] / "out", n_bootstrap=50)
    summary = run_acquisition_summary(site["uri"], res.run_id)
    assert summary is not None and summary["n"] == summary["n_measured"] == res.n_val == 10
    assert summary["fields"]["pixel_mm"]["min"] == pytest.approx(0.7)
    ref = run_site_reference(site["uri"], res.run_id)
    assert ref is not None and ref["features"].shape == (len(site["fake"]["val"][1]), 3)
    np.testing.assert_array_equal(ref["labels"], np.asarray(site["fake"]["val"][1]))


def test_recalibrate_from_checkpoint_without_logging(site):
    res = recalibrate(str(site["checkpoint"]), site["datalist"], tracking_uri=site["uri"], n_bootstrap=0, log=False,
                      output_dir=site["tmp"] / "out", method="platt")
    assert res.run_id is None and res.parent_run is None and res.stage1 == "focal"
    assert res.after["ece"] < res.before["ece"] and res.n_val == 10 and res.n_test == 10
    assert res.chosen == "platt" and "local platt" in format_summary(res) and res.reference is None
    with pytest.raises(ConfigError, match="--source-prevalence"):  # a checkpoint does not know its prevalence
        recalibrate(str(site["checkpoint"]), site["datalist"], tracking_uri=site["uri"], log=False,
                    output_dir=site["tmp"] / "out", prevalence=0.1)
    res = recalibrate(str(site["checkpoint"]), site["datalist"], tracking_uri=site["uri"], log=False, n_bootstrap=0,
                      output_dir=site["tmp"] / "out", prevalence=0.1, source_prevalence=0.3)
    assert res.priors["source_prior"] == 0.3 and "prior" in res.rows


def test_few_events_warns_and_a_no_signal_fit_is_flagged_and_tagged(site, capsys):
    site["fake"].update(val=_noise(150, 1), test=_noise(300, 2))  # ~45 events, logits unrelated to outcome
    assert _cli(site, "--method", "ts", "--n-bootstrap", "0") == 0
    out = capsys.readouterr().out
    print(out)
    assert "CIs are wide" in out and "~ chance" in out and "NO SIGNAL" in out
    run = _site_runs(site)[1][0]
    assert "~ chance" in run.data.tags["lungcal.fit_warning"]
    assert run.data.metrics["val/n_events"] < 100


def _no_run_left(site):
    client = MlflowClient(site["uri"])
    exp = client.get_experiment_by_name("nlst")
    runs = client.search_runs([exp.experiment_id], "tags.`lungcal.stage2` != 'none'")
    assert runs == [], [(r.info.run_name, r.info.status) for r in runs]


@pytest.mark.parametrize("extra, kind, words", [
    (("--method", "beta"), "ConfigError", "unknown --method 'beta'"),
    (("--prevalence", "1.5"), "ConfigError", "--prevalence must be a prevalence strictly between 0 and 1"),
    (("--prevalence", "11%"), "ConfigError", "--prevalence must be"),
    (("--prevalence", "0"), "ConfigError", "--prevalence must be"),
    (("--method", "prior"), "ConfigError", "--method prior needs the site's prevalence"),
    (("--unlabelled", "EMPTY"), "DataError", "has no images"),
    (("--unlabelled", "NOCT"), "DataError", "holds no CT"),
    (("--miss-rate", "0.05"), "ConfigError",  # the fixture's val split holds 5 cancers
     "val split has 5 cancers: a missed-cancer rate of at most 5% with confidence 90% needs at least 45"),
    (("--miss-rate", "5%"), "ConfigError", "--miss-rate must be a fraction strictly between 0 and 1"),
    (("--miss-rate", "0.1", "--confidence", "1"), "ConfigError", "--confidence must be a fraction"),
    (("--confidence", "0.9"), "ConfigError", "--confidence belongs to the --miss-rate guarantee"),
    (("--guarantee", "crc"), "ConfigError", "--guarantee belongs to the --miss-rate guarantee"),
    (("--certify-split", "test"), "ConfigError", "--certify-split belongs to the --miss-rate guarantee"),
    (("--miss-rate", "0.1", "--guarantee", "crc", "--confidence", "0.9"), "ConfigError",
     "--guarantee crc states no confidence"),
    (("--miss-rate", "0.1", "--guarantee", "crc"), "ConfigError",  # 5 val cancers; CRC at 10% needs 9
     "val split has 5 cancers: a missed-cancer rate of at most 10% on average (--guarantee crc) needs at least 9"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_no_run(site, capsys, extra, kind, words):
    (site["tmp"] / "empty.json").write_text(json.dumps({"version": 1, "source": "x", "rows": []}))
    (site["tmp"] / "noct").mkdir()
    (site["tmp"] / "noct" / "notes.txt").write_text("x")
    extra = [{"EMPTY": str(site["tmp"] / "empty.json"), "NOCT": str(site["tmp"] / "noct")}.get(x, x) for x in extra]
    capsys.readouterr()
    assert _cli(site, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "Fix:" in err[0], err
    _no_run_left(site)


def test_a_val_split_with_one_class_is_refused_before_any_run(site, capsys, tmp_path):
    rows = json.loads(site["datalist"].read_text())["rows"]
    for r in rows:
        r["image"] = str(site["tmp"] / r["image"])
        if r["split"] == "val":
            r["label"] = 0
    bad = tmp_path / "oneclass.json"
    bad.write_text(json.dumps({"version": 1, "source": "x", "rows": rows}))
    capsys.readouterr()
    rc = main(["recalibrate", "--model", site["parent"], "--datalist", str(bad), "--tracking-uri", site["uri"]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "'val' split holds only label(s) [0]" in err[0] and "Fix:" in err[0]
    _no_run_left(site)


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


def _qc_failing(subjects):
    """A stand-in for the series checks that fails the CTs of ``subjects`` on slice thickness."""
    def fake_screen(rows, config, cache_dir, masker=None, num_workers=0):
        thick = QCCheck("slice_thickness", "fail", "3.2 mm", "slices thicker than 3.0 mm", "rescan")
        return [QCReport([thick]) if r["subject"] in subjects else None for r in rows]
    return fake_screen


def test_ct_failing_a_series_check_is_left_out_and_counted(site, monkeypatch, capsys):
    monkeypatch.setattr(recalibrate_module, "screen", _qc_failing({"s001", "s004"}))  # two val CTs
    res = recalibrate(site["parent"], site["datalist"], method="ts", tracking_uri=site["uri"],
                      output_dir=site["tmp"] / "out", n_bootstrap=50, log=False)
    assert res.qc_skipped == {"val": 2, "test": 0} and res.n_val == 8 and res.n_test == 10
    text = capsys.readouterr().out + format_summary(res)
    assert "series checks: 2 of 10 CT(s) skipped" in text and "slice_thickness" in text
    assert "series checks left out 2 val CT(s)" in text
    # without the checks every CT is scored
    res = recalibrate(site["parent"], site["datalist"], method="ts", tracking_uri=site["uri"],
                      output_dir=site["tmp"] / "out", n_bootstrap=50, log=False, qc=None)
    assert res.n_val == 10 and res.qc_skipped == {"val": 0, "test": 0}


def test_a_split_left_with_one_class_after_the_checks_is_refused_before_any_run(site, monkeypatch, capsys):
    val_cancers = {f"s{i:03d}" for i in range(30) if i % 3 == 1 and i % 2 == 1}
    monkeypatch.setattr(recalibrate_module, "screen", _qc_failing(val_cancers))
    assert _cli(site) == 2
    assert "'val' split holds only label(s) [0]" in capsys.readouterr().err
    client, runs = _site_runs(site)
    assert runs == []


def _enough_cancers(site, n_val=120, n_test=60):
    """Rewrite the site's datalist with val/test rows enough for a guarantee (half of them cancers); the
    scores stay the fixture's fake ones."""
    rows = [{"image": f"g{i}.nii.gz", "label": i % 2, "subject": f"g{i:03d}", "site": "site-b",
             "split": "val" if i < n_val else "test"} for i in range(n_val + n_test)]
    for r in rows:
        (site["tmp"] / r["image"]).write_bytes(b"")
    site["datalist"].write_text(json.dumps({"version": 1, "source": "site:site-b", "rows": rows}))


def test_miss_rate_threshold_is_chosen_on_val_only_and_its_test_numbers_are_the_direct_ones(site, capsys, tmp_path):
    """``--miss-rate``: the threshold is Learn-then-Test's on the chosen calibrator's val probabilities (the
    oracle fitted here); the test split only reports what it does (another test split changes those numbers,
    never the threshold); the run logs the metrics and guarantee.json."""
    _enough_cancers(site)
    site["fake"].update(val=_overconfident(600, 1, 4.0, prevalence=0.4), test=_overconfident(400, 2, 4.0, 0.4))
    assert _cli(site, "--method", "platt", "--miss-rate", "0.05", "--n-bootstrap", "0") == 0
    out = capsys.readouterr().out
    print(out)
    zv, yv = site["fake"]["val"]
    zt, yt = site["fake"]["test"]
    cal = PlattScaler().fit(zv, yv)
    oracle = missed_cancer_threshold(cal.predict_proba(zv.numpy())[:, 1], yv.numpy(), alpha=0.05, delta=0.1)
    assert f"p(cancer) >= {oracle.threshold:.4f} -> work-up" in out and "Clopper-Pearson 95%" in out
    client, runs = _site_runs(site)
    run = runs[0]
    m = run.data.metrics
    assert m["val/threshold_missrate"] == pytest.approx(oracle.threshold, abs=1e-12)
    assert m["val/positive_rate_at_threshold"] == pytest.approx(oracle.positive_rate)
    assert m["val/sensitivity_at_threshold"] == pytest.approx(oracle.sensitivity) and oracle.sensitivity >= 0.95
    called = cal.predict_proba(zt.numpy())[:, 1] >= oracle.threshold
    y = yt.numpy() == 1
    k, n = int(called[y].sum()), int(y.sum())
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert m["test/sensitivity_at_threshold"] == pytest.approx(k / n)
    assert m["test/sensitivity_at_threshold_ci_low"] == pytest.approx(ci.low)
    assert m["test/sensitivity_at_threshold_ci_high"] == pytest.approx(ci.high)
    assert m["test/positive_rate_at_threshold"] == pytest.approx(called.mean())
    assert run.data.params["miss_rate"] == "0.05" and run.data.params["confidence"] == "0.9"
    stored = json.loads(Path(client.download_artifacts(run.info.run_id, "guarantee.json", str(tmp_path))).read_text())
    assert stored["statement"] == oracle.statement() and stored["fit_split"] == "val"
    assert stored["n_cancers"] == int(yv.sum()) and stored["alpha"] == 0.05 and stored["delta"] == 0.1
    assert stored["test"]["sensitivity"] == pytest.approx(k / n) and stored["test"]["n_cancers"] == n
    # the decision curve on test: its net benefit at the site's threshold, by hand, and the plot
    fp = int(called[~y].sum())
    t = oracle.threshold
    assert m["test/net_benefit_at_threshold"] == pytest.approx(k / len(y) - fp / len(y) * t / (1 - t))
    prev = y.mean()
    assert m["test/net_benefit_treat_all_at_threshold"] == pytest.approx(prev - (1 - prev) * t / (1 - t))
    assert "decision curve (test, net benefit) model above treat-all and treat-none" in out
    assert f"at {t:.3f}: model {m['test/net_benefit_at_threshold']:+.3f}" in out
    names = {f.path for f in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/test_decision_curve.png" in names
    curve = json.loads(Path(client.download_artifacts(run.info.run_id, "data/test_decision_curve.json",
                                                      str(tmp_path))).read_text())
    assert t in curve["thresholds"] and curve["n"] == len(y)
    # by subgroup (the fixture's rows name no scanner and have no annotations: one group each, the whole split)
    assert "by subgroup   on the test split" in out
    sub = json.loads(Path(client.download_artifacts(run.info.run_id, "data/test_subgroups.json",
                                                    str(tmp_path))).read_text())
    whole = [r for r in sub["rows"] if r["grouping"] == "scanner"]
    assert [r["group"] for r in whole] == ["unknown"] and whole[0]["n"] == len(y)
    assert whole[0]["sensitivity"] == pytest.approx(k / n) and whole[0]["work_up_rate"] == pytest.approx(called.mean())
    # another test split: other test numbers, the same threshold (test is never used to choose it)
    site["fake"]["test"] = _overconfident(400, 5, 4.0, 0.4)
    res = recalibrate(site["parent"], site["datalist"], method="platt", tracking_uri=site["uri"], n_bootstrap=0,
                      output_dir=site["tmp"] / "out", miss_rate=0.05, log=False)
    assert res.threshold is not None and res.threshold.guarantee == oracle
    assert res.threshold.test_cancers != n and "work-up rate val" in format_summary(res)
    # without --miss-rate nothing is chosen and nothing is logged
    assert recalibrate(site["parent"], site["datalist"], method="platt", tracking_uri=site["uri"], n_bootstrap=0,
                       output_dir=site["tmp"] / "out", log=False).threshold is None


def _guarantee_json(site, client, run, tmp_path):
    return json.loads(Path(client.download_artifacts(run.info.run_id, "guarantee.json", str(tmp_path))).read_text())


def _fine_tuned(site):
    """A stage-1 run fine-tuned on the site's datalist: its data/selection.json says the val split chose its
    checkpoint and the train split trained it (the fixture's checkpoint file stands for its weights)."""
    rows = json.loads(site["datalist"].read_text())["rows"]
    record = selection_record([r["subject"] for r in rows if r["split"] == "train"],
                              [r["subject"] for r in rows if r["split"] == "val"], "val_auc")
    with RunTracker("nlst", "stage1-finetuned", tracking_uri=site["uri"],
                    tags={"lungcal.stage1": "focal", "lungcal.stage2": "none"}) as tr:
        tr.log_artifact(site["checkpoint"], "checkpoint")
        tr.log_dict(record, SELECTION_ARTIFACT)
        return tr.run_id


def test_the_fine_tune_route_cannot_certify_on_the_val_split_that_chose_its_checkpoint(site, capsys, tmp_path):
    """Refused before anything is scored or logged, naming the way out; ``--certify-split test`` takes it: the
    threshold is chosen on test (on the calibrator fitted on val), and nothing is left to check it."""
    _enough_cancers(site, n_val=120, n_test=100)  # 60 val cancers, 50 test cancers
    site["fake"].update(val=_overconfident(600, 1, 4.0, prevalence=0.4), test=_overconfident(400, 2, 4.0, 0.4))
    tuned = _fine_tuned(site)
    capsys.readouterr()
    argv = ["recalibrate", "--model", tuned, "--datalist", str(site["datalist"]), "--tracking-uri", site["uri"],
            "--output-dir", str(site["tmp"] / "out"), "--method", "platt", "--n-bootstrap", "0", "--miss-rate", "0.1"]
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lungcal recalibrate:")]  # no bars
    assert len(err) == 1 and "the val split cannot certify the threshold: 120 of its 120 subjects chose run" in err[0]
    assert "--certify-split test" in err[0]
    _no_run_left(site)
    assert main([*argv, "--certify-split", "test"]) == 0
    out = capsys.readouterr().out
    zv, yv = site["fake"]["val"]
    zt, yt = site["fake"]["test"]
    cal = PlattScaler().fit(zv, yv)
    oracle = missed_cancer_threshold(cal.predict_proba(zt.numpy())[:, 1], yt.numpy(), alpha=0.1, delta=0.1)
    assert f"p(cancer) >= {oracle.threshold:.4f} -> work-up, chosen on the test split" in out
    assert "no independent split is left to check it" in out
    client, runs = _site_runs(site)
    run = runs[0]
    stored = _guarantee_json(site, client, run, tmp_path)
    assert stored["fit_split"] == "test" and stored["test"] is None and stored["threshold"] == oracle.threshold
    cert = stored["certify_split"]
    assert cert["checked"] is True and "none of the 100 test subjects" in cert["note"]
    assert run.data.params["certify_split"] == "test"
    m = run.data.metrics
    assert m["test/positive_rate_at_threshold"] == pytest.approx(oracle.positive_rate)
    assert "val/positive_rate_at_threshold" not in m and "test/sensitivity_at_threshold_ci_low" not in m


def test_conformal_risk_control_is_the_second_option_and_its_weaker_promise_is_named(site, capsys, tmp_path):
    _enough_cancers(site)
    site["fake"].update(val=_overconfident(600, 1, 4.0, prevalence=0.4), test=_overconfident(400, 2, 4.0, 0.4))
    assert _cli(site, "--method", "platt", "--miss-rate", "0.05", "--guarantee", "crc", "--n-bootstrap", "0") == 0
    out = capsys.readouterr().out
    zv, yv = site["fake"]["val"]
    pv = PlattScaler().fit(zv, yv).predict_proba(zv.numpy())[:, 1]
    oracle = missed_cancer_threshold(pv, yv.numpy(), alpha=0.05, delta=None, guarantee="crc")
    assert oracle.misses_allowed == int(np.floor(0.05 * (int(yv.sum()) + 1))) - 1
    assert oracle.threshold >= missed_cancer_threshold(pv, yv.numpy(), alpha=0.05, delta=0.1).threshold
    assert f"p(cancer) >= {oracle.threshold:.4f}" in out and "conformal risk control" in out
    assert "ON AVERAGE over draws of the val split (a weaker promise" in out
    client, runs = _site_runs(site)
    run = runs[0]
    stored = _guarantee_json(site, client, run, tmp_path)
    assert stored["guarantee"] == "crc" and stored["delta"] is None and stored["threshold"] == oracle.threshold
    assert stored["promise"].startswith("on average over draws") and "weaker" in stored["promise"]
    assert stored["statement"] == oracle.statement() and "on average" in stored["statement"]
    assert run.data.params["guarantee"] == "crc" and "confidence" not in run.data.params


def test_a_threshold_that_hardly_triages_is_warned_of_in_the_summary_and_guarantee_json(site, capsys, tmp_path):
    """Val scores unrelated to the labels: the certified threshold sends nearly every CT on; the summary and
    guarantee.json say so, with the cancers that would allow more misses. The fixture's stage-1 run logged no
    record of its checkpoint's CTs and no datalist digest: that is warned of too."""
    _enough_cancers(site)
    site["fake"].update(val=_noise(600, 3), test=_noise(400, 4))
    assert _cli(site, "--method", "platt", "--miss-rate", "0.05", "--n-bootstrap", "0") == 0
    out = capsys.readouterr().out
    warns = [ln for ln in out.splitlines() if ln.startswith("  WARNING       ")]
    assert any("the certified threshold sends" in w and "does not triage" in w for w in warns), out
    assert any("could not be checked" in w for w in warns), out
    client, runs = _site_runs(site)
    stored = _guarantee_json(site, client, runs[0], tmp_path)
    assert stored["positive_rate"] > 0.9 and len(stored["warnings"]) == 2
    k = stored["misses_allowed"]
    assert f"allow {k} missed cancer(s)" in stored["warnings"][0]
    assert f"{cancers_needed(0.05, 0.1, k + 1)} allow {k + 1}" in stored["warnings"][0]
    assert stored["certify_split"]["checked"] is False


# ------------------------------------------------------------ the site check guards the label-free routes
SHIFT_REASON = "pixel_mm: 18/20 CTs outside the training range [0.6, 0.9] (median 0.45), p = 1e-20 < 0.00714"


@pytest.mark.parametrize("route", [("--prevalence", "0.2"), ("--unlabelled", "UNL")])
def test_a_scanner_shift_refuses_the_label_free_routes_in_one_line_naming_the_valid_routes(site, capsys, tmp_path,
                                                                                           route):
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)
    unl = tmp_path / "unl.json"
    unl.write_text(json.dumps({"rows": [{"image": "ct0.nii.gz"}]}))
    site["check"]["result"] = _site_check_result(SCANNER_SHIFT, [SHIFT_REASON])
    capsys.readouterr()
    assert _cli(site, *[str(unl) if x == "UNL" else x for x in route], "--n-bootstrap", "0") == 2
    captured = capsys.readouterr().err
    err = [line for line in captured.splitlines() if line.startswith("lungcal")]  # not MLflow's progress bars
    assert len(err) == 1 and err[0].startswith("lungcal recalibrate: error: ") and "Traceback" not in captured, err
    line = err[0]
    assert f"{route[0]} refused: site check verdict scanner_shift ({SHIFT_REASON})" in line
    assert (f"recalibrate on the site's labels: lungcal recalibrate --model {site['parent']} --datalist "
            f"{site['datalist']}") in line and "fine-tune on the site's labels" in line
    assert "--force" in line and "c0ffee0000000000" in line
    _no_run_left(site)
    # the check ran, logged, on the datalist's val and test CTs as the recalibration scored them (once)
    (call,) = site["check"]["calls"]
    assert call["run"] == site["parent"] and call["log"] is True and call["tracking_uri"] == site["uri"]
    n_scored = len(site["fake"]["val"][1]) + len(site["fake"]["test"][1])
    assert call["n"] == n_scored and call["n_stats"] == 20  # the fake scores 400 a split; 10 val + 10 test rows
    assert Path(call["path"]) == site["datalist"]


def test_the_unlabelled_cts_are_checked_themselves_before_em_runs_on_them(site, capsys, tmp_path, monkeypatch):
    """val and test comparable, the unlabelled CTs another scanner: EM must not run on them."""
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)
    site["fake"]["unlabelled"] = _shifted(200, 3, 0.2)
    unl = tmp_path / "unl.json"
    unl.write_text(json.dumps({"rows": [{"image": "ct0.nii.gz"}, {"image": "ct1.nii.gz"}]}))
    calls = []

    def by_rows(stage1, scores, features, stats, **kw):
        calls.append(stats)
        shifted = Path(kw["path"]) == unl  # the unlabelled CTs, checked on their own
        return _site_check_result(SCANNER_SHIFT if shifted else COMPARABLE, [SHIFT_REASON] if shifted else [],
                                  run_id="feed000000000000" if shifted else "c0ffee0000000000")

    monkeypatch.setattr(recalibrate_module, "check_scored", by_rows)
    capsys.readouterr()
    assert _cli(site, "--method", "prior", "--unlabelled", str(unl), "--n-bootstrap", "0") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lungcal")]
    assert len(err) == 1 and "--unlabelled refused: site check verdict scanner_shift" in err[0]
    assert "feed000000000000" in err[0]
    assert [len(c) for c in calls] == [20, 2]  # val and test first, then the unlabelled CTs on their own
    _no_run_left(site)
    # forced: the run records both checks and is tagged
    calls.clear()
    assert _cli(site, "--method", "prior", "--unlabelled", str(unl), "--n-bootstrap", "0", "--force") == 0
    _, (run,) = _site_runs(site)
    assert run.data.params[SITE_CHECK_PARAM] == COMPARABLE
    assert run.data.params[f"{SITE_CHECK_PARAM}_unlabelled"] == SCANNER_SHIFT
    assert run.data.params[f"{SITE_CHECK_RUN_PARAM}_unlabelled"] == "feed000000000000"
    assert run.data.tags[TAG_FORCED] == SCANNER_SHIFT


def test_force_runs_past_a_scanner_shift_tags_the_run_and_predict_warns(site, capsys):
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)
    site["check"]["result"] = _site_check_result(SCANNER_SHIFT, [SHIFT_REASON])
    assert _cli(site, "--method", "prior", "--prevalence", "0.2", "--n-bootstrap", "0", "--force") == 0
    out = capsys.readouterr().out
    assert "WARNING --force: site check verdict scanner_shift" in out and "FORCED past scanner_shift" in out
    client, (run,) = _site_runs(site)
    assert run.data.tags[TAG_FORCED] == SCANNER_SHIFT
    assert run.data.params[SITE_CHECK_PARAM] == SCANNER_SHIFT
    assert run.data.params[SITE_CHECK_RUN_PARAM] == "c0ffee0000000000"
    stored = site_calibrator(site["uri"], client.get_run(site["parent"]), "site-b")
    assert isinstance(stored, PriorAdjusted)
    warning = prior_guard(stored, run, "site-b")  # what predict --site prints on every run
    assert warning is not None and "was forced" in warning and "scanner_shift" in warning


@pytest.mark.parametrize("verdict", [COMPARABLE, PREVALENCE_SHIFT])
def test_a_comparable_or_prevalence_shifted_site_goes_on_and_the_run_records_the_check(site, capsys, verdict):
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)
    site["check"]["result"] = _site_check_result(verdict)
    assert _cli(site, "--method", "prior", "--prevalence", "0.2", "--n-bootstrap", "0") == 0
    assert f"site check    {verdict} (run c0ffee0000000000)" in capsys.readouterr().out
    _, (run,) = _site_runs(site)
    assert run.data.params[SITE_CHECK_PARAM] == verdict and TAG_FORCED not in run.data.tags
    assert prior_guard(site_calibrator(site["uri"], MlflowClient(site["uri"]).get_run(site["parent"]), "site-b"),
                       run, "site-b") is None


@pytest.mark.parametrize(("verdict", "method", "hint"), [(PREVALENCE_SHIFT, "auto", True),
                                                       (PREVALENCE_SHIFT, "platt", True),
                                                       (PREVALENCE_SHIFT, "prior", False),
                                                       (COMPARABLE, "auto", False)])
def test_the_summary_points_to_method_prior_only_where_the_check_found_a_prevalence_shift(site, capsys, verdict,
                                                                                          method, hint):
    """The pointer follows the check's verdict and the method, whatever the test rows say."""
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)
    site["check"]["result"] = _site_check_result(verdict)
    assert _cli(site, "--method", method, "--prevalence", "0.2", "--n-bootstrap", "0") == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "`--method prior`" in line]
    assert len(notes) == int(hint)
    if hint:
        _, (run,) = _site_runs(site)
        assert f"({run.data.metrics['val/n_events']:.0f} CTs of the rarer class there)" in notes[0]
        assert f"the chosen local {run.data.params['chosen']} was fitted on it" in notes[0]


def test_too_few_cts_for_a_check_refuses_unless_forced(site, capsys):
    MlflowClient(site["uri"]).log_metric(site["parent"], "val/prevalence", 0.4)
    site["check"]["result"] = DataError(f"12 CTs are too few to tell a site's data from the model's: a site check "
                                        f"needs at least {MIN_SITE_CTS}", file=site["tmp"] / "x.json")
    capsys.readouterr()
    assert _cli(site, "--prevalence", "0.2", "--n-bootstrap", "0") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lungcal")]
    assert len(err) == 1 and "--prevalence needs a site check first, and it could not run: 12 CTs" in err[0]
    assert f"at least {MIN_SITE_CTS}" in err[0] and "--force" in err[0] and "x.json" not in err[0]
    _no_run_left(site)
    assert _cli(site, "--prevalence", "0.2", "--n-bootstrap", "0", "--force") == 0
    assert "WARNING --force: --prevalence runs without a site check" in capsys.readouterr().out
    run = _site_runs(site)[1][0]
    assert run.data.tags[TAG_FORCED] == "unchecked" and run.data.params[SITE_CHECK_RUN_PARAM] == "none"


def test_a_labelled_only_recalibration_runs_no_site_check(site, capsys):
    site["check"]["result"] = _site_check_result(SCANNER_SHIFT, [SHIFT_REASON])  # would refuse, were it asked
    assert _cli(site, "--method", "ts", "--n-bootstrap", "0") == 0
    assert site["check"]["calls"] == [] and "site check" not in capsys.readouterr().out
    run = _site_runs(site)[1][0]
    assert SITE_CHECK_PARAM not in run.data.params and TAG_FORCED not in run.data.tags


def _recal_run(params=None, tags=None):
    """A stand-in for the MLflow run of a site recalibration (what prior_guard reads)."""
    return SimpleNamespace(info=SimpleNamespace(run_id="r1"), data=SimpleNamespace(params=params or {},
                                                                                   tags=tags or {}))


def test_prior_guard_decides_from_what_the_recalibration_run_recorded():
    prior, ts = PriorAdjusted(None, 0.4, 0.2), TemperatureScaler()
    assert calibrators_module._SCANNER_SHIFT == SCANNER_SHIFT  # the layer below keeps its own copy
    shifted = _recal_run({SITE_CHECK_PARAM: SCANNER_SHIFT, SITE_CHECK_RUN_PARAM: "chk"})
    with pytest.raises(ConfigError, match="its site check \\(run chk\\) found scanner_shift") as err:
        prior_guard(prior, shifted, "site-b")
    assert err.value.field == "--site" and "recalibrate on the site's labels" in str(err.value)
    assert prior_guard(ts, shifted, "site-b") is None  # fitted on labels: valid under any shift
    forced = _recal_run({SITE_CHECK_PARAM: SCANNER_SHIFT, SITE_CHECK_RUN_PARAM: "chk"}, {TAG_FORCED: SCANNER_SHIFT})
    assert "WARNING" in prior_guard(prior, forced, "site-b")
    unchecked = _recal_run({SITE_CHECK_PARAM: "unchecked", SITE_CHECK_RUN_PARAM: "none"}, {TAG_FORCED: "unchecked"})
    assert "its site check could not run" in prior_guard(prior, unchecked, "site-b")
    assert prior_guard(prior, _recal_run({SITE_CHECK_PARAM: COMPARABLE}), "site-b") is None
    assert "predates site checks" in prior_guard(prior, _recal_run(), "site-b")
