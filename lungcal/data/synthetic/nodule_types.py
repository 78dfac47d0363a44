"""Nodule types of the synthetic cohort: solid, part-solid and ground-glass nodules, and large masses.

Screening finds many cancers as *subsolid* nodules: ground glass (a faint haze of -800 to -300 HU
that does not hide the vessels) with a solid core (part-solid) or without one (pure ground glass).
The cohort's classic nodule model (:mod:`.nodules`) renders solid and calcified nodules, and its
"part-solid" nodules always as -480 HU ground glass around a core of half the diameter. A
*nodule-type mix* (``make_cohort(nodule_types=...)``, ``lungcal synth --nodule-types``) replaces
that attenuation feature by a drawn type; ``make_cohort``'s default, ``"classic"``, is the model as it
was, so every cohort made before keeps its images, labels and splits bit for bit. The demo preset
(``DEMO_DEFAULTS``, the headline's data) draws ``"screening"`` with masses in 15 % of its cancers.

What a typed mix draws, per nodule, from the CT's own generator ``default_rng([seed, index, 10])``
(so the patient, the nodules' sizes, margins and places, the anatomy and the noise stay those of
the classic cohort of the same seed: the two are paired, CT for CT):

* **type** given the nodule's class, from :data:`NODULE_TYPE_MIXES` (``"screening"``: benign
  80 % solid / 5 % part-solid / 15 % ground glass, malignant 62 / 26 / 12 %, about the shares of
  baseline screening nodules and screen-detected cancers in ELCAP and NLST reports, rounded;
  ``"even"``: a third each in both classes, for detector measurements only);
* **ground-glass density** ``U(-800, -300)`` HU for part-solid and ground-glass nodules (the same
  law in both classes: density alone says nothing);
* **solid core** of a part-solid nodule, as a fraction ``f`` of its diameter in ``[0.1, 0.6]``:
  benign ``U(0.1, 0.6)``, malignant half uniform, half triangular rising to 0.6, so the likelihood
  ratio is ``0.5 + 2 (f - 0.1)`` (0.5 to 1.5): as in Lung-RADS, a larger solid component is more
  suspicious;
* a solid-type nodule keeps the classic model's calcification (drawn by the classic model; a
  classic "part-solid" draw renders solid), a subsolid one shows none.

Sizes (diameter, log-normal 4-30 mm) and margins are the classic model's. The Bayes posterior
stays exact: :func:`type_likelihood_ratio` is the extra factor each nodule's likelihood ratio
gets (the type's, the calcification's when solid, the core's when part-solid).

**Masses** (``make_cohort(masses=p)``; ``make_cohort``'s default 0, the demo preset's 0.15): with
probability ``p`` the malignant nodule of a positive CT becomes a solid lobulated mass of 30-60 mm
(uniform) that abuts the mediastinum or the costal pleura (one or the other, even odds; drawn from
``default_rng([seed, index, 11])``): on the row through the lung's mid depth, at a height within
a quarter of the lung's height of its centre, its centre sits ``0.8 r`` inside the lung mask's
medial edge (the mediastinum, or the heart where it indents the lung) or lateral edge (the costal
pleura), so a fifth of its radius lies over the mediastinum or the chest wall (clamped to the row
when the lung is narrower than the mass). No benign lesion is that large,
so a CT with a mass has Bayes posterior 1. A mass is recorded with ``nodule_type`` solid and
``contact`` ``"mediastinum"`` or ``"pleura"``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lungcal.errors import ConfigError

from .nodules import ATTENUATIONS, NODULE_MODEL, likelihood_ratio

__all__ = ["NODULE_TYPES", "NODULE_TYPE_MIXES", "CONTACTS", "resolve_type_mix", "draw_types",
           "type_likelihood_ratio", "typed_bayes_posterior", "nodule_type_of", "draw_mass"]

NODULE_TYPES = ("solid", "part-solid", "ground-glass")
CONTACTS = ("mediastinum", "pleura")
#: per class, P(solid, part-solid, ground-glass); "classic" (None) keeps the classic attenuation model
NODULE_TYPE_MIXES: dict[str, dict[str, tuple[float, float, float]] | None] = {
    "classic": None,
    "screening": {"benign": (0.80, 0.05, 0.15), "malignant": (0.62, 0.26, 0.12)},
    "even": {"benign": (1 / 3, 1 / 3, 1 / 3), "malignant": (1 / 3, 1 / 3, 1 / 3)},
}
GG_HU = (-800.0, -300.0)  #: ground-glass density range (uniform)
CORE_FRAC = (0.1, 0.6)  #: solid core of a part-solid nodule, fraction of the diameter
MASS_MM = (30.0, 60.0)  #: mass diameter range (uniform)
_CALCIFIED = ATTENUATIONS.index("calcified")


def resolve_type_mix(name: str | None) -> str:
    """The mix's name (None: ``"classic"``), checked against :data:`NODULE_TYPE_MIXES`."""
    name = "classic" if name is None else str(name)
    if name not in NODULE_TYPE_MIXES:
        raise ConfigError(f"unknown nodule-type mix {name!r}", field="nodule_types",
                          fix=f"use one of {sorted(NODULE_TYPE_MIXES)}")
    return name


