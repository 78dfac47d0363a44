"""The site check's detection rates with their power (issue 45 item 1): each verdict's rate, with its 95 % CI,
per change x strength x site size, over many draws.

``experiments/site_check_rates.py`` tried each graded change on one site: a verdict, not a rate. Here each cell
(a change at one strength) renders **one pool** of CTs, scored **once** by the model (its per-CT score, bag
embedding and acquisition statistics); each draw is a random subset of the pool, and its verdict comes from
:func:`lungcal.ctapp.evaluate.site_assessment.assess` on the subset's scored rows, the pure function that
``lungcal site-check`` itself calls after scoring (with its defaults: alpha 0.05, 1000 permutations, 20
subsamples). So a cell costs one pool's rendering and scoring, and a draw a second or two.

Cells (the model: a small stage-1 model at 5 mm trained here on the default scanner: noise 20 HU, kernel 0.7 mm,
HU offset 0, 5 mm voxels, prevalence 0.4):

- ``same``: the training scanner and prevalence (false alarms: any verdict but ``comparable``), a pool of
  ``--null-pool`` CTs and ``--null-draws`` draws per size;
- ``prevalence``: the training scanner at prevalence 0.25, 0.11 and 0.05 (the control: ``prevalence_shift`` or
  ``comparable`` is right, ``scanner_shift`` is wrong);
- ``noise``, ``kernel``, ``hu_offset``, ``slice`` (as ``site_check_rates.py``) and ``pixel`` (5.5, 6 and 7 mm
  in-plane), three strengths each (``scanner_shift`` is right);
- ``vendor_out``: a second small model trained on the four-vendor mix (``four_vendors``), and sites of one of its
  vendors only (``vendor_a``, the most common, and ``vendor_d``, the rarest), with ``mix_same`` (the whole mix)
  as that model's own false-alarm control. The model has seen every one of these scanners.

Draws are taken without replacement within a draw, independently across draws; at 120 CTs of a 150-CT pool two
draws share 96 CTs on average, so the draws of a cell are far from independent at the largest size: a rate
says what this check does on sites like this pool, with a CI that is too narrow for other pools of the same
scanner. The CIs are exact (Clopper-Pearson) over the draws.

    python experiments/site_check_power.py runs/power [--draws 20] [--null-draws 60] [--pool 150] [--null-pool 300]
    python experiments/site_check_power.py runs/power --report         # the tables from results.json

Resumable: pools, models and each draw's verdict are kept under OUT (``results.json`` rewritten as they come).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import zlib
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import site_check_rates as rates  # noqa: E402

from lungcal.ct.qc import QCConfig  # noqa: E402
from lungcal.ctapp.data.series_qc import acquisitions, keep_passing, screen  # noqa: E402
from lungcal.ctapp.evaluate.reports import binary_scores, flat_features  # noqa: E402
from lungcal.ctapp.evaluate.site_assessment import (  # noqa: E402
    COMPARABLE,
    PREVALENCE_SHIFT,
    SCANNER_SHIFT,
    Reference,
    acquisition_checks,
    assess,
)
from lungcal.ctapp.infer.scoring import score_rows  # noqa: E402
from lungcal.ctapp.model.checkpoint import load_stage1  # noqa: E402
from lungcal.ctapp.site.subgroups import clopper_pearson  # noqa: E402
from lungcal.data.synthetic.scanners import FOUR_VENDORS, ScannerMix  # noqa: E402
from lungcal.paths import atomic_write_text  # noqa: E402
from lungcal.tracking.lookup import run_acquisition_summary, run_site_reference  # noqa: E402

SIZES = (30, 60, 120)
#: the series checks of the sites: the 5 mm preset's (``site_check_rates.QC``) with room for the 7 mm pixels
QC = {**rates.QC, "max_pixel_mm": 8.0}
#: (change, strength label, make_cohort keyword arguments) of the small model's cells
PIXEL = [("pixel", f"{p:g} mm", {"spacing": (p, p, 5.0), "shape": (round(320 / p), round(320 / p), 48)})
         for p in (5.5, 6.0, 7.0)]
PREVALENCE = [("prevalence", f"{q:g}", {"prevalence": q}) for q in (0.25, 0.11, 0.05)]
CELLS = PREVALENCE + rates.GRADED + PIXEL
VENDORS = ("vendor_a", "vendor_d")
#: the right verdicts per change
RIGHT = {"same": (COMPARABLE,), "mix_same": (COMPARABLE,), "prevalence": (COMPARABLE, PREVALENCE_SHIFT),
         "vendor_out": (COMPARABLE, PREVALENCE_SHIFT)}


def one_vendor(name: str) -> ScannerMix:
    """The four-vendor mix's ``name`` alone."""
    model = next(m for m in FOUR_VENDORS.models if m.name == name)
    return ScannerMix(f"{name}_only", (replace(model, frequency=1.0),))


def pool(out: Path, name: str, n: int, seed: int, model: dict, **kw) -> dict:
    """Render a pool of ``n`` CTs, score it once with ``model``; cached as ``pools/<name>.npz``."""
    path = out / "pools" / f"{name}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as z:
            return {"scores": z["scores"], "features": z["features"], "acq": json.loads(str(z["acq"]))}
    prevalence = kw.pop("prevalence", 0.4)
    dl = rates.cohort(out, name, n, prevalence, seed, **kw)
    rows = [{**r, "image": str((dl.parent / r["image"]).resolve())} for r in json.loads(dl.read_text())["rows"]]
    reports = screen(rows, QCConfig(**QC), out / "cache" / "qc", progress=False)
    kept, _ = keep_passing(rows, reports, show=False)
    kept_reports = [r for r in reports if r is None or not r.failed]
    sc = score_rows(model["network"], kept, model["bag_params"], None, cache_dir=out / "cache" / "bags")
    acq = [None if a is None else asdict(a) for a in acquisitions(kept_reports)]
    found = {"scores": binary_scores(sc["logits"]), "features": flat_features(sc["features"]), "acq": acq}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, scores=found["scores"], features=found["features"], acq=np.array(json.dumps(acq)))
    return found


