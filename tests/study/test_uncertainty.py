"""``lungcal uncertainty``: the comparison table of single model, MC dropout and ensemble, with and without TS."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.calibration import aurc, paired_bootstrap_diff
from lungcal.calibration.scaling import probabilities
from lungcal.cli import main
from lungcal.ctapp.evaluate.reports import evaluate_probs
from lungcal.study.uncertainty import comparison_table, score_models
from tests.ctapp.test_predict_uncertainty import _loader, _model


@pytest.fixture(scope="module")
def scored():
    """Three small MIL members with dropout, scored on 40 bags; MC dropout of member 0 with 5 passes."""
    nets = [_model(seed=s) for s in range(3)]
    return score_models(nets, _loader(n=40), None, mc_samples=5, seed=0)


def test_score_models_holds_each_method_on_the_same_cases(scored):
    assert len(scored["secs"]) == 3 and scored["mc_samples"] == 5
    np.testing.assert_allclose(scored["ensemble"]["probs"], np.mean(scored["member_probs"], 0))
    assert np.array_equal(scored["single"]["probs"], scored["member_probs"][0])
    assert scored["mc"]["mi"].min() >= 0 and scored["mc"]["mi"].max() > 0  # dropout passes disagree


def test_the_table_is_evaluate_probs_of_each_method(scored):
    y = np.arange(40) % 2
    temps = {"single": 0.5, "mc": 2.0, "ensemble": 1.0}
    lines, reports = comparison_table(scored, y, temps, "title", n_bins=10, n_bootstrap=50)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| method")]
    names = [r.split(" | ")[0][2:] for r in rows]
    assert names == ["single (member 0)", "single+TS (T=0.50)", "MC dropout (T=5 passes)", "MC dropout+TS (T=2.00)",
                     "ensemble of 3", "ensemble+TS (T=1.00)"]
    p_ts = probabilities(scored["single"]["logits"], 0.5)
    want = evaluate_probs(p_ts, y, n_bins=10, n_bootstrap=50)
    assert reports["single+TS (T=0.50)"]["ece"] == pytest.approx(want["ece"])
    cells = rows[1].split(" | ")
    assert cells[1].startswith(f"{want['ece']:.3f} [") and cells[5] == f"{aurc(p_ts, y):.3f}"
    d = paired_bootstrap_diff("ece", p_ts, scored["single"]["probs"], y, n_bootstrap=50, n_bins=10)
    assert cells[8] == f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
    assert rows[0].split(" | ")[7] == "-" and rows[0].split(" | ")[8] == "-"  # no MI, no difference to itself
    assert reports["ensemble+TS (T=1.00)"]["ece"] == pytest.approx(reports["ensemble of 3"]["ece"])  # T = 1


def test_cli_refuses_a_bad_override(capsys):
    assert main(["uncertainty", "--parent-run", "x", "--set", "epochs"]) == 2
    assert "--set 'epochs' is not KEY=JSON" in capsys.readouterr().err
    assert main(["uncertainty", "--parent-run", "x", "--mc-samples", "0"]) == 2
    assert "mc_samples must be at least 1" in capsys.readouterr().err
