"""Decision curve analysis: net benefit by hand, treat-all, and the plot."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.calibration.measures import decision_curve, net_benefit
from lungcal.calibration.plots import decision_curve_plot
from lungcal.errors import DataError

P = np.array([0.9, 0.6, 0.3, 0.2, 0.05])
Y = np.array([1, 0, 1, 0, 0])


def test_net_benefit_counts_true_positives_and_charges_false_positives_at_the_thresholds_odds():
    # t 0.1: TP 2, FP 2 of 5 -> 0.4 - 0.4 / 9; t 0.25: TP 2, FP 1 -> 0.4 - 0.2 / 3; t 0.5: TP 1, FP 1 -> 0
    np.testing.assert_allclose(net_benefit(P, Y, [0.1, 0.25, 0.5]), [0.4 - 0.4 / 9, 0.4 - 0.2 / 3, 0.0])
    # (N, 2) probabilities are read as [1 - p, p]; a case at exactly the threshold is positive
    np.testing.assert_allclose(net_benefit(np.stack([1 - P, P], 1), Y, [0.3]), [0.4 - 0.2 * 0.3 / 0.7])


def test_treat_all_treat_none_and_where_the_model_is_useful():
    c = decision_curve(P, Y, [0.1, 0.25, 0.5])
    np.testing.assert_allclose(c.treat_all, [0.4 - 0.6 / 9, 0.4 - 0.2, 0.4 - 0.6])
    assert c.prevalence == pytest.approx(0.4) and c.n == 5 and not c.treat_none.any()
    assert c.useful().tolist() == [True, True, False]
    assert c.at(0.26) == {"threshold": 0.25, "model": pytest.approx(0.4 - 0.2 / 3),
                          "treat_all": pytest.approx(0.2), "treat_none": 0.0}
    assert set(c.as_dict()) == {"thresholds", "model", "treat_all", "treat_none", "prevalence", "n"}
    # a perfect model's net benefit is the prevalence at every threshold
    perfect = decision_curve(Y.astype(float), Y)
    np.testing.assert_allclose(perfect.model, 0.4)
    with pytest.raises(DataError, match="strictly between 0 and 1"):
        decision_curve(P, Y, [0.0, 0.5])


def test_the_decision_curve_plot_marks_a_threshold(tmp_path):
    fig = decision_curve_plot(P, Y, mark=0.2, title="site", path=tmp_path / "dc.png")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels[0] == "model" and labels[1].startswith("treat all") and "threshold 0.20" in labels[-1]
    assert (tmp_path / "dc.png").stat().st_size > 0