def load_model(out: Path, datalist: Path, epochs: int) -> dict:
    """Train (once) and load a small stage-1 model: its network, bag parameters, reference and training summary."""
    run = rates.train(out, datalist, epochs)
    uri = f"sqlite:///{out / 'model' / 'mlflow.db'}"
    stage1 = load_stage1(run, uri, field="--run")
    ref = run_site_reference(uri, run)
    if ref is None:
        raise SystemExit(f"run {run} logged no site reference")
    return {"run": run, "network": stage1.network, "bag_params": stage1.bag_params,
            "summary": run_acquisition_summary(uri, run),
            "reference": Reference(np.asarray(ref["scores"], float), np.asarray(ref["labels"]).astype(int),
                                   flat_features(ref["features"]), "the run's validation split").check()}


def verdict_of(model: dict, found: dict, idx: np.ndarray, seed: int) -> dict:
    """The site check's verdict on the pool's rows ``idx`` (the function ``lungcal site-check`` calls)."""
    stats = [None if found["acq"][i] is None else SimpleNamespace(**found["acq"][i]) for i in idx]
    acq = acquisition_checks(model["summary"], stats)
    res = assess(model["reference"], found["scores"][idx], found["features"][idx], acq, seed=seed,
                 effect_size=False)  # the verdict does not use it (about a third of a check's time)
    return {"verdict": res["verdict"], "prevalence": res["prevalence"],
            "reasons": [r.split(":")[0] for r in res["reasons"]]}


def rate_table(results: dict) -> str:
    """Per change x strength x size: each verdict's rate [Clopper-Pearson CI] and the share right."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for key, r in results.items():
        change, label, size, _ = key.split("|")
        groups[(change, label, int(size))].append(r)
    lines = ["| change | strength | CTs | draws | comparable | prevalence_shift | scanner_shift | right | what fired |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (change, label, size), rs in groups.items():
        n = len(rs)
        cells = []
        for v in (COMPARABLE, PREVALENCE_SHIFT, SCANNER_SHIFT):
            k = sum(r["verdict"] == v for r in rs)
            lo, hi = clopper_pearson(k, n)
            cells.append(f"{k}/{n} [{100 * lo:.0f}, {100 * hi:.0f}] %")
        right = RIGHT.get(change, (SCANNER_SHIFT,))
        k = sum(r["verdict"] in right for r in rs)
        lo, hi = clopper_pearson(k, n)
        fired: dict[str, int] = defaultdict(int)
        for r in rs:
            for reason in r.get("reasons", []):
                fired[re.split(r" \(| \d| \[", reason)[0]] += 1  # the statistic, not its value
        what = ", ".join(f"{k} {v}" for k, v in sorted(fired.items(), key=lambda kv: -kv[1])) or "-"
        lines.append(f"| {change} | {label} | {size} | {n} | " + " | ".join(cells)
                     + f" | {100 * k / n:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}] | {what} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--null-draws", type=int, default=60)
    ap.add_argument("--pool", type=int, default=150)
    ap.add_argument("--null-pool", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--report", action="store_true", help="print the tables of results.json and stop")
    a = ap.parse_args(argv)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    if a.report:
        print(rate_table(results))
        return
    t0 = time.time()
    small = load_model(out, rates.cohort(out, "train", 200, 0.4, 1), a.epochs)
    mix = load_model(out / "mix", rates.cohort(out / "mix", "train", 200, 0.4, 1, scanner_mix=FOUR_VENDORS,
                                               nodule_types="classic"), a.epochs)
    print(f"models {small['run']} (one scanner) and {mix['run']} (four vendors), {time.time() - t0:.0f} s", flush=True)
    plan = [("same", "", small, dict(n=a.null_pool, seed=2), a.null_draws)]
    plan += [(c, lab, small, dict(n=a.pool, seed=10 + j, **kw), a.draws) for j, (c, lab, kw) in enumerate(CELLS)]
    plan += [("mix_same", "four vendors", mix, dict(n=a.null_pool, seed=40, scanner_mix=FOUR_VENDORS), a.null_draws)]
    plan += [("vendor_out", v, mix, dict(n=a.pool, seed=41 + j, scanner_mix=one_vendor(v)), a.draws)
             for j, v in enumerate(VENDORS)]
    for change, label, model, kw, draws in plan:
        name = f"{change}_{label.replace(' ', '')}" if label else change
        found = pool(out if model is small else out / "mix", name, model=model, **kw)
        n_pool = len(found["scores"])
        todo = [(s, d) for s in a.sizes for d in range(draws) if f"{change}|{label}|{s}|{d}" not in results]
        for size, d in tqdm(todo, desc=f"{change} {label}", unit="draw"):
            if size > n_pool:
                continue
            rng = np.random.default_rng([size, d, zlib.crc32(f"{change}|{label}".encode())])
            idx = np.sort(rng.choice(n_pool, size, replace=False))
            results[f"{change}|{label}|{size}|{d}"] = {**verdict_of(model, found, idx, seed=d), "pool": n_pool}
            atomic_write_text(path, json.dumps(results, indent=0))
    print(rate_table(results))
    print(f"{len(results)} draws in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
