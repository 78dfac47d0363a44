"""Run the real CT bundle JSONs end to end with tiny overrides (as the MONAI model zoo's CI does).

A 15-CT synthetic cohort at 5 mm (64x64x48 voxels) keeps each run to seconds of compute; every
stage-1 variant, the LAS bundle and the inference bundle go through ``monai.bundle.run`` with the
JSON files of ``bundles/`` and a temporary ``output_dir``.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lungcal import tracking

ROOT = Path(__file__).resolve().parents[2]
BUNDLES = ROOT / "bundles"
STAGE1 = ["nlst_ce", "nlst_focal", "nlst_mixup", "nlst_focal_mixup"]
TINY_BAGS = {"spacing": [5.0, 5.0, 5.0], "hu_window": [-1000, 400], "k": 8, "patch_size": 8}


@pytest.fixture(scope="module")
def tiny_cohort(tmp_path_factory) -> Path:
    from lungcal.data.synthetic import make_cohort

    out = tmp_path_factory.mktemp("cohort")
    return Path(make_cohort(out, n_subjects=15, prevalence=0.5, seed=1, shape=(64, 64, 48), spacing=(5.0, 5.0, 5.0),
                            formats=("dicom",), progress=False))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def run_bundle(name: str, monkeypatch, **overrides):
    """``python -m monai.bundle run --config_file bundles/<name>.json --k v ...`` in-process, from the root."""
    from monai.bundle import run

    monkeypatch.chdir(ROOT)  # % macros resolve from the working directory
    run(config_file=str(Path("bundles") / f"{name}.json"), logging_file=False, **overrides)


def tiny(cohort: Path, store: Path, **kw):
    return {"datalist": str(cohort), "output_dir": str(store), "epochs": 1, "n_bootstrap": 20, "num_workers": 0,
            "bag_params": dict(TINY_BAGS), "batch_size": 4, **kw}


def _runs(store: Path, **tags):
    client = MlflowClient(tracking.default_tracking_uri(store))
    exp = client.get_experiment_by_name("nlst")
    flt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
    return client, client.search_runs([exp.experiment_id], filter_string=flt, order_by=["attributes.start_time DESC"])


def _cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its ``__cause__`` chain (monai.bundle wraps the workflow's own error)."""
    chain = []
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__
    return chain


def test_variants_hold_only_choices_and_share_the_wiring():
    wiring = {"imports", "experiment", "train", "validate", "run"}
    for name in STAGE1:
        cfg = json.loads((BUNDLES / f"{name}.json").read_text())
        assert cfg["experiment"] == "%bundles/ct_common.json#stage1#experiment"
        assert cfg["run"] == "%bundles/ct_common.json#stage1#run"
        for k, v in cfg.items():  # nothing but choices and macro pointers
            if k in wiring:
                assert "_target_" not in json.dumps(v), f"{name}.json#{k} repeats wiring"
    for f in ("metadata.json", "logging.conf", "ct_common.json", "nlst_las.json", "inference.json"):
        assert (BUNDLES / f).is_file()


def test_las_without_stage1_run_is_a_config_error(tiny_cohort, tmp_path, monkeypatch):
    from lungcal.errors import ConfigError

    with pytest.raises(Exception) as info:
        run_bundle("nlst_las", monkeypatch, datalist=str(tiny_cohort), output_dir=str(tmp_path), num_workers=0)
    assert any(isinstance(x, ConfigError) and "stage-1" in str(x) for x in _cause_chain(info.value))


