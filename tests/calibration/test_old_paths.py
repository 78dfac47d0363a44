"""The calibrators moved out of ``scaling.py`` and the measures out of ``metrics.py`` (issue 44 item 5):
the old import and ``_target_`` paths still resolve, to the same objects, calibrators stored by the old
code still load, and the numbers are the old code's to the last digit.

The JSON texts below were written by the code before the move (``scaling.py`` at de7c1bc, fitted on
:data:`_Z`, :data:`_Y`), and the probabilities are what that code gave on :data:`_ZT`: a stored
calibrator is plain JSON (``cal.to_json()``, the artifact ``calibrator/<name>.json`` of a run). The
report values were computed by ``metrics.py`` at de7c1bc on :func:`_report_data`.
"""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from monai.bundle import ConfigParser

import lungcal.calibration.calibrators as calibrators
import lungcal.calibration.diagnostics as diagnostics
import lungcal.calibration.measures as measures
import lungcal.calibration.metrics as metrics
import lungcal.calibration.scaling as scaling
import lungcal.calibration.selection as selection
from lungcal.calibration.calibrators import Calibrator, TemperatureScaler, calibrator_from_json
from lungcal.calibration.prior import PriorAdjusted
from lungcal.errors import ConfigError, DataError

#: ``__all__`` of ``lungcal.calibration.scaling`` before the move
_OLD_SCALING_NAMES = [
    "CALIBRATORS", "make_calibrator", "calibrator_from_json", "select_calibrator", "fit_warnings", "no_signal",
    "probabilities", "calibrated_probs", "TemperatureScaler", "PlattScaler", "VectorScaler", "MatrixScaler",
    "HistogramBinning", "IsotonicCalibrator",
]

#: ``__all__`` of ``lungcal.calibration.metrics`` before the move
_OLD_METRICS_NAMES = [
    "ece", "mce", "adaptive_ece", "classwise_ece", "brier_score", "nll", "accuracy", "auroc", "reliability_bins",
    "calibration_slope_intercept", "oe_ratio", "calibration_report", "paired_bootstrap_diff", "ece_consistency_pvalue",
    "REPORT_METRICS", "BINARY_REPORT_METRICS",
]

_Z = np.array([[0.0, 2.0], [0.0, -1.0], [0.0, 0.5], [0.0, -2.5], [0.0, 1.5], [0.0, -0.3]])
_Y = np.array([1, 0, 0, 0, 1, 1])
_ZT = np.array([[0.0, 0.7], [0.0, -1.2], [0.3, 0.1]])

_OLD_TS = ('{"bounds": [0.01, 100.0], "fit_info": {"at_bound": false, "converged": true, "method": "newton", "n": 6, '
           '"n_events": 3}, "log_temperature": -0.36570892045308384, "method": "newton", "n_classes": 2, '
           '"name": "ts", "nll_after": 0.4087064395697381, "nll_before": 0.4248208232475219, '
           '"temperature": 0.6937046950730786}')
_OLD_PLATT = ('{"fit_info": {"at_bound": false, "converged": true, "n": 6, "n_events": 3, "separated": false}, '
              '"intercept": -0.16628307569251585, "max_iter": 100, "n_classes": 2, "name": "platt", '
              '"nll_after": 0.40694121721996096, "nll_before": 0.42482082324752185, "slope": 1.4604837461511866}')
_OLD_ISOTONIC = ('{"fit_info": {"at_bound": false, "converged": true, "n": 6, "n_events": 3}, "n_classes": 2, '
                 '"name": "isotonic", "x": [[0.11920292202211755, 0.18242552380635632, 0.37754066879814546, '
                 '0.574442516811659, 0.7310585786300049, 0.9241418199787566], [0.07585818002124356, '
                 '0.2689414213699951, 0.425557483188341, 0.6224593312018546, 0.8175744761936437, '
                 '0.8807970779778823]], "y": [[0.0, 0.0, 0.5, 0.5, 1.0, 1.0], [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]]}')
_OLD_PRIOR = ('{"base": ' + _OLD_TS + ', "estimated_by": "em", "name": "prior", "source_prior": 0.5, '
              '"target_prior": 0.2}')
_OLD_PRIOR_NO_BASE = ('{"base": null, "estimated_by": "given", "name": "prior", "source_prior": 0.4, '
                      '"target_prior": 0.1}')

#: ``predict_proba(_ZT)`` of each stored calibrator, as the old code computed it
_OLD_PROBS = {
    "ts": [[0.26716093216066045, 0.7328390678393395], [0.849392298251124, 0.1506077017488761],
           [0.5715816364819715, 0.42841836351802853]],
    "platt": [[0.2981641132504491, 0.7018358867495509], [0.8720116534949731, 0.12798834650502694],
              [0.6126297552722123, 0.3873702447277877]],
    "isotonic": [[0.3828167824485488, 0.6171832175514512], [0.9999999999989999, 9.99999999999001e-13], [0.5, 0.5]],
    "prior": [[0.5932022946483522, 0.4067977053516478], [0.9575534968474719, 0.04244650315252803],
              [0.8421883536728061, 0.15781164632719386]],
}


@pytest.mark.parametrize("name", _OLD_SCALING_NAMES)
def test_every_old_scaling_name_resolves_to_the_moved_object(name):
    moved = next(getattr(m, name) for m in (calibrators, selection, diagnostics) if hasattr(m, name))
    assert getattr(scaling, name) is moved


