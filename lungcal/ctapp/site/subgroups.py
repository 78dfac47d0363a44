"""Performance at a site's threshold by subgroup: scanner, nodule type, nodule size band.

A threshold certified on a whole site can still miss one kind of cancer more than another: the faint
part-solid nodules, the small ones, the CTs of one scanner. For each subgroup of a labelled split this reports,
at the threshold, with 95 % CIs:

- the **work-up rate** (CTs at or above the threshold; Clopper-Pearson);
- the **sensitivity** (cancers at or above it; Clopper-Pearson over the group's cancers);
- the **O/E** ratio of the calibrated probabilities (``sum(y) / sum(p)``; a percentile bootstrap over the group's
  CTs).

The groups come from the datalist rows: the scanner is the row's ``scanner``, else its ``acquisition``
``profile`` or ``manufacturer`` (the synthetic cohorts and ``lungcal import-site`` write them); the nodule's type
and size are the row's ``nodule_type`` and ``nodule_mm`` where a site's CSV gave them, else the CT's largest
malignant nodule (a cancer) or largest nodule (no cancer) in an ``annotations.csv`` beside the datalist (the
synthetic cohorts write one). A CT with neither is ``unknown``. Groups are small: read the CIs, not the points.
"""
from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binomtest

__all__ = ["SIZE_BANDS", "clopper_pearson", "oe_bootstrap_ci", "ct_groups", "subgroup_rows", "subgroup_text"]

#: nodule size bands (diameter, mm): Lung-RADS-like cut points, masses apart
SIZE_BANDS = ((0.0, 6.0, "<6 mm"), (6.0, 10.0, "6-10 mm"), (10.0, 20.0, "10-20 mm"), (20.0, 30.0, "20-30 mm"),
              (30.0, math.inf, ">=30 mm"))
UNKNOWN = "unknown"


def size_band(d: float | None) -> str:
    """The :data:`SIZE_BANDS` label of a diameter (``unknown`` for None or NaN)."""
    if d is None or not math.isfinite(d):
        return UNKNOWN
    return next(label for lo, hi, label in SIZE_BANDS if lo <= d < hi)


def _annotations(datalist: Path | None) -> dict[str, list[dict[str, str]]]:
    """The nodules of each CT (by ``ct``, and by ``subject``) in an ``annotations.csv`` beside ``datalist``."""
    if datalist is None or not (Path(datalist).parent / "annotations.csv").is_file():
        return {}
    out: dict[str, list[dict[str, str]]] = defaultdict(list)
    with open(Path(datalist).parent / "annotations.csv", newline="") as fh:
        for r in csv.DictReader(fh):
            for key in {r.get("ct"), r.get("subject")} - {None, ""}:
                out[str(key)].append(r)
    return out


def _scanner(row: Mapping[str, Any]) -> str:
    acq = row.get("acquisition") or {}
    for v in (row.get("scanner"), acq.get("profile"), acq.get("manufacturer")):
        if v:
            return str(v)
    return UNKNOWN


def _nodule(row: Mapping[str, Any], nodules: Sequence[Mapping[str, str]]) -> tuple[str, str]:
    if row.get("nodule_type") or row.get("nodule_mm") is not None:
        mm = row.get("nodule_mm")
        return str(row.get("nodule_type") or UNKNOWN), size_band(None if mm is None else float(mm))
    if not nodules:
        return UNKNOWN, UNKNOWN
    cancer = int(row.get("label", 0)) == 1
    pool = [n for n in nodules if str(n.get("malignant", "")) == "1"] if cancer else list(nodules)
    pool = pool or list(nodules)
    n = max(pool, key=lambda x: float(x.get("diameter_mm") or 0.0))
    kind = n.get("nodule_type") or n.get("attenuation") or UNKNOWN
    return str(kind), size_band(float(n["diameter_mm"]) if n.get("diameter_mm") else None)


