"""``lungcal archive``: a run's test predictions, config, commit and data hashes in one file, from which its logged
metrics are recomputed (issue 47 item 6); every run records the commit it ran."""
from __future__ import annotations

import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from lungcal.calibration.metrics import calibration_report
from lungcal.cli import main
from lungcal.study.archive import check_archive, load_archive
from lungcal.tracking import TAG_DATASET, TAG_STAGE1, TAG_STAGE2, RunTracker
from lungcal.tracking.names import MLFLOW_GIT_COMMIT, TAG_CODE_DIRTY
from lungcal.tracking.tracker import code_version
from tests.cifar_baselines.cifar_fakes import tiny_stage1_run, write_fake_cifar


@pytest.fixture(scope="module")
def lt_folder(tmp_path_factory):
    return write_fake_cifar(tmp_path_factory.mktemp("fake_cifar"), n_train_per_class=40, n_test_per_class=8)


def test_a_cifar_run_archived_recomputes_its_logged_metrics(lt_folder, tmp_path, monkeypatch, capsys):
    run_id, uri = tiny_stage1_run("cifar10lt_ce", lt_folder, tmp_path, monkeypatch)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("cifar10lt").experiment_id])
    assert main(["archive", "--experiment", "cifar10lt", "--tracking-uri", uri, "--out", str(tmp_path / "a")]) == 0
    files = sorted((tmp_path / "a").glob("*.npz"))
    assert len(files) == len(runs) == 2  # stage 1 (none) and its TS run
    stage1 = next(f for f in files if run_id[:8] in f.name)
    assert stage1.name.startswith("cifar10lt_ce_none_seed0_")
    arch = load_archive(stage1)
    assert arch.probs.shape == (80, 10) and arch.probs.dtype == np.float64 and set(arch.labels) <= set(range(10))
    meta = arch.meta
    assert meta["params"]["train_pixels_sha256"] and meta["params"]["test_pixels_sha256"]  # the data's hashes
    assert meta["tags"][TAG_STAGE1] == "ce" and not any(".owner." in k for k in meta["tags"])
    if code_version():  # run from a git checkout: the commit it ran
        assert meta["tags"][MLFLOW_GIT_COMMIT] == code_version()[MLFLOW_GIT_COMMIT]
    problems = check_archive(stage1)
    assert problems == [], problems  # the logged ECE, accuracy, ... and their CIs, recomputed
    ts = load_archive(next(f for f in files if f is not stage1))
    assert ts.meta["calibrator"] and arch.meta["calibrator"] is None  # TS: its logits through its calibrator
    with np.load(stage1) as z:
        assert "logits" in z.files and "probs" not in z.files
    assert main(["archive", "--check", str(tmp_path / "a")]) == 0
    assert "2 of 2 archives reproduce" in capsys.readouterr().out


def test_a_changed_prediction_is_a_mismatch(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    p = np.clip(0.5 + 0.3 * (2 * y - 1) + rng.normal(0, 0.2, 200), 0.01, 0.99)
    with open(tmp_path / "test_predictions.csv", "w") as f:
        f.write("subject,label,probability\n" + "".join(f"s{i},{y[i]},{p[i]:.9f}\n" for i in range(200)))
    rep = calibration_report(p, y, n_bins=10, n_bootstrap=50, seed=3)
    with RunTracker("nlst", "ce-none", tracking_uri=uri,
                    tags={TAG_DATASET: "nlst", TAG_STAGE1: "ce", TAG_STAGE2: "none"}) as tr:
        tr.log_params({"evaluation.n_bins": 10, "evaluation.n_bootstrap": 50, "seed": 3})
        tr.log_report("test", rep)
        tr.log_artifact(tmp_path / "test_predictions.csv", "predictions")
        run_id = tr.run_id
    assert main(["archive", run_id, "--tracking-uri", uri, "--out", str(tmp_path / "a")]) == 0
    path = next((tmp_path / "a").glob("*.npz"))
    assert check_archive(path) == []
    arch = load_archive(path)
    assert "s0" not in json.dumps(arch.meta) and len(arch.meta["cases_sha256"]) == 64  # no subject ids
    with np.load(path) as z:
        stored = dict(z)
    stored["probs"] = stored["probs"].copy()
    stored["probs"][:20] = 1 - stored["probs"][:20]  # twenty CTs flipped
    np.savez_compressed(tmp_path / "a" / "flipped.npz", **stored)
    problems = check_archive(tmp_path / "a" / "flipped.npz")
    assert any(x.startswith("ece:") for x in problems)
    assert main(["archive", "--check", str(tmp_path / "a")]) == 1
    assert "flipped.npz: MISMATCH: " in capsys.readouterr().out


def test_code_version_names_this_checkout():
    tags = code_version()
    if not tags:
        pytest.skip("lungcal is not run from a git checkout of its own here")
    assert len(tags[MLFLOW_GIT_COMMIT]) == 40 and tags[TAG_CODE_DIRTY] in ("true", "false")
