"""``lungcal site-check``: the verdict (comparable / prevalence_shift / scanner_shift), the routes, the JSON, the
MLflow run, and the refusal of a site too small to tell.

Two levels:
- :func:`assess` and :func:`acquisition_checks` on simulated model outputs, embeddings and acquisition
  statistics whose laws are known (a same-scanner site, a prevalence-only site, two scanner changes);
- the command on a stage-1 MLflow run holding a real site reference and acquisition summary, with the bag
  pipeline replaced by fixed outputs (the end-to-end run on synthetic CTs is
  ``experiments/site_check_rates.py``, its numbers in docs/results.md).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from lungcal.cli import main
from lungcal.ct.acquisition import AcquisitionStats, summarize_acquisitions
from lungcal.ct.qc import QCReport
from lungcal.ctapp.site import site_check as site_check_module
from lungcal.ctapp.site.site_check import (
    COMPARABLE,
    MIN_SITE_CTS,
    PREVALENCE_SHIFT,
    ROUTES,
    SCANNER_SHIFT,
    Reference,
    acquisition_checks,
    assess,
)
from lungcal.mil.models import build_mil_model
from lungcal.tracking import ACQUISITION_ARTIFACT, SITE_REFERENCE_ARTIFACT, TAG_SITE_CHECK, RunTracker

D = 12


def _cases(rng, n, prevalence, noise=1.0):
    """Bag embeddings with the class on the first axis, the model's score read from it; a noisier scanner
    widens every axis."""
    y = (rng.random(n) < prevalence).astype(int)
    f = rng.normal(size=(n, D)) * noise
    f[:, 0] += np.where(y == 1, 1.5, -1.5)
    return f[:, 0] + 0.1 * f[:, 1], f, y


def _acq(rng, n, noise_hu=20.0, slice_mm=2.5, air=-1000.0):
    return [AcquisitionStats(slice_mm, slice_mm, 0.7, air + rng.normal(0, 3), noise_hu * rng.lognormal(0, 0.05),
                             0.8 + rng.normal(0, 0.05)) for _ in range(n)]


@pytest.fixture(scope="module")
def source():
    rng = np.random.default_rng(0)
    s, f, y = _cases(rng, 300, 0.4)
    return {"ref": Reference(s, y, f, "simulated"), "summary": summarize_acquisitions(_acq(rng, 600))}


def _verdict(source, seed, n=120, prevalence=0.4, noise=1.0, **acq):
    rng = np.random.default_rng(seed)
    s, f, _ = _cases(rng, n, prevalence, noise)
    checks = acquisition_checks(source["summary"], _acq(rng, n, **acq))
    return assess(source["ref"], s, f, checks, n_resamples=500, n_subsamples=5, n_bootstrap=200, seed=seed)


def test_a_same_scanner_site_is_comparable(source):
    found = _verdict(source, 1)
    assert found["verdict"] == COMPARABLE, found["reasons"]
    assert found["source_prevalence"] == pytest.approx(source["ref"].labels.mean())
    e = found["effect"]  # the size beside the p-values: small, and what this n could have shown
    assert not e["large"] and e["ci"][0] <= 0.5 <= e["ci"][1] and 0.5 < e["mde"] < 0.7


def test_the_effect_size_is_large_on_a_shifted_site_and_not_on_a_prevalence_only_one(source):
    shifted = _verdict(source, 3, prevalence=0.1, noise=1.4, noise_hu=30.0)["effect"]
    assert shifted["large"] and shifted["ci"][0] > 0.5
    prevalence_only = _verdict(source, 2, prevalence=0.1)["effect"]  # re-weighted to the site's prevalence
    assert not prevalence_only["large"]


def test_a_prevalence_only_site_is_a_prevalence_shift_not_a_scanner_change(source):
    found = _verdict(source, 2, prevalence=0.1)
    assert found["verdict"] == PREVALENCE_SHIFT, found["reasons"]
    assert found["prevalence_ci"][0] < 0.1 < found["prevalence_ci"][1]
    assert found["prevalence"] == pytest.approx(0.1, abs=0.08)


def test_a_noisier_scanner_is_a_scanner_shift_through_the_acquisition_and_the_embeddings(source):
    found = _verdict(source, 3, prevalence=0.1, noise=1.4, noise_hu=30.0)
    assert found["verdict"] == SCANNER_SHIFT
    assert any(r.startswith("noise_hu") for r in found["reasons"])
    assert found["tests"]["embeddings_beyond_prevalence"]["pvalue"] < found["level"]


def test_thicker_slices_alone_are_a_scanner_shift(source):
    found = _verdict(source, 4, slice_mm=5.0)
    assert found["verdict"] == SCANNER_SHIFT
    assert [r.split(":")[0] for r in found["reasons"]] == ["slice_thickness_mm", "slice_spacing_mm"]


def test_acquisition_checks_count_outside_the_widened_1_to_99_percent_range(source):
    rng = np.random.default_rng(5)
    stats = _acq(rng, 50, noise_hu=20.0) + [AcquisitionStats(2.5, 2.5, 0.7, math.nan, 40.0, 0.8)]
    checks = acquisition_checks(source["summary"], stats)
    q = source["summary"]["fields"]["noise_hu"]["quantiles"]
    assert checks["noise_hu"]["training_low"] == pytest.approx(q["0.01"] * 0.85)
    assert checks["noise_hu"]["training_high"] == pytest.approx(q["0.99"] * 1.15)
    assert checks["noise_hu"]["outside"] >= 1 and checks["noise_hu"]["n"] == 51
    assert checks["air_hu"]["n"] == 50  # NaN left out
    assert acquisition_checks(None, stats) == {}


# ------------------------------------------------------------------------------------------ the command
@pytest.fixture
def site(tmp_path, monkeypatch, source):
    """A stage-1 run holding a checkpoint, a site reference and an acquisition summary; a site datalist whose
    bags are replaced by fixed outputs (``fake["scores"]``, ``fake["features"]``) and whose series checks by
    reports carrying ``fake["acq"]``."""
    cfg = {"encoder": "small", "head": "attention", "embed_dim": 16, "attn_dim": 8, "dropout": 0.0,
           "patch_size": 16, "num_classes": 2}
    ck = tmp_path / "best.pt"
    torch.save({"state_dict": build_mil_model(**cfg).state_dict(), "model_config": cfg,
                "bag_params": json.dumps({"k": 4}), "method": "focal", "epoch": 1, "metric": 0.8}, ck)
    ref = source["ref"]
    np.savez(tmp_path / "site_reference.npz", scores=ref.scores, labels=ref.labels, features=ref.features)
    (tmp_path / "acquisition.json").write_text(json.dumps(source["summary"]))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with RunTracker("nlst", "stage1", tracking_uri=uri,
                    tags={"lungcal.stage1": "focal", "lungcal.stage2": "none"}) as tr:
        tr.log_artifact(ck, "checkpoint")
        tr.log_artifact(tmp_path / "site_reference.npz", SITE_REFERENCE_ARTIFACT.rsplit("/", 1)[0])
        tr.log_artifact(tmp_path / "acquisition.json", ACQUISITION_ARTIFACT.rsplit("/", 1)[0])
        parent = tr.run_id

    def make_site(n, seed=1, **kw):
        rows = [{"image": f"ct{i}.nii.gz", "label": -1, "subject": f"S-{i:03d}", "site": "site-b", "split": "test"}
                for i in range(n)]
        for r in rows:
            (tmp_path / r["image"]).write_bytes(b"")
        dl = tmp_path / f"site_{n}_{seed}.json"
        dl.write_text(json.dumps({"version": 1, "source": "site:site-b", "rows": rows}))
        rng = np.random.default_rng(seed)
        s, f, _ = _cases(rng, n, kw.pop("prevalence", 0.4), kw.pop("noise", 1.0))
        fake.update(scores=s, features=f, acq=_acq(rng, n, **kw))
        return dl

    fake: dict = {}

    def fake_screen(rows, qc, cache_dir, masker=None, num_workers=0, progress=True):
        return [QCReport([], acquisition=a) for a in fake["acq"][:len(rows)]]

    def fake_score_rows(net, rows, bag_params, calibrator, *, cache_dir, num_workers=0, batch_size=16):
        assert bag_params == {"k": 4} and calibrator is None
        s = fake["scores"][:len(rows)]
        return {"logits": np.stack([np.zeros_like(s), s], 1), "features": fake["features"][:len(rows)],
                "labels": np.zeros(len(rows), int), "subjects": [f"p{i}" for i in range(len(rows))]}

    monkeypatch.setattr(site_check_module, "screen", fake_screen)
    monkeypatch.setattr(site_check_module, "score_rows", fake_score_rows)
    return {"uri": uri, "parent": parent, "make": make_site, "tmp": tmp_path}


def _cli(site, dl, *extra):
    return main(["site-check", str(dl), "--run", site["parent"], "--tracking-uri", site["uri"],
                 "--output-dir", str(site["tmp"] / "out"), "--permutations", "500", *extra])


def test_the_command_prints_the_verdict_and_routes_writes_the_json_and_logs_a_tagged_run(site, capsys):
    dl = site["make"](100, seed=7, prevalence=0.1, noise=1.4, noise_hu=30.0)
    out_json = site["tmp"] / "check.json"
    assert _cli(site, dl, "--json", str(out_json)) == 0
    printed = capsys.readouterr().out
    assert "verdict       scanner_shift" in printed
    assert "not valid here: --prevalence, --unlabelled" in printed
    assert "effect size   domain AUC" in printed and ": large" in printed
    doc = json.loads(out_json.read_text())
    assert doc["verdict"] == SCANNER_SHIFT and doc["n"] == 100 and doc["n_reference"] == 300
    assert {"outputs_any_change", "outputs_beyond_prevalence", "embeddings_beyond_prevalence"} <= set(doc["tests"])
    assert 0 <= doc["prevalence"] <= 1 and len(doc["prevalence_ci"]) == 2
    assert doc["acquisition"]["noise_hu"]["outside"] > 50
    assert len(doc["routes"]) == len(ROUTES[SCANNER_SHIFT])
    assert doc["n_flagged"] == sum(c["flagged"] for c in doc["per_ct"]) > 50
    assert [c["subject"] for c in doc["per_ct"]][:2] == ["c0000", "c0001"]  # pseudonyms, not the site's ids
    client = MlflowClient(site["uri"])
    run = client.get_run(doc["run_id"])
    assert run.data.tags[TAG_SITE_CHECK] == SCANNER_SHIFT and run.data.tags["lungcal.parent_run"] == site["parent"]
    arts = {a.path for a in client.list_artifacts(run.info.run_id)} | {
        a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"site_check.json", "plots/site_check.png"} <= arts
    logged = json.dumps(run.data.params) + json.dumps(run.data.tags) + json.dumps(
        json.loads(open(client.download_artifacts(run.info.run_id, "site_check.json")).read()))
    assert "S-000" not in logged and str(dl) not in logged


def test_a_same_scanner_site_is_comparable_through_the_command(site, capsys):
    dl = site["make"](80, seed=8)
    assert _cli(site, dl) == 0
    printed = capsys.readouterr().out
    assert "verdict       comparable" in printed
    assert "could show    a domain AUC of" in printed and "may hide behind 'comparable'" in printed


def test_a_site_too_small_to_tell_is_one_line_naming_the_minimum_and_exit_2(site, capsys):
    dl = site["make"](MIN_SITE_CTS - 1)
    assert main(["site-check", str(dl), "--run", site["parent"], "--tracking-uri", site["uri"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lungcal site-check: error:") and f"at least {MIN_SITE_CTS}" in err[0]
    client = MlflowClient(site["uri"])
    assert not client.search_runs([client.get_experiment_by_name("nlst").experiment_id],
                                  f"tags.`{TAG_SITE_CHECK}` != ''")


def test_a_bad_alpha_and_a_run_without_a_reference_are_config_errors(site, tmp_path, capsys):
    dl = site["make"](30)
    assert _cli(site, dl, "--alpha", "0.7") == 2
    assert "--alpha" in capsys.readouterr().err
    assert main(["site-check", str(dl), "--run", site["parent"], "--tracking-uri", site["uri"],
                 "--permutations", "100"]) == 2  # cannot reach alpha / 8
    assert "at least" in capsys.readouterr().err
    uri = site["uri"]
    with RunTracker("nlst", "old", tracking_uri=uri, tags={"lungcal.stage1": "focal", "lungcal.stage2": "none"}) as tr:
        tr.log_artifact(site["tmp"] / "best.pt", "checkpoint")
        old = tr.run_id
    assert main(["site-check", str(dl), "--run", old, "--tracking-uri", uri]) == 2
    assert "--reference" in capsys.readouterr().err
