"""The nodule model of the synthetic cohort, exact so that its Bayes limit is known.

A CT's label ``y ~ Bernoulli(prevalence)``. A negative CT has ``n ~ Poisson(lam)`` benign
nodules; a positive CT has one malignant nodule plus ``Poisson(lam)`` benign ones. Each nodule
has three independent features whose distribution depends on its class (:data:`NODULE_MODEL`):
diameter (log-normal, 4-30 mm), margin (smooth / lobulated / spiculated) and attenuation
(solid / part-solid / calcified). The classes overlap, so the best possible classifier that sees
every nodule's exact features has the posterior ``P(y=1 | x) = odds / (1 + odds)``,
``odds = prevalence / (1 - prevalence) * (1/lam) * sum_j r(x_j)`` with
``r = f_malignant / f_benign`` (derivation: the malignant nodule sits at a uniformly random
position among the ``n`` nodules). :func:`bayes_auc` simulates that model and reports the AUC of
this posterior: about 0.87, independent of the prevalence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import norm

from lungcal.calibration.metrics import auroc

__all__ = [
    "MARGINS",
    "ATTENUATIONS",
    "NODULE_MODEL",
    "sample_nodule_features",
    "likelihood_ratio",
    "bayes_posterior",
    "bayes_auc",
    "Nodule",
]

MARGINS = ("smooth", "lobulated", "spiculated")
ATTENUATIONS = ("solid", "part-solid", "calcified")

#: class-conditional feature distributions: diameter ~ clip(exp(N(log median, sigma)), 4, 30) mm
NODULE_MODEL: dict[str, Any] = {
    "lam": 1.2,  # mean number of benign nodules per CT
    "benign": {"median_mm": 6.5, "sigma": 0.45, "margin": (0.62, 0.30, 0.08),
               "attenuation": (0.78, 0.08, 0.14)},
    "malignant": {"median_mm": 11.0, "sigma": 0.50, "margin": (0.30, 0.40, 0.30),
                  "attenuation": (0.70, 0.28, 0.02)},
}
_D_MIN, _D_MAX = 4.0, 30.0


def sample_nodule_features(rng: np.random.Generator, malignant: bool, n: int = 1):
    """Draw ``n`` nodules' (diameter_mm, margin index, attenuation index) for one class."""
    p = NODULE_MODEL["malignant" if malignant else "benign"]
    lo, hi = math.log(_D_MIN), math.log(_D_MAX)
    d = np.empty(n)
    todo = np.arange(n)
    while todo.size:  # truncated log-normal by rejection (acceptance > 95 %)
        x = rng.normal(math.log(p["median_mm"]), p["sigma"], todo.size)
        ok = (x >= lo) & (x <= hi)
        d[todo[ok]] = np.exp(x[ok])
        todo = todo[~ok]
    margin = rng.choice(3, size=n, p=p["margin"])
    att = rng.choice(3, size=n, p=p["attenuation"])
    return d, margin, att


def likelihood_ratio(d: np.ndarray, margin: np.ndarray, att: np.ndarray) -> np.ndarray:
    """``f_malignant(x) / f_benign(x)`` of each nodule (diameters in mm, margin/attenuation indices)."""
    b, m = NODULE_MODEL["benign"], NODULE_MODEL["malignant"]
    r = _diameter_pdf(d, m["median_mm"], m["sigma"]) / _diameter_pdf(d, b["median_mm"], b["sigma"])
    r = r * np.asarray(m["margin"])[margin] / np.asarray(b["margin"])[margin]
    return r * np.asarray(m["attenuation"])[att] / np.asarray(b["attenuation"])[att]


def bayes_posterior(diameters, margins, attenuations, prevalence: float) -> float:
    """Exact ``P(y=1 | all nodules' features)`` of one CT under :data:`NODULE_MODEL`."""
    d = np.asarray(diameters, float)
    if d.size == 0:
        return 0.0
    lr = likelihood_ratio(d, np.asarray(margins, int), np.asarray(attenuations, int)).sum() / NODULE_MODEL["lam"]
    odds = prevalence / (1 - prevalence) * lr
    return float(odds / (1 + odds))


def bayes_auc(n: int = 200_000, prevalence: float = 0.11, seed: int = 12345) -> float:
    """AUC of the Bayes-optimal CT-level posterior over ``n`` simulated CTs (features only).

    This is the ceiling for any model that sees the nodules perfectly; the synthetic cohort is
    tuned so it is about 0.87 (it does not depend on the prevalence).
    """
    rng = np.random.default_rng(seed)
    y = rng.random(n) < prevalence
    nb = rng.poisson(NODULE_MODEL["lam"], n)
    nm = y.astype(int)
    # flatten all nodules, tag with their CT
    ct_b = np.repeat(np.arange(n), nb)
    ct_m = np.repeat(np.arange(n), nm)
    db, mb, ab = sample_nodule_features(rng, False, ct_b.size)
    dm, mm, am = sample_nodule_features(rng, True, ct_m.size)
    lr = np.concatenate([likelihood_ratio(db, mb, ab), likelihood_ratio(dm, mm, am)])
    ct = np.concatenate([ct_b, ct_m])
    score = np.bincount(ct, weights=lr, minlength=n) / NODULE_MODEL["lam"]
    odds = prevalence / (1 - prevalence) * score
    return auroc(odds / (1 + odds), y.astype(int))


def _diameter_pdf(d: np.ndarray, median: float, sigma: float) -> np.ndarray:
    # log-normal truncated to [4, 30] mm
    z = (np.log(d) - math.log(median)) / sigma
    mass = (norm.cdf((math.log(_D_MAX) - math.log(median)) / sigma)
            - norm.cdf((math.log(_D_MIN) - math.log(median)) / sigma))
    return norm.pdf(z) / (sigma * d * mass)


@dataclass
class Nodule:
    """One planted nodule (centre in LPS world mm).

    ``nodule_type``, ``gg_hu``, ``core_frac`` and ``contact`` are set by a nodule-type mix or a mass
    (:mod:`.nodule_types`); the classic model leaves them None (its nodules render as they always
    did) and its type follows from ``attenuation``.
    """

    center_lps: tuple[float, float, float]
    diameter_mm: float
    malignant: bool
    margin: str
    attenuation: str
    nodule_type: str | None = None  #: solid, part-solid or ground-glass
    gg_hu: float | None = None  #: ground-glass density (HU) of a subsolid nodule of a typed mix
    core_frac: float | None = None  #: solid core diameter / diameter (0: pure ground glass)
    contact: str | None = None  #: a mass's contact: mediastinum or pleura
