"""experiments/las_sampling.py: the LAS runs' test predictions, each control paired CT for CT against the
shipped run."""
from __future__ import annotations

import mlflow
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from tests.experiments.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("las_sampling")


def _run_with_predictions(client: MlflowClient, experiment: str, tmp_path, name: str, subjects, labels, p) -> str:
    run = client.create_run(experiment)
    path = tmp_path / name / "test_predictions.csv"
    path.parent.mkdir()
    rows = "".join(f"{s},{y},{q:.6f}\n" for s, y, q in zip(subjects, labels, p))
    path.write_text("subject,label,probability\n" + rows)
    client.log_artifact(run.info.run_id, str(path), "predictions")
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def test_the_table_pairs_the_two_runs_on_the_same_cts(script, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    experiment = client.create_experiment("nlst", artifact_location=str(tmp_path / "artifacts"))
    rng = np.random.default_rng(0)
    labels = (rng.random(200) < 0.4).astype(int)
    truth = np.clip(0.4 + 0.3 * (labels - 0.4) + 0.1 * rng.standard_normal(200), 0.02, 0.98)
    subjects = [f"s{i:03d}" for i in range(200)]
    shifted = 1 / (1 + np.exp(-(np.log(truth / (1 - truth)) + 0.41)))  # a prior of 0.5 where the truth has 0.4
    balanced = _run_with_predictions(client, experiment, tmp_path, "b", subjects, labels, shifted)
    unbalanced = _run_with_predictions(client, experiment, tmp_path, "u", subjects[::-1], labels[::-1], truth[::-1])
    no_smoothing = _run_with_predictions(client, experiment, tmp_path, "e", subjects, labels, shifted)
    table = script.compare(uri, balanced, unbalanced, no_smoothing, n_bootstrap=200)
    assert "test CTs: 200" in table and "smoothing alone (balanced_sampling false)" in table
    rows = table.splitlines()
    same = rows[-1].split("|")  # the ε 0 arm here scores what the shipped one does: no difference
    assert "balanced batches alone" in same[1] and float(same[3].split()[0]) == 0.0
    diff = rows[-2].split("|")
    intercept = float(diff[3].split()[0])  # columns: name, ece, cal_intercept, ...
    assert intercept == pytest.approx(0.41, abs=0.05)  # the prior shift undone, CT for CT
    assert float(diff[-2]) < 0  # and the mean predicted probability falls


def test_it_needs_the_shipped_run_and_a_control(script):
    with pytest.raises(SystemExit, match="2 to 3"):
        script.compare("sqlite:///unused.db", "only-one")
