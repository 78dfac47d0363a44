"""bundles/nlst_ensemble.json end to end on the tiny cohort: members as nested child runs, their average, its TS;
and ``mc_samples`` through a stage-1 bundle."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from lungcal.calibration import auroc
from lungcal.ctapp.train.ensemble import EnsembleRun
from lungcal.errors import ConfigError
from lungcal.runtime.exit_hook import find_lungcal_error
from lungcal.tracking import (
    MLFLOW_PARENT,
    TAG_CALIBRATOR,
    TAG_ENSEMBLE,
    TAG_PARENT,
    TAG_STAGE1,
    TAG_STAGE2,
    default_tracking_uri,
)
from tests.bundles.test_ct_bundles import BUNDLES, run_bundle, tiny


def test_the_ensemble_bundle_states_only_what_differs_from_the_focal_recipe():
    focal = json.loads((BUNDLES / "nlst_focal.json").read_text())
    ens = json.loads((BUNDLES / "nlst_ensemble.json").read_text())
    assert set(ens) - {"_comment", "+initialize"} == {"ensemble_members", "workflow"} and ens["ensemble_members"] == 5
    assert ens["workflow"]["_target_"] == "lungcal.ctapp.train.ensemble.EnsembleRun"
    assert ens["workflow"]["member_files"] == ["bundles/nlst_focal.json"]
    assert focal["workflow"]["_target_"] == "lungcal.ctapp.train.stage1.Stage1Run"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One output folder for the module: the tiny cohort's bags are built once."""
    return tmp_path_factory.mktemp("ensemble_runs")


def _csv(client, run_id):
    path = client.download_artifacts(run_id, "predictions/test_predictions.csv")
    with open(path) as f:
        return {r["subject"]: r for r in csv.DictReader(f)}


def test_ensemble_bundle_nests_members_and_evaluates_their_average(tiny_cohort, store, monkeypatch, capsys):
    run_bundle("nlst_ensemble", monkeypatch, **tiny(tiny_cohort, store, ensemble_members=2, run_name="ens"))
    out = capsys.readouterr().out
    assert "deep ensemble of 2" in out and "ensemble+TS" in out
    client = MlflowClient(default_tracking_uri(store))
    runs = client.search_runs([client.get_experiment_by_name("nlst").experiment_id])
    assert all(r.info.status == "FINISHED" for r in runs)
    parent = [r for r in runs if r.data.tags.get(TAG_ENSEMBLE) == "parent"]
    members = sorted((r for r in runs if r.data.tags.get(TAG_ENSEMBLE) == "member"), key=lambda r: r.info.run_name)
    assert len(parent) == 1 and len(members) == 2
    parent = parent[0]
    assert parent.data.tags[TAG_STAGE2] == "ensemble" and parent.data.tags[TAG_STAGE1] == "focal"
    assert [m.info.run_name for m in members] == ["ens-m0", "ens-m1"]
    assert [m.data.params["seed"] for m in members] == ["0", "1"]  # different seeds, nothing else
    for m in members:
        assert m.data.tags[MLFLOW_PARENT] == parent.info.run_id == m.data.tags[TAG_PARENT]
        assert m.data.tags[TAG_STAGE2] == "none" and "test/mean_entropy" in m.data.metrics
        assert "test/mean_mi" not in m.data.metrics  # one deterministic model: no epistemic part
    # the parent's probabilities are the mean of its members'
    rows = [_csv(client, m.info.run_id) for m in members]
    ens = _csv(client, parent.info.run_id)
    assert set(ens) == set(rows[0]) == set(rows[1]) and len(ens) > 0
    for subject, r in ens.items():
        mean = np.mean([float(x[subject]["probability"]) for x in rows])
        assert float(r["probability"]) == pytest.approx(mean, abs=2e-6)
        assert float(r["mi"]) >= 0.0 and float(r["entropy"]) >= float(r["mi"]) - 1e-6
    labels = np.array([int(r["label"]) for r in ens.values()])
    p = np.array([float(r["probability"]) for r in ens.values()])
    m = parent.data.metrics
    assert m["test/auc"] == pytest.approx(auroc(p, labels), abs=1e-6)
    assert m["test/mean_mi"] == pytest.approx(np.mean([float(r["mi"]) for r in ens.values()]), abs=1e-5)
    assert m["ensemble_members"] == 2 and "test/ece_ci_low" in m and "val/auc" in m
    # TS on the log of the averaged probabilities, in a run linked to the parent
    ts = [r for r in runs if r.data.tags.get(TAG_STAGE2) == "ensemble+ts"]
    assert len(ts) == 1 and ts[0].data.tags[TAG_PARENT] == parent.info.run_id
    assert ts[0].data.tags[TAG_CALIBRATOR] == "ts" and ts[0].data.metrics["temperature"] > 0
    assert ts[0].data.metrics["test/auc"] == pytest.approx(m["test/auc"], abs=1e-9)


