"""``lungcal compare A B``: the paired bootstrap of two runs' predictions on the same cases."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from lungcal.calibration import paired_bootstrap_diff
from lungcal.cli import main
from lungcal.errors import DataError
from lungcal.study.differences import compare_predictions, read_predictions
from lungcal.tracking import RunTracker, default_tracking_uri


def _write(path, subjects, labels, probs):
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["subject", "label", "probability"])
        w.writerows(zip(subjects, labels, probs))
    return path


@pytest.fixture
def two_models(tmp_path):
    """Two CT models' test predictions of 300 cases, A calibrated, B not; B's file lists them in another order."""
    rng = np.random.default_rng(0)
    pa = rng.uniform(0.05, 0.6, 300)
    y = (rng.random(300) < pa).astype(int)  # A is calibrated
    pb = pa + 0.3  # B over-estimates every risk by 0.3
    subjects = [f"s{i:03d}" for i in range(300)]
    order = rng.permutation(300)
    a = _write(tmp_path / "a.csv", subjects, y, pa)
    b = _write(tmp_path / "b.csv", [subjects[i] for i in order], y[order], pb[order])
    return a, b, y, pa, pb


def test_compare_is_the_paired_bootstrap_of_the_aligned_cases(two_models):
    a, b, y, pa, pb = two_models
    res = compare_predictions(read_predictions(a), read_predictions(b), ("auc", "ece"), n_bootstrap=300)
    assert res["n"] == 300 and res["n_bins"] == 10  # binary CT predictions: the study's 10 bins
    for metric in ("auc", "ece"):
        want = paired_bootstrap_diff(metric, pa, pb, y, n_bootstrap=300, seed=0, n_bins=10)
        assert res["diffs"][metric]["diff"] == pytest.approx(want["diff"])
        assert res["diffs"][metric]["ci_low"] == pytest.approx(want["ci_low"])
    assert res["diffs"]["ece"]["diff"] < 0 and res["diffs"]["ece"]["significant"]  # B is miscalibrated


def test_compare_refuses_other_cases_or_labels(two_models, tmp_path):
    a, _, y, pa, pb = two_models
    subjects = [f"s{i:03d}" for i in range(300)]
    fewer = read_predictions(_write(tmp_path / "c.csv", subjects[:200], y[:200], pb[:200]))
    with pytest.raises(DataError, match="do not hold the same cases"):
        compare_predictions(read_predictions(a), fewer)
    flipped = read_predictions(_write(tmp_path / "d.csv", subjects, 1 - y, pb))
    with pytest.raises(DataError, match="disagree on 300 labels"):
        compare_predictions(read_predictions(a), flipped)


def test_cli_compares_files_and_runs(two_models, tmp_path, capsys):
    a, b, *_ = two_models
    assert main(["compare", str(a), str(b), "--n-bootstrap", "200", "--metrics", "ece", "brier"]) == 0
    out = capsys.readouterr().out
    assert "300 cases, 10 ECE bins" in out and out.count("A - B = ") == 2 and "brier: A - B" in out
    uri = default_tracking_uri(tmp_path)
    with RunTracker("nlst", "model-a", tracking_uri=uri) as tr:
        (tmp_path / "pred").mkdir()
        (tmp_path / "pred" / "test_predictions.csv").write_text(a.read_text())
        tr.log_artifact(tmp_path / "pred" / "test_predictions.csv", "predictions")
    assert main(["compare", tr.run_id, str(b), "--tracking-uri", uri, "--n-bootstrap", "200"]) == 0
    assert "auc: A - B = " in capsys.readouterr().out
    assert main(["compare", tr.run_id, str(b), "--tracking-uri", uri, "--split", "val"]) == 2
    assert f"run {tr.run_id} logged no predictions/val_predictions.npz or .csv" in capsys.readouterr().err
    assert main(["compare", "no-such-run", str(b), "--tracking-uri", uri]) == 2
    assert "neither a predictions file nor a run" in capsys.readouterr().err
