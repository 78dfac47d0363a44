"""Post-hoc fixes of a long-tailed classifier side by side: one temperature, the label prior, per-class scaling.

A model trained on a long-tailed class prior and tested on balanced classes is miscalibrated in two
ways: a *scale* error that one temperature can fix (over- or under-confidence everywhere), and a
*prior* error, a per-class bias toward the head classes, that no single temperature can. TS picks
the temperature that minimises validation NLL; where both errors are present, that temperature
trades one against the other. :func:`posthoc_probs` fits every fix of :data:`POSTHOC_METHODS` on
validation logits and applies it to test logits:

- ``none``: the model as trained;
- ``ts``: temperature scaling (the NLL-optimal T);
- ``ts-ece``: the single temperature with the lowest *validation* ECE (:func:`ece_optimal_temperature`),
  the most any one temperature can do for ECE;
- ``prior``: logit adjustment for the label shift, ``z - log(pi_train)`` (Menon et al. 2021), with
  ``pi_train`` the training class counts and a uniform test prior; nothing fitted;
- ``prior+ts``: that adjustment, then TS;
- ``vector``: vector scaling (a scale and a bias per class).

References:
    Menon, Jayasumana, Rawat, Jain, Veit, Kumar. "Long-tail learning via logit adjustment." ICLR 2021.
    https://arxiv.org/abs/2007.07314
    Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks." ICML 2017.
"""
from __future__ import annotations

import numpy as np

from lungcal.calibration.calibrators import TemperatureScaler, make_calibrator, probabilities
from lungcal.calibration.measures import ece
from lungcal.errors import DataError

__all__ = ["POSTHOC_METHODS", "ece_optimal_temperature", "adjust_logits_to_prior", "posthoc_probs"]

POSTHOC_METHODS = ("none", "ts", "ts-ece", "prior", "prior+ts", "vector")


def ece_optimal_temperature(logits, labels, n_bins: int = 15, grid=None) -> float:
    """The temperature on ``grid`` with the lowest ECE of ``softmax(logits / T)``.

    The default grid spans TS's own bounds, [0.01, 100], with 481 log-spaced values (120 per
    decade: neighbours 2% apart).
    """
    z = np.asarray(logits, np.float64)
    grid = np.geomspace(0.01, 100.0, 481) if grid is None else np.asarray(grid, np.float64)
    scores = [ece(probabilities(z, t), labels, n_bins=n_bins) for t in grid]
    return float(grid[int(np.argmin(scores))])


def adjust_logits_to_prior(logits, class_counts) -> np.ndarray:
    """``logits - log(pi_train)``: the logit adjustment from the training prior to a uniform one."""
    z = np.asarray(logits, np.float64)
    counts = np.asarray(class_counts, np.float64)
    if counts.ndim != 1 or z.ndim != 2 or counts.shape[0] != z.shape[1] or (counts <= 0).any():
        raise DataError(f"class_counts must hold one positive count per class ({z.shape[-1]}), "
                        f"got {counts.tolist()}", field="class_counts",
                        fix="pass the training set's number of cases of each class")
    return z - np.log(counts / counts.sum())


def posthoc_probs(val_logits, val_labels, test_logits, class_counts,
                  n_bins: int = 15) -> dict[str, tuple[np.ndarray, dict[str, float]]]:
    """``{method: (test probabilities (N, C) float64, fitted values)}`` for every :data:`POSTHOC_METHODS`.

    Everything is fitted on the validation logits; the test logits are only transformed. The
    fitted values are ``{"T": temperature}`` for the temperature methods, ``{}`` otherwise.
    """
    zv, zt = np.asarray(val_logits, np.float64), np.asarray(test_logits, np.float64)
    yv = np.asarray(val_labels, np.int64)
    av, at = adjust_logits_to_prior(zv, class_counts), adjust_logits_to_prior(zt, class_counts)
    t_nll = float(TemperatureScaler().fit(zv, yv).temperature)
    t_ece = ece_optimal_temperature(zv, yv, n_bins=n_bins)
    t_prior = float(TemperatureScaler().fit(av, yv).temperature)
    vector = make_calibrator("vector").fit(zv, yv)
    return {
        "none": (probabilities(zt), {}),
        "ts": (probabilities(zt, t_nll), {"T": t_nll}),
        "ts-ece": (probabilities(zt, t_ece), {"T": t_ece}),
        "prior": (probabilities(at), {}),
        "prior+ts": (probabilities(at, t_prior), {"T": t_prior}),
        "vector": (np.asarray(vector.predict_proba(zt), np.float64), {}),
    }