def ct_groups(rows: Sequence[Mapping[str, Any]], datalist: Path | None = None) -> dict[str, list[str]]:
    """Each row's ``scanner``, ``nodule type`` and ``nodule size`` group (module doc), in row order."""
    ann = _annotations(datalist)
    out: dict[str, list[str]] = {"scanner": [], "nodule type": [], "nodule size": []}
    for r in rows:
        nodules = ann.get(str(r.get("ct") or ""), []) or ann.get(str(r.get("subject") or ""), [])
        kind, band = _nodule(r, nodules)
        out["scanner"].append(_scanner(r))
        out["nodule type"].append(kind)
        out["nodule size"].append(band)
    return out


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """The exact (Clopper-Pearson) 95 % CI of ``k`` of ``n``; NaN for ``n = 0``."""
    if n == 0:
        return math.nan, math.nan
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return float(ci.low), float(ci.high)


def oe_bootstrap_ci(p: np.ndarray, y: np.ndarray, n_bootstrap: int, rng: np.random.Generator) -> tuple[float, float]:
    """The 95 % percentile-bootstrap CI of O/E (``sum(y) / sum(p)``) over the CTs; NaN under 2 CTs."""
    if len(y) < 2 or n_bootstrap < 1:
        return math.nan, math.nan
    idx = rng.integers(0, len(y), size=(n_bootstrap, len(y)))
    with np.errstate(invalid="ignore", divide="ignore"):
        oe = y[idx].sum(axis=1) / p[idx].sum(axis=1)
    oe = oe[np.isfinite(oe)]
    if not oe.size:
        return math.nan, math.nan
    return float(np.quantile(oe, 0.025)), float(np.quantile(oe, 0.975))


def subgroup_rows(p1, labels, groups: Mapping[str, Sequence[str]], threshold: float, *, n_bootstrap: int = 1000,
                  seed: int = 0) -> list[dict[str, Any]]:
    """One row per grouping and group: ``n``, ``n_cancers``, ``work_up_rate`` and ``sensitivity`` at
    ``threshold`` (p >= it is work-up) with Clopper-Pearson CIs, ``oe`` with a bootstrap CI (module doc)."""
    p = np.asarray(p1, np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(int)
    called = p >= threshold
    rng = np.random.default_rng(seed)
    out = []
    for grouping, values in groups.items():
        v = np.asarray(values, dtype=object)
        if len(v) != len(p):
            raise ValueError(f"{grouping}: {len(v)} groups for {len(p)} CTs")
        for g in sorted(set(v.tolist()), key=str):
            m = v == g
            n, cancers = int(m.sum()), int((y[m] == 1).sum())
            k_up, k_found = int(called[m].sum()), int((called & (y == 1))[m].sum())
            with np.errstate(invalid="ignore", divide="ignore"):
                oe = float(y[m].sum() / p[m].sum()) if p[m].sum() > 0 else math.nan
            out.append({"grouping": grouping, "group": str(g), "n": n, "n_cancers": cancers,
                        "work_up_rate": k_up / n, "work_up_ci": clopper_pearson(k_up, n),
                        "sensitivity": k_found / cancers if cancers else math.nan,
                        "sensitivity_ci": clopper_pearson(k_found, cancers), "oe": oe,
                        "oe_ci": oe_bootstrap_ci(p[m], y[m].astype(float), n_bootstrap, rng)})
    return out


def _pct(x: float, ci: tuple[float, float]) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{100 * x:.0f}% [{100 * ci[0]:.0f}-{100 * ci[1]:.0f}]"


def subgroup_text(rows: Sequence[Mapping[str, Any]], split: str, threshold: float) -> list[str]:
    """The printed table (one line per group)."""
    lines = [f"  by subgroup   on the {split} split at p(cancer) >= {threshold:.4f} (95% CIs; small groups are wide)",
             f"  {'':<13}{'group':<22}{'n':>5}{'cancers':>9}  {'work-up':<18}{'sensitivity':<18}O/E"]
    for r in rows:
        oe = "-" if not math.isfinite(r["oe"]) else (
            f"{r['oe']:.2f}" + (f" [{r['oe_ci'][0]:.2f}-{r['oe_ci'][1]:.2f}]" if math.isfinite(r["oe_ci"][0]) else ""))
        lines.append(f"  {r['grouping']:<13}{r['group'][:21]:<22}{r['n']:>5}{r['n_cancers']:>9}  "
                     f"{_pct(r['work_up_rate'], r['work_up_ci']):<18}{_pct(r['sensitivity'], r['sensitivity_ci']):<18}"
                     f"{oe}")
    return lines