def draw_types(rng: np.random.Generator, mix: str, malignant: Sequence[bool]) -> list[dict[str, Any]]:
    """Each nodule's ``{"type", "gg_hu", "core_frac"}`` under the typed mix ``mix``, in order.

    Every nodule takes the same number of draws (type, density, core, core shape), so a nodule's
    type does not depend on how many came before it changed type.
    """
    probs = NODULE_TYPE_MIXES[mix]
    assert probs is not None, "the classic mix draws no types"
    out = []
    for mal in malignant:
        u = rng.random(4)
        t = int(np.searchsorted(np.cumsum(probs["malignant" if mal else "benign"]), u[0], side="right"))
        t = min(t, 2)
        gg = GG_HU[0] + u[1] * (GG_HU[1] - GG_HU[0])
        lo, hi = CORE_FRAC
        if mal and u[3] < 0.5:  # triangular on [lo, hi] with its mode at hi, by inversion
            core = lo + (hi - lo) * float(np.sqrt(u[2]))
        else:
            core = lo + (hi - lo) * float(u[2])
        kind = NODULE_TYPES[t]
        out.append({"type": kind, "gg_hu": None if kind == "solid" else float(gg),
                    "core_frac": float(core) if kind == "part-solid" else (0.0 if kind == "ground-glass" else None)})
    return out


def type_likelihood_ratio(mix: str, kind: str, calcified: bool, core_frac: float | None) -> float:
    """The factor a typed nodule adds to its classic likelihood ratio (size and margin), replacing
    the classic attenuation's: ``P_malignant / P_benign`` of its type, of its calcification when it
    is solid, and of its core fraction when it is part-solid."""
    probs = NODULE_TYPE_MIXES[mix]
    assert probs is not None
    t = NODULE_TYPES.index(kind)
    r = probs["malignant"][t] / probs["benign"][t]
    if kind == "solid":
        pm, pb = NODULE_MODEL["malignant"]["attenuation"][_CALCIFIED], NODULE_MODEL["benign"]["attenuation"][_CALCIFIED]
        r *= pm / pb if calcified else (1 - pm) / (1 - pb)
    elif kind == "part-solid":
        assert core_frac is not None
        r *= 0.5 + (core_frac - CORE_FRAC[0]) / (CORE_FRAC[1] - CORE_FRAC[0])  # (1 + 4 (f - lo)) / 2 on [0.1, 0.6]
    return float(r)


