"""``bundles/inference.json --site NAME`` applies whatever calibrator that site stored, not only a temperature.

A tiny stage-1 model is trained with the real bundle; two site recalibration runs are stored the
way ``lungcal recalibrate`` stores them (``lungcal.site``, ``lungcal.recalibration = local``,
``lungcal.calibrator`` and ``calibrator/<name>.json``): a Platt scaler, and a prior adjustment on
top of the reference TS. The oracle is the stored calibrator's own ``predict_proba`` on the
model's logits, computed here from the same checkpoint and bags.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from monai.bundle import run

from lungcal.calibration.prior import PriorAdjusted, adjust_to_prior
from lungcal.calibration.scaling import PlattScaler, probabilities
from lungcal.candidates.cache import build_bags
from lungcal.ctapp.data.bagset import BagSet
from lungcal.ctapp.data.cohort import load_split
from lungcal.ctapp.evaluate.calibrators import reference_calibrator
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.ctapp.model.predict import predict
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import make_cohort
from lungcal.paths import atomic_write_text
from lungcal.tracking import RunTracker, default_tracking_uri

ROOT = Path(__file__).resolve().parents[2]
#: the tiny cohort is at 5 mm: series checks that accept its slices and pixels (the defaults refuse both)
TINY_QC = {"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0,
           "max_pixel_mm": 6.0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny cohort, a store, and the run id of a 1-epoch nlst_ce model trained on it."""
    cohort = Path(make_cohort(tmp_path_factory.mktemp("cohort"), n_subjects=15, prevalence=0.5, seed=1,
                              shape=(64, 64, 48), spacing=(5.0, 5.0, 5.0), formats=("nifti",), progress=False))
    store = tmp_path_factory.mktemp("runs")
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)  # % macros resolve from the working directory
    try:
        run(config_file=["bundles/nlst_focal.json", "bundles/nlst_ce.json"], logging_file=False,
            datalist=str(cohort), output_dir=str(store),
            epochs=1, n_bootstrap=20, num_workers=0, spacing=[5.0, 5.0, 5.0], patch_size=8, batch_size=4,
            run_name="tiny", qc=TINY_QC)
    finally:
        mp.undo()
    client = MlflowClient(default_tracking_uri(store))
    exp = client.get_experiment_by_name("nlst")
    s1 = client.search_runs([exp.experiment_id], "tags.`lungcal.stage2` = 'none'")[0]
    return {"cohort": cohort, "store": store, "uri": default_tracking_uri(store), "run": s1}


def _store_site(trained, site: str, calibrator, tmp_path) -> None:
    s1 = trained["run"]
    tags = {"lungcal.stage1": "ce", "lungcal.stage2": calibrator.name, "lungcal.calibrator": calibrator.name,
            "lungcal.site": site, "lungcal.recalibration": "local"}
    with RunTracker("nlst", f"ce+{calibrator.name}@{site}", tracking_uri=trained["uri"], tags=tags,
                    parent_run_id=s1.info.run_id) as tr:
        tr.log_artifact(atomic_write_text(tmp_path / site / f"{calibrator.name}.json", calibrator.to_json()),
                        "calibrator")


def _model_logits(trained) -> dict[str, np.ndarray]:
    model = load_stage1(trained["run"].info.run_id, trained["uri"])
    rows = load_manifest(trained["cohort"])
    split = load_split(build_bags(rows, model.bag_params, trained["store"] / "cache" / "bags", num_workers=0))
    loader = torch.utils.data.DataLoader(BagSet(split["bags"], split["mask"], torch.zeros(len(rows), dtype=torch.long)),
                                         batch_size=4, shuffle=False)
    logits = predict(model.network, loader)["logits"].numpy()
    return dict(zip(split["subjects"], logits, strict=True))


def _infer(trained, out: Path, **kw) -> list[dict]:
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    try:
        run(config_file="bundles/inference.json", logging_file=False, inputs=str(trained["cohort"]), output=str(out),
            output_dir=str(trained["store"]), num_workers=0, stage1_run_id=trained["run"].info.run_id, qc=TINY_QC,
            pictures=False, **kw)  # pictures: tests/bundles/test_predict_command.py
    finally:
        mp.undo()
    return list(csv.DictReader(open(out / "predictions.csv")))


def test_inference_site_applies_a_stored_non_ts_calibrator_and_a_prior_adjustment(trained, tmp_path):
    platt = PlattScaler().load_state_dict({"name": "platt", "slope": 0.6, "intercept": -0.8, "n_classes": 2})
    _store_site(trained, "site-platt", platt, tmp_path)
    ref = reference_calibrator(trained["uri"], trained["run"])
    assert ref is not None and ref.name == "ts"  # the bundle's post_hoc default
    prior = PriorAdjusted(ref, source_prior=0.5, target_prior=0.1, estimated_by="given")
    _store_site(trained, "site-prior", prior, tmp_path)
    logits = _model_logits(trained)
    z = np.stack(list(logits.values()))
    assert np.ptp(z[:, 1] - z[:, 0]) > 0  # the oracle is not a constant

    rows = _infer(trained, tmp_path / "platt", site="site-platt")
    assert len(rows) == len(logits) and {r["calibrator"] for r in rows} == {"platt"}
    assert {r["temperature"] for r in rows} == {""}  # a Platt scaler has no temperature
    for r in rows:
        expected = platt.predict_proba(logits[r["subject"]][None, :])[0, 1]
        assert float(r["probability"]) == pytest.approx(expected, abs=1e-6)
        assert float(r["probability"]) != pytest.approx(probabilities(logits[r["subject"]][None, :])[0, 1], abs=1e-4)

    rows = _infer(trained, tmp_path / "prior", site="site-prior")
    assert {r["calibrator"] for r in rows} == {"prior"}
    for r in rows:
        expected = adjust_to_prior(probabilities(logits[r["subject"]][None, :], ref.temperature), 0.5, 0.1)[0, 1]
        assert float(r["probability"]) == pytest.approx(expected, abs=1e-6)

    # without --site: the reference TS of the stage-1 run's post-hoc step
    rows = _infer(trained, tmp_path / "reference")
    assert {r["calibrator"] for r in rows} == {"ts"}
    for r in rows:
        expected = probabilities(logits[r["subject"]][None, :], ref.temperature)[0, 1]
        assert float(r["probability"]) == pytest.approx(expected, abs=1e-6)
        assert float(r["temperature"]) == pytest.approx(ref.temperature, abs=6e-5)