def test_an_old_target_path_builds_the_moved_class_and_it_fits():
    """``lungcal.calibration.scaling.TemperatureScaler`` as a bundle's ``_target_`` (docs/cifar.md ``posthoc``)."""
    parser = ConfigParser({"posthoc": {"_target_": "lungcal.calibration.scaling.TemperatureScaler"}})
    ts = parser.get_parsed_content("posthoc")
    assert type(ts) is TemperatureScaler and isinstance(ts, Calibrator)
    fitted = ts.fit(_Z, _Y)
    assert fitted.to_json() == _OLD_TS  # the same fit, to the last digit, and the same stored text


def test_the_old_dotted_paths_import():
    for path in ("lungcal.calibration.scaling.TemperatureScaler", "lungcal.calibration.scaling.calibrator_from_json",
                 "lungcal.calibration.scaling.select_calibrator", "lungcal.calibration.prior.PriorAdjusted"):
        module, _, attr = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr))


@pytest.mark.parametrize("name,text", [("ts", _OLD_TS), ("platt", _OLD_PLATT), ("isotonic", _OLD_ISOTONIC),
                                       ("prior", _OLD_PRIOR)])
def test_a_calibrator_stored_by_the_old_code_loads_with_the_same_numbers(name, text):
    for load in (calibrator_from_json, scaling.calibrator_from_json):
        cal = load(text)
        assert cal.name == name and isinstance(cal, Calibrator)
        assert np.asarray(cal.predict_proba(_ZT)).tolist() == _OLD_PROBS[name]
        assert json.loads(cal.to_json()) == json.loads(text)  # and it stores itself as before


def test_the_prior_adjustment_is_a_calibrator_loaded_by_the_one_loader():
    prior = calibrator_from_json(_OLD_PRIOR)
    assert isinstance(prior, PriorAdjusted) and isinstance(prior.base, TemperatureScaler)
    assert (prior.source_prior, prior.target_prior, prior.estimated_by) == (0.5, 0.2, "em")
    assert PriorAdjusted.from_state(json.loads(_OLD_PRIOR)).to_json() == prior.to_json()  # the old entry point
    bare = calibrator_from_json(_OLD_PRIOR_NO_BASE)
    assert bare.base is None and bare.to_json() == _OLD_PRIOR_NO_BASE
    # the base's interface: transform is the log of predict_proba, (N,) logits are the binary logit
    assert np.allclose(np.exp(prior.transform(_ZT)), _OLD_PROBS["prior"], rtol=0, atol=1e-15)
    with pytest.raises(ConfigError, match="not fitted on labels"):
        prior.fit(_Z, _Y)
    with pytest.raises(RuntimeError, match="not fitted"):
        PriorAdjusted().predict_proba(_ZT)


def test_a_stored_prior_adjustment_missing_a_field_names_it():
    state = json.loads(_OLD_PRIOR_NO_BASE)
    del state["target_prior"]
    with pytest.raises(DataError, match="lacks 'target_prior'"):
        calibrator_from_json(json.dumps(state))
    with pytest.raises(DataError, match="known names"):
        calibrator_from_json('{"name": "nope"}')


@pytest.mark.parametrize("name", _OLD_METRICS_NAMES + ["LOGIT_EPS"])
def test_every_old_metrics_name_resolves_to_the_moved_object(name):
    assert getattr(metrics, name) is getattr(measures, name)


def test_an_old_metrics_target_path_resolves():
    parser = ConfigParser({"m": {"_target_": "lungcal.calibration.metrics.ece", "_mode_": "callable"}})
    assert parser.get_parsed_content("m") is measures.ece


def _report_data():
    rng = np.random.default_rng(7)
    p = rng.dirichlet([1.0, 1.0], size=120)
    y = (rng.random(120) < p[:, 1]).astype(int)
    return p, y, rng.dirichlet([1.0, 1.0], size=120)


def test_the_report_the_tests_and_the_bootstrap_give_the_old_numbers():
    p, y, q = _report_data()
    report = measures.calibration_report(p, y, n_bins=10, n_bootstrap=40, seed=1)
    # the calibration slope is an iterative logistic fit, whose last bit varies with the BLAS's summation
    # order between machines (1.7336094385554404 or ...406 on the same code): equal to 1e-12, not bit for bit
    assert {k: report[k] for k in ("ece", "ece_ci_low", "ece_ci_high", "classwise_ece_ci_high", "auc_ci_low",
                                   "cal_slope_ci_high", "adaptive_ece_ci_low")} == pytest.approx({
        "ece": 0.060719054329033094, "ece_ci_low": 0.03357159481775918, "ece_ci_high": 0.1399427099574887,
        "classwise_ece_ci_high": 0.16569203140866562, "auc_ci_low": 0.8157265907196444,
        "cal_slope_ci_high": 1.7336094385554406, "adaptive_ece_ci_low": 0.07491941959257037}, rel=1e-12, abs=0)
    diff = measures.paired_bootstrap_diff("ece", p, q, y, n_bootstrap=40, seed=1, n_bins=10)
    assert (diff["diff"], diff["ci_low"], diff["ci_high"], diff["p_value"]) == (
        -0.24375333242449845, -0.30876256414956493, -0.13851983697302672, 0.04878048780487805)
    assert measures.ece_consistency_pvalue(p, y, n_bins=10, n_resamples=200, seed=3) == (
        0.06071905432903308, 0.5621890547263682)
