"""``lungcal monitor`` on synthetic sites (issue 46 item 3): false alarms over stable years, a scanner change in
month 4, a prevalence doubling in month 6, at 50, 100 and 200 CTs a month.

A **score-level** simulation: no CT is rendered and no network runs. A site's CT is a 6-dimensional embedding
drawn from class-conditional Gaussians (cancer or not: the first coordinate shifted by +-1.5); the model's score is
the embedding's first coordinate plus a tenth of the second; its calibrated p(cancer) is the exact posterior of the
go-live scanner at the go-live prevalence 0.3, so CBPE is right by construction while nothing changes. The
acquisition statistics (slice thickness, pixel, air HU, noise HU, edge width) are drawn per CT around the
go-live scanner's. The site's calibration CTs are 300 CTs of its go-live population (labelled); its threshold
keeps 92 % of their cancers (the 8th percentile of the cancers' p), and the promise is sensitivity 0.85.

- ``stable``: ``--years`` stable years per size, each with a **fresh** site (a new draw of calibration CTs),
  12 monthly chunks from the same population: the years with any alert, by kind, with Clopper-Pearson CIs; beside
  them, the same chunks judged by the rule before the fix (a prevalence alert when the chunk's bootstrap BBSE
  interval at 1 - 0.05/12 excludes the calibration CTs' prevalence). ``--fixed-reference`` keeps one site's
  calibration CTs for every year instead (the rate given that reference). The monitor sees the outputs only
  here (``--view``): the prevalence alert rests on the outputs alone, and the scanner family's tests are
  permutation tests whose Bonferroni bound needs no simulation.
- ``scanner``: from month 4 a new scanner, softer and noisier: the cancers' shift 1.5 -> 1.2 and every embedding
  coordinate's noise 1.0 -> 1.3 (so the scores too), a scanner signature of +0.5 on the third embedding coordinate
  (which the score does not read), image noise 20 -> 30 HU and edge width 0.8 -> 1.2 mm. Per size: ``--sites``
  independent sites, the month of each one's first alert and which statistic fired, under three views (the
  outputs only; outputs and embeddings; outputs, embeddings and acquisition fields); and one site's months in
  full (estimated vs true sensitivity, valid or not).
- ``prevalence``: from month 6 the prevalence doubles (0.3 -> 0.6), nothing else: the month of the first
  prevalence alert over ``--sites`` sites, and one site's months in full (the CBPE estimate after the prior
  adjustment against the true sensitivity).

Prints markdown tables (the ones in ``docs/results/hospital.md``, 2026-12-07).

    python experiments/monitor_sites.py stable --sizes 50 100 200 --years 100   # (each size in its own process)
    python experiments/monitor_sites.py stable --sizes 50 --years 30 --fixed-reference 0
    python experiments/monitor_sites.py scanner --sizes 50 100 200 --sites 6
    python experiments/monitor_sites.py prevalence --sizes 50 100 200 --sites 10
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from lungcal.calibration.shift import prevalence_interval
from lungcal.ct.acquisition import AcquisitionStats, summarize_acquisitions
from lungcal.ctapp.evaluate.site_assessment import PREVALENCE_SHIFT, SCANNER_SHIFT, Reference, acquisition_checks
from lungcal.ctapp.site.monitoring import AlertRule, chunk_statistics, run_alerts
from lungcal.ctapp.site.subgroups import clopper_pearson

PREV, D, N_CALIBRATION, PROMISE = 0.3, 6, 300, 0.85
VIEWS = ("outputs", "embeddings", "all")


@dataclass(frozen=True)
class Scanner:
    """What a scanner does to the embeddings (the cancers' shift, the noise, a signature the score ignores) and to
    the acquisition statistics."""

    signal: float = 1.5
    noise: float = 1.0
    signature: float = 0.0
    noise_hu: float = 20.0
    edge_mm: float = 0.8


GO_LIVE = Scanner()
NEW = Scanner(signal=1.2, noise=1.3, signature=0.5, noise_hu=30.0, edge_mm=1.2)


def population(rng: np.random.Generator, n: int, prevalence: float = PREV,
               scanner: Scanner = GO_LIVE) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list]:
    """``(scores, embeddings, p1, labels, acquisition stats)`` of ``n`` CTs; ``p1`` the go-live posterior."""
    y = (rng.random(n) < prevalence).astype(int)
    f = rng.normal(size=(n, D)) * scanner.noise
    f[:, 0] += np.where(y == 1, scanner.signal, -scanner.signal)
    f[:, 2] += scanner.signature
    s = f[:, 0] + 0.1 * f[:, 1]
    var = GO_LIVE.noise ** 2 * 1.01
    p = 1 / (1 + np.exp(-(math.log(PREV / (1 - PREV)) + 2 * GO_LIVE.signal * s / var)))
    acq = [AcquisitionStats(1.0, 1.0, 0.7, -1000 + rng.normal(0, 3), scanner.noise_hu * rng.lognormal(0, 0.05),
                            scanner.edge_mm * rng.lognormal(0, 0.05)) for _ in range(n)]
    return s, f, p, y, acq


@dataclass
class Site:
    """A site at go-live: its calibration CTs (the reference), their acquisition summary, its threshold."""

    reference: Reference
    summary: dict[str, Any]
    threshold: float


def make_site(rng: np.random.Generator, view: str = "all") -> Site:
    s, f, p, y, acq = population(rng, N_CALIBRATION)
    feats = f if view in ("embeddings", "all") else None
    return Site(Reference(s, y, feats, "site calibration CTs"), summarize_acquisitions(acq),
                float(np.quantile(p[y == 1], 0.08)))


def run_year(rng: np.random.Generator, site: Site, n: int, *, view: str = "all", scanner_from: int | None = None,
             prevalence_from: int | None = None, months: int = 12, stop_at_first: bool = False,
             old_rule: bool = False, n_subsamples: int = 5, n_bootstrap: int = 200,
             n_draws: int = 500) -> list[dict[str, Any]]:
    """One year of monthly chunks of ``n`` CTs at ``site``: per month the verdict, the alerts (kinds, first
    reason), CBPE (estimate, interval, valid, prior-adjusted) and the truth (sensitivity, prevalence);
    ``old_rule``: also whether the rule before the fix alerted."""
    rule = AlertRule(promise=PROMISE)
    stats, rows = [], []
    for month in range(1, months + 1):
        scanner = NEW if scanner_from is not None and month >= scanner_from else GO_LIVE
        q = 2 * PREV if prevalence_from is not None and month >= prevalence_from else PREV
        s, f, p, y, acq = population(rng, n, q, scanner)
        acq_checks = acquisition_checks(site.summary, acq) if view == "all" else {}
        seed = int(rng.integers(2 ** 31))
        st = chunk_statistics(s, p, threshold=site.threshold, rule=rule, site=site.reference,
                              features=f if view != "outputs" else None, site_acquisition=acq_checks,
                              n_subsamples=n_subsamples, n_bootstrap=n_bootstrap, n_draws=n_draws, seed=seed)
        stats.append(st)
        alerts = run_alerts(stats, rule)[-1]
        e, c = st["estimate"], st["site_check"]
        row = {"month": month, "verdict": c["verdict"], "alerts": [a["kind"] for a in alerts],
               "why": alerts[0]["why"] if alerts else "", "fired": fired(c),
               "est": e["sensitivity"], "interval": e["interval"], "valid": e["valid"],
               "adjusted": e["prior_adjusted"],
               "true": float(((p >= site.threshold) & (y == 1)).sum() / max(1, y.sum())),
               "prevalence": float(y.mean()), "est_prevalence": c["prevalence"]}
        if old_rule:
            row["old_alert"] = old_rule_alerts(site.reference, s, st, seed)
        rows.append(row)
        if stop_at_first and alerts:
            break
    return rows


def fired(check: dict[str, Any]) -> list[str]:
    """The statistics of a chunk's site check that crossed their level (test names, acquisition fields)."""
    out = [k for k, t in (check.get("tests") or {}).items() if t["pvalue"] < t["level"]]
    out += [r.split(":")[0] for r in check.get("reasons") or [] if r.split(":")[0].endswith(("_mm", "_hu"))]
    return out


def old_rule_alerts(reference: Reference, scores: np.ndarray, st: dict[str, Any], seed: int) -> bool:
    """Whether the site check before the fix made the chunk an alert: scanner_shift as now, or the outputs moved,
    or the chunk's bootstrap BBSE interval at 1 - alpha (10 / alpha draws) excluded the reference's prevalence."""
    c = st["site_check"]
    if c["verdict"] == SCANNER_SHIFT:
        return True
    a = AlertRule().alpha_chunk
    lo, hi = prevalence_interval(reference.scores, reference.labels, scores, n_bootstrap=math.ceil(10 / a),
                                 level=1 - a, seed=seed)
    excluded = math.isfinite(lo) and not lo <= c["source_prevalence"] <= hi
    return excluded or c["tests"]["outputs_any_change"]["pvalue"] < a


def stable(sizes: list[int], years: int, seed: int, fixed_reference: int | None, view: str,
           n_subsamples: int, old: bool) -> None:
    which = "a fresh site each year" if fixed_reference is None else f"one fixed site, seed {fixed_reference}"
    print(f"### Stable years ({years} per size; {which}; view: {view})\n")
    print("| CTs/month | years with any alert | rate [95 % CI] | scanner_shift | prevalence_shift | sensitivity | "
          "alerting chunks | before the fix: years | rate [95 % CI] |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        rng = np.random.default_rng([seed, n])
        fixed = make_site(np.random.default_rng(fixed_reference), view) if fixed_reference is not None else None
        t0 = time.time()
        any_y = old_y = chunks = 0
        kinds = {SCANNER_SHIFT: 0, PREVALENCE_SHIFT: 0, "sensitivity": 0}
        for _ in range(years):
            site = fixed or make_site(rng, view)
            rows = run_year(rng, site, n, view=view, old_rule=old, n_subsamples=n_subsamples)
            found = {k for r in rows for k in r["alerts"]}
            any_y += bool(found)
            chunks += sum(bool(r["alerts"]) for r in rows)
            for k in found:
                kinds[k] = kinds.get(k, 0) + 1
            old_y += any(r.get("old_alert", False) for r in rows)
        lo, hi = clopper_pearson(any_y, years)
        olo, ohi = clopper_pearson(old_y, years)
        old_cells = f"{old_y} | {old_y / years:.2f} [{olo:.2f}, {ohi:.2f}]" if old else "- | -"
        print(f"| {n} | {any_y} of {years} | {any_y / years:.2f} [{lo:.2f}, {hi:.2f}] | {kinds[SCANNER_SHIFT]} | "
              f"{kinds[PREVALENCE_SHIFT]} | {kinds['sensitivity']} | {chunks} of {12 * years} | {old_cells} |",
              flush=True)
        if fixed is not None:
            print(f"<!-- fixed site: calibration prevalence {fixed.reference.labels.mean():.3f} -->")
        print(f"<!-- {n} CTs/month: {time.time() - t0:.0f} s -->", flush=True)
    print()


def _fmt(x: float, ci: tuple[float, float] | None = None) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:.3f}" if ci is None else f"{x:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def month_table(rows: list[dict[str, Any]]) -> None:
    print("| month | true prevalence | est. prevalence | verdict | alerts | statistics that fired | CBPE sensitivity "
          "[95 %] | valid | true sensitivity |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        valid = ("yes, prior-adjusted" if r["adjusted"] else "yes") if r["valid"] else "NO"
        alerts = ", ".join(r["alerts"]) or "-"
        print(f"| {r['month']} | {r['prevalence']:.2f} | {r['est_prevalence']:.2f} | {r['verdict']} | {alerts} | "
              f"{', '.join(r['fired']) or '-'} | {_fmt(r['est'], r['interval'])} | {valid} | {r['true']:.3f} |")
    print()


def change(kind: str, sizes: list[int], sites: int, seed: int, n_subsamples: int) -> None:
    start = 4 if kind == "scanner" else 6
    views = VIEWS if kind == "scanner" else ("all",)
    print(f"### {'Scanner change in month 4' if kind == 'scanner' else 'Prevalence doubling in month 6'} "
          f"({sites} sites per size and view)\n")
    print("| CTs/month | view | first alert: month (sites) | alert before month " + str(start)
          + " | caught in month " + str(start) + " | by month " + str(start + 2) + " | what fired first |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        for view in views:
            rng = np.random.default_rng([seed, n, VIEWS.index(view)])
            firsts, what = [], {}
            for _ in range(sites):
                site = make_site(rng, view)
                rows = run_year(rng, site, n, view=view, stop_at_first=True, n_subsamples=n_subsamples,
                                **({"scanner_from": 4} if kind == "scanner" else {"prevalence_from": 6}))
                hit = next((r for r in rows if r["alerts"]), None)
                firsts.append(hit["month"] if hit else 13)
                if hit is not None and hit["month"] >= start:
                    for k in hit["fired"] or hit["alerts"]:
                        what[k] = what.get(k, 0) + 1
            counts = np.bincount(firsts, minlength=14)
            months = ", ".join(f"{m} ({counts[m]})" for m in range(1, 14) if counts[m]).replace("13 (", "none (")
            early = sum(f < start for f in firsts)
            on = sum(f == start for f in firsts)
            by = sum(start <= f <= start + 2 for f in firsts)
            fired_s = ", ".join(f"{k} {v}" for k, v in sorted(what.items(), key=lambda kv: -kv[1]))
            print(f"| {n} | {view} | {months} | {early} | {on} of {sites} | {by} of {sites} | {fired_s} |",
                  flush=True)
    print()
    for n in sizes:
        rng = np.random.default_rng([seed, n, 99])
        site = make_site(rng, "all")
        print(f"**{n} CTs a month, one site (all views; calibration prevalence "
              f"{site.reference.labels.mean():.2f}):**\n")
        month_table(run_year(rng, site, n, view="all", n_subsamples=n_subsamples,
                             **({"scanner_from": 4} if kind == "scanner" else {"prevalence_from": 6})))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("stable", "scanner", "prevalence"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--years", type=int, default=100, help="stable years per size")
    ap.add_argument("--sites", type=int, default=10, help="sites per size and view (scanner, prevalence)")
    ap.add_argument("--fixed-reference", type=int, default=None, metavar="SEED",
                    help="stable: one site's calibration CTs (drawn with SEED) for every year")
    ap.add_argument("--view", choices=VIEWS, default="outputs", help="stable: what the monitor sees")
    ap.add_argument("--subsamples", type=int, default=5, help="the label-shift test's subsamples (lungcal: 20)")
    ap.add_argument("--no-old", action="store_true", help="stable: skip the rule before the fix")
    ap.add_argument("--seed", type=int, default=46)
    a = ap.parse_args(argv)
    if a.what == "stable":
        stable(a.sizes, a.years, a.seed, a.fixed_reference, a.view, a.subsamples, not a.no_old)
    else:
        change(a.what, a.sizes, a.sites, a.seed, a.subsamples)


if __name__ == "__main__":
    main()