def test_mc_samples_on_a_network_without_dropout_is_a_config_error(tiny_cohort, store, monkeypatch):
    with pytest.raises(Exception) as info:
        run_bundle("nlst_focal", monkeypatch, **tiny(tiny_cohort, store, dropout=0.0, mc_samples=4, run_name="no-mc"))
    error = find_lungcal_error(info.value)
    assert isinstance(error, ConfigError) and "mc_samples" in str(error) and "dropout" in str(error)
    client = MlflowClient(default_tracking_uri(store))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert all(r.info.status != "RUNNING" for r in runs) and all(r.info.run_name != "no-mc" for r in runs)


def test_ensemble_of_one_is_a_config_error(tiny_cohort, store, monkeypatch):
    with pytest.raises(Exception) as info:
        run_bundle("nlst_ensemble", monkeypatch, **tiny(tiny_cohort, store, ensemble_members=1))
    assert isinstance(find_lungcal_error(info.value), ConfigError)


@pytest.mark.slow
def test_an_interrupted_ensemble_reopens_its_parent_and_keeps_its_finished_members(tiny_cohort, tmp_path,
                                                                                    monkeypatch, capsys):
    build = EnsembleRun.build_member

    def crash_at_member_1(self, index, parent_run_id):
        if index == 1:
            raise RuntimeError("simulated crash")
        return build(self, index, parent_run_id)

    monkeypatch.setattr(EnsembleRun, "build_member", crash_at_member_1)
    with pytest.raises(Exception) as info:
        run_bundle("nlst_ensemble", monkeypatch, **tiny(tiny_cohort, tmp_path, ensemble_members=2, run_name="ens"))
    chain, err = [], info.value
    while err is not None:
        chain.append(str(err))
        err = err.__cause__ or err.__context__
    assert any("simulated crash" in c for c in chain)
    client = MlflowClient(default_tracking_uri(tmp_path))
    exp = client.get_experiment_by_name("nlst")
    first = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get(TAG_ENSEMBLE) == "parent"]
    assert [r.info.status for r in first] == ["FAILED"]
    monkeypatch.setattr(EnsembleRun, "build_member", build)
    capsys.readouterr()
    run_bundle("nlst_ensemble", monkeypatch, **tiny(tiny_cohort, tmp_path, ensemble_members=2, run_name="ens"))
    assert "finished before" in capsys.readouterr().out
    runs = client.search_runs([exp.experiment_id])
    assert all(r.info.status == "FINISHED" for r in runs)
    parent = [r for r in runs if r.data.tags.get(TAG_ENSEMBLE) == "parent"]
    members = [r for r in runs if r.data.tags.get(TAG_ENSEMBLE) == "member"]
    assert [r.info.run_id for r in parent] == [first[0].info.run_id]  # the same parent run, reopened
    assert sorted(m.info.run_name for m in members) == ["ens-m0", "ens-m1"]  # member 0 trained once
    rows = [_csv(client, m.info.run_id) for m in members]
    ens = _csv(client, parent[0].info.run_id)
    for subject, r in ens.items():
        assert float(r["probability"]) == pytest.approx(np.mean([float(x[subject]["probability"]) for x in rows]),
                                                        abs=2e-6)