def nodule_type_of(attenuation: str) -> str:
    """The type a nodule of the classic model shows: its part-solid nodules are part-solid (a core of
    half the diameter in -480 HU ground glass), solid and calcified ones solid."""
    return "part-solid" if attenuation == "part-solid" else ("ground-glass" if attenuation == "ground-glass"
                                                              else "solid")


def draw_mass(rng: np.random.Generator, anat: dict, lungs: tuple[np.ndarray, np.ndarray],
              spacing: Sequence[float] | np.ndarray,
              origin: Sequence[float] | np.ndarray) -> tuple[tuple[float, float, float], float, str]:
    """A mass's ``(centre LPS mm, diameter mm, contact)`` against the mediastinum or the pleura of one
    lung (see the module docstring).

    ``anat`` is the CT's anatomy (:func:`.phantom.sample_anatomy`), ``lungs`` its right and left lung
    masks (:func:`.phantom.lung_masks`) on the grid ``spacing`` / ``origin``: the mass's row (the
    lung's mid depth, at the drawn height) is read from them, so the heart's indent is the medial
    edge where it reaches that row.
    """
    u = rng.random(4)
    d = MASS_MM[0] + u[0] * (MASS_MM[1] - MASS_MM[0])
    s = int(u[1] >= 0.5)  # 0: right lung (LPS x < 0), 1: left
    contact = CONTACTS[int(u[2] < 0.5)]
    r = d / 2
    sp, org = np.asarray(spacing, float), np.asarray(origin, float)
    lung = lungs[s]
    jy = int(np.clip(round((anat["lung_cy"] - org[1]) / sp[1]), 0, lung.shape[1] - 1))
    z = anat["lung_cz"] + (u[3] - 0.5) * 0.5 * anat["lung_c"]
    kz = int(np.clip(round((z - org[2]) / sp[2]), 0, lung.shape[2] - 1))
    xs = org[0] + np.flatnonzero(lung[:, jy, kz]) * sp[0]
    if xs.size == 0:  # no lung on that row (a tiny field of view): the lung's nominal centre
        xs = np.asarray([(2 * s - 1) * anat["lung_dx"]])
    medial, lateral = (xs.max(), xs.min()) if s == 0 else (xs.min(), xs.max())
    inward = 1.0 if lateral < medial else -1.0  # from the lateral edge towards the medial one
    x = medial - inward * 0.8 * r if contact == "mediastinum" else lateral + inward * 0.8 * r
    lo, hi = float(xs.min()), float(xs.max())
    x = float(np.clip(x, lo, hi)) if hi > lo else lo
    return (x, float(org[1] + jy * sp[1]), float(org[2] + kz * sp[2])), float(d), contact


def typed_bayes_posterior(diameters, margins, attenuations, types: Sequence[dict[str, Any]] | None, mix: str,
                          prevalence: float, has_mass: bool = False) -> float:
    """Exact ``P(y=1 | every nodule's visible features)`` of one CT of a typed mix and/or with masses.

    A mass makes it 1 (no benign lesion is that large). Otherwise each nodule's classic likelihood
    ratio (:func:`.nodules.likelihood_ratio`) has its attenuation factor replaced by
    :func:`type_likelihood_ratio` (``types`` None: the classic model, unchanged).
    """
    if has_mass:
        return 1.0
    d = np.asarray(diameters, float)
    if d.size == 0:
        return 0.0
    a = np.asarray(attenuations, int)
    lr = likelihood_ratio(d, np.asarray(margins, int), a)
    if types is not None:
        att_m = np.asarray(NODULE_MODEL["malignant"]["attenuation"])
        att_b = np.asarray(NODULE_MODEL["benign"]["attenuation"])
        lr = lr / (att_m[a] / att_b[a]) * np.asarray(
            [type_likelihood_ratio(mix, t["type"], bool(ai == _CALCIFIED), t["core_frac"]) for t, ai in zip(types, a)])
    odds = prevalence / (1 - prevalence) * lr.sum() / NODULE_MODEL["lam"]
    return float(odds / (1 + odds))