@pytest.mark.parametrize("name", STAGE1)
def test_stage1_bundle_trains_evaluates_and_links_a_ts_run(name, tiny_cohort, store, monkeypatch, capsys):
    run_bundle(name, monkeypatch, **tiny(tiny_cohort, store, run_name=f"t-{name}"))
    out = capsys.readouterr().out
    assert "mlflow ui --backend-store-uri sqlite:///" in out and "ECE" in out
    method = name[len("nlst_"):]
    client, runs = _runs(store, **{tracking.TAG_STAGE1: method})
    s1 = [r for r in runs if r.data.tags[tracking.TAG_STAGE2] == "none"][0]
    ts = [r for r in runs if r.data.tags[tracking.TAG_STAGE2] == "ts"][0]
    assert s1.info.status == ts.info.status == "FINISHED"
    assert s1.info.run_name == f"t-{name}"
    assert ts.data.tags[tracking.TAG_PARENT] == s1.info.run_id
    assert s1.data.tags[tracking.TAG_DATASET] == "synthetic"
    for r in (s1, ts):
        for k in ("test/ece", "test/ece_ci_low", "test/ece_ci_high", "test/auc", "test/acc"):
            assert k in r.data.metrics, k
    assert "val/auc" in s1.data.metrics and "train/loss" in s1.data.metrics
    # TS never changes AUC or ACC
    assert ts.data.metrics["test/auc"] == pytest.approx(s1.data.metrics["test/auc"], abs=1e-9)
    assert ts.data.metrics["test/acc"] == pytest.approx(s1.data.metrics["test/acc"], abs=1e-9)
    assert ts.data.metrics["temperature"] > 0
    arts = {a.path for a in client.list_artifacts(s1.info.run_id)}
    assert {"plots", "predictions", "config", "model", "checkpoint"} <= arts
    assert s1.data.params["datalist.source"] == "synthetic"
    assert all(str(tiny_cohort.parent) not in v for v in s1.data.params.values())
    ckdir = store / "checkpoints" / s1.info.run_id
    assert (ckdir / "best.pt").is_file() and (ckdir / "last.pt").is_file()
    assert not list(ckdir.glob(".*.tmp"))


def test_las_bundle_from_latest_stage1_run(tiny_cohort, store, monkeypatch):
    if not (store / "mlflow.db").exists():
        run_bundle("nlst_ce", monkeypatch, **tiny(tiny_cohort, store))
    client, s1 = _runs(store, **{tracking.TAG_STAGE2: "none"})
    run_bundle("nlst_las", monkeypatch, datalist=str(tiny_cohort), output_dir=str(store), epochs=2, n_bootstrap=20,
               num_workers=0)
    _, las = _runs(store, **{tracking.TAG_STAGE2: "las"})
    assert las and las[0].info.status == "FINISHED"
    assert las[0].data.tags[tracking.TAG_PARENT] == s1[0].info.run_id
    assert "test/ece" in las[0].data.metrics
    assert las[0].data.params["class_counts"].startswith("[")


def test_inference_bundle_writes_probabilities_and_candidates(tiny_cohort, store, tmp_path, monkeypatch):
    if not (store / "mlflow.db").exists():
        run_bundle("nlst_ce", monkeypatch, **tiny(tiny_cohort, store))
    out = tmp_path / "pred"
    run_bundle("inference", monkeypatch, inputs=str(tiny_cohort), output=str(out), output_dir=str(store),
               num_workers=0)
    rows = list(csv.DictReader(open(out / "predictions.csv")))
    assert len(rows) == 15
    assert all(0.0 <= float(r["probability"]) <= 1.0 for r in rows)
    tables = sorted((out / "candidates").glob("*.csv"))
    assert len(tables) == 15
    cand = list(csv.DictReader(open(tables[0])))
    assert cand and {"x_mm", "y_mm", "z_mm", "attention"} <= set(cand[0])
    att = sum(float(c["attention"]) for c in cand)
    assert att == pytest.approx(1.0, abs=1e-4)
    # the temperature is the reference one unless a site's own recalibration is asked for
    temps = {float(r["temperature"]) for r in rows}
    latest = _runs(store, **{tracking.TAG_STAGE2: "none"})[1][0]
    assert len(temps) == 1
    assert temps.pop() == pytest.approx(tracking.linked_temperature(tracking.default_tracking_uri(store), latest), abs=6e-5)  # the CSV holds 4 decimals
    with pytest.raises(Exception) as info:
        run_bundle("inference", monkeypatch, inputs=str(tiny_cohort), output=str(tmp_path / "p2"),
                   output_dir=str(store), num_workers=0, site="nowhere")
    chain = _cause_chain(info.value)
    assert any("recalibrate" in str(x) for x in chain), chain
