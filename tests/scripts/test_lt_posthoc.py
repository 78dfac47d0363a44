"""scripts/lt_posthoc.py: TS, the ECE-best temperature, logit adjustment and vector scaling on a long-tailed model."""
from __future__ import annotations

import ast

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from cifar_baselines.bundle import run_bundle
from lungcal.calibration.metrics import ece
from tests.scripts.conftest import load_script, tiny_stage1_run

COUNTS = np.array([4500, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50], np.float64)


@pytest.fixture(scope="module")
def script():
    return load_script("lt_posthoc")


def _balanced(rng, n_per_class: int, scale: float, prior_bias: np.ndarray):
    """Balanced cases whose calibrated logits are ``s``; the model shows ``s / scale + prior_bias``."""
    y = np.repeat(np.arange(10), n_per_class)
    s = rng.normal(0.0, 1.0, (len(y), 10))
    s[np.arange(len(y)), y] += 2.0
    s *= 1.5
    # draw the labels from the calibrated model itself, so softmax(s) is exactly calibrated
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = (p.cumsum(1) > rng.random((len(y), 1))).argmax(1)
    return s / scale + prior_bias, y


def test_softmax_and_the_ece_best_temperature_of_a_purely_scaled_model(script):
    rng = np.random.default_rng(0)
    z, y = _balanced(rng, 600, scale=2.0, prior_bias=0.0)  # under-confident by a factor of 2, no prior error
    np.testing.assert_allclose(script.softmax(z).sum(1), 1.0)
    t = script.ece_optimal_temperature(z, y)
    assert 0.4 < t < 0.62  # the true temperature is 0.5
    assert ece(script.softmax(z / t), y) < ece(script.softmax(z), y) / 3


def test_the_prior_error_is_what_one_temperature_cannot_fix(script):
    """Calibrated scores shown under-confident (/2) and biased toward the head (+ log prior): TS alone
    stays near the compromise, the prior adjustment then TS recovers T = 0.5, vector scaling fits both."""
    rng = np.random.default_rng(1)
    bias = np.log(COUNTS / COUNTS.sum())
    zv, yv = _balanced(rng, 500, 2.0, bias)
    zt, yt = _balanced(rng, 800, 2.0, bias)
    fits = script.posthoc_probs(zv, yv, zt, COUNTS)
    assert set(fits) == set(script.METHODS)
    np.testing.assert_allclose(fits["prior"][0], script.softmax(zt - bias), atol=1e-12)  # no fitting
    assert fits["prior+ts"][1]["T"] == pytest.approx(0.5, abs=0.05)
    e = {k: ece(p, yt) for k, (p, _) in fits.items()}
    acc = {k: float((p.argmax(1) == yt).mean()) for k, (p, _) in fits.items()}
    assert acc["ts"] == acc["ts-ece"] == acc["none"]  # a temperature never changes the argmax
    assert acc["prior"] > acc["none"] + 0.05 and acc["prior+ts"] == acc["prior"]
    assert e["prior+ts"] < 0.03 and e["vector"] < 0.03
    assert e["prior+ts"] < e["ts"] / 2 and e["ts-ece"] <= e["ts"] + 1e-9
    with pytest.raises(ValueError, match="one positive count per class"):
        script.posthoc_probs(zv, yv, zt, COUNTS[:9])


def test_main_on_a_real_stage1_run(script, lt_data, tmp_path, monkeypatch, capsys):
    folder, _ = lt_data
    run_id, uri = tiny_stage1_run("cifar10lt_ce", folder, tmp_path, monkeypatch)
    assert script.main(["--run-id", run_id, "--tracking-uri", uri, "--n-bootstrap", "20", "--compare", run_id]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| post-hoc")]
    name = MlflowClient(uri).get_run(run_id).info.run_name
    assert [r.split(" | ")[0][2:] for r in rows] == [*script.METHODS, f"run {name}"]
    assert rows[-1].split(" | ")[2:6] == rows[0].split(" | ")[2:6]  # the run itself: the same as none
    assert f"vector − {name} (pp): ΔECE " in out and "; ΔACC " in out
    assert "0 (same argmax)" in rows[1]  # TS: the accuracy difference is exactly 0
    counts = ast.literal_eval(MlflowClient(uri).get_run(run_id).data.params["class_counts"])
    assert f"training class counts {[int(c) for c in counts]}" in out and counts[0] > counts[-1]


def test_experiment_mode_tables_each_stage1_run_with_its_las_runs(script, lt_data, tmp_path, monkeypatch, capsys):
    folder, _ = lt_data
    run_id, uri = tiny_stage1_run("cifar10lt_focal", folder, tmp_path, monkeypatch)
    las = run_bundle("bundles/cifar10lt_las.json", {"data_dir": str(folder), "output_dir": str(tmp_path),
                                                    "tracking_uri": uri, "batch_size": 64, "n_bootstrap": 20,
                                                    "stage1_run_id": run_id, "epochs": 1})
    assert script.stage1_runs(MlflowClient(uri), "cifar10lt") == [(run_id, [las["run_id"]])]  # not the TS run
    capsys.readouterr()
    assert script.main(["--experiment", "cifar10lt", "--tracking-uri", uri, "--n-bootstrap", "20"]) == 0
    out = capsys.readouterr().out
    las_name = MlflowClient(uri).get_run(las["run_id"]).info.run_name
    assert out.count("| post-hoc |") == 1 and f"| run {las_name} |" in out and f"vector − {las_name} (pp)" in out
    with pytest.raises(SystemExit):
        script.main(["--experiment", "no_such", "--tracking-uri", uri])
