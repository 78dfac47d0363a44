"""``lungcal monitor`` end to end on rendered CTs through the real network (issue 46 item 3): a stable site and a
site whose scanner changes in month 4.

The score-level simulation (``experiments/monitor_sites.py``) renders no CT. Here every step is the hospital's:
the headline bundle trains a model on its synthetic demo cohort (the ``four_vendors`` scanner mix); ``lungcal
synth`` renders a go-live site on one pinned scanner (image noise 20 HU, kernel sigma 0.8 mm: the score-level
simulation's go-live scanner); ``lungcal recalibrate --miss-rate`` fits the site's calibrator and threshold on its
calibration CTs; then 12 monthly chunks of 50 new CTs each (a fresh seed per month), dated in the datalist's
``study_date``, go through ``lungcal monitor`` with their labels:

- ``stable``: months 1-12 from the go-live scanner;
- ``change``: months 1-3 the same CTs as the stable site's, months 4-12 from a softer, noisier scanner (noise 30 HU,
  kernel sigma 1.2 mm: the simulation's change of noise 20 -> 30 HU and edge width 0.8 -> 1.2 mm, as synth's flags
  name it).

All CTs at prevalence 0.3 (the simulation's), 128 x 128 x 96 voxels of 2.5 mm (synth's default grid, the demo's).

``sites`` renders the CTs (``lungcal synth``; a folder already rendered is kept) and writes the two dated
datalists; ``tables`` reads the two ``monitor --json`` files and prints the markdown tables (per month: the verdict
against the site's calibration CTs, the alerts, the CBPE estimate with its interval and validity, the observed
sensitivity with its Clopper-Pearson interval; then the pooled observed sensitivity per period, the best estimate
of the true one) and, with ``--csv``, writes the per-month rows.

The exact commands (from the project root, with the project's environment)::

    python -m monai.bundle run --config_file bundles/nlst_focal.json --output_dir runs/mon/model \\
        --tracking_uri sqlite:///runs/mon/mlflow.db
    python experiments/monitor_rendered.py sites --out runs/mon/sites
    # optional, beside the training: the bags ahead (the same cache folder as the model's run)
    lungcal build-bags runs/mon/sites/calib/datalist.json --params bundles/nlst_focal.json --output-dir runs/mon/model
    lungcal build-bags runs/mon/sites/change.json --params bundles/nlst_focal.json --output-dir runs/mon/model
    lungcal build-bags runs/mon/sites/stable.json --params bundles/nlst_focal.json --output-dir runs/mon/model
    lungcal recalibrate --model <RUN> --datalist runs/mon/sites/calib/datalist.json --miss-rate 0.15 \\
        --confidence 0.9 --site golive --tracking-uri sqlite:///runs/mon/mlflow.db --output-dir runs/mon/model
    lungcal monitor runs/mon/sites/stable.json --run <RUN> --site golive --json runs/mon/stable_monitor.json \\
        --tracking-uri sqlite:///runs/mon/mlflow.db --output-dir runs/mon/model
    lungcal monitor runs/mon/sites/change.json --run <RUN> --site golive --json runs/mon/change_monitor.json \\
        --tracking-uri sqlite:///runs/mon/mlflow.db --output-dir runs/mon/model
    python experiments/monitor_rendered.py tables runs/mon/stable_monitor.json runs/mon/change_monitor.json \\
        --csv docs/results/data/monitor_rendered_2026-12-07.csv.gz

The 2026-12-07 entry ran the bundle with ``--epochs 8`` (the 2 shared cores could not train 120 epochs by its
deadline): a model near chance, so its sensitivity columns say little; drop the override for the real test.
(``<RUN>``: the stage-1 run id the bundle logs, the parent named by ``recalibrate``; ``lungcal ui --tracking-uri
sqlite:///runs/mon/mlflow.db`` shows it.)
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

GO_LIVE = {"noise_hu": 20.0, "kernel_mm": 0.8}
NEW = {"noise_hu": 30.0, "kernel_mm": 1.2}
SITE, PREVALENCE, N_CALIBRATION, N_MONTH, MONTHS, CHANGE_MONTH = "golive", 0.3, 240, 50, 12, 4


def synth(out: Path, *, n: int, seed: int, scanner: dict[str, float], splits: str, workers: int) -> Path:
    """Render ``n`` CTs with ``lungcal synth`` into ``out`` (kept when its datalist is there); its datalist."""
    datalist = out / "datalist.json"
    if datalist.is_file():
        return datalist
    cmd = ["lungcal", "synth", "--out", str(out), "--n", str(n), "--seed", str(seed), "--site", SITE,
           "--noise-hu", str(scanner["noise_hu"]), "--kernel-mm", str(scanner["kernel_mm"]),
           "--prevalence", str(PREVALENCE), "--formats", "nii", "--splits", splits, "--workers", str(workers)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return datalist


def dated_rows(datalist: Path, month: int) -> list[dict[str, Any]]:
    """The rendered rows with absolute image paths, a ``study_date`` in month ``month`` (1 = January 2031) spread
    over its days, and the label kept (monitor reports the observed sensitivity beside the estimate); ``subject``
    and ``split`` only so that ``lungcal build-bags`` reads the file too (monitor ignores them)."""
    rows = json.loads(datalist.read_text())["rows"]
    out = []
    for i, r in enumerate(rows):
        year, m = 2031 + (month - 1) // 12, (month - 1) % 12 + 1
        out.append({"image": str((datalist.parent / r["image"]).resolve()), "label": int(r["label"]),
                    "subject": f"m{month:02d}_{r['subject']}", "site": SITE, "split": "test",
                    "study_date": f"{year:04d}-{m:02d}-{1 + i % 28:02d}"})
    return out


def cmd_sites(args: argparse.Namespace) -> None:
    out = Path(args.out)
    synth(out / "calib", n=N_CALIBRATION, seed=100, scanner=GO_LIVE, splits="0,0.5,0.5", workers=args.workers)
    old = {m: synth(out / f"old_m{m}", n=N_MONTH, seed=100 + m, scanner=GO_LIVE, splits="0,0,1",
                    workers=args.workers) for m in range(1, MONTHS + 1)}
    new = {m: synth(out / f"new_m{m}", n=N_MONTH, seed=200 + m, scanner=NEW, splits="0,0,1", workers=args.workers)
           for m in range(CHANGE_MONTH, MONTHS + 1)}
    stable = [r for m in range(1, MONTHS + 1) for r in dated_rows(old[m], m)]
    change = [r for m in range(1, MONTHS + 1) for r in dated_rows(old[m] if m < CHANGE_MONTH else new[m], m)]
    for name, rows in (("stable", stable), ("change", change)):
        path = out / f"{name}.json"
        path.write_text(json.dumps({"version": 1, "site": SITE, "rows": rows}, indent=1) + "\n")
        print(f"wrote {path} ({len(rows)} rows)")


def _f(x: float | None, d: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{d}f}"


def month_rows(path: Path, site: str) -> list[dict[str, Any]]:
    """One record per monthly chunk of a ``monitor --json`` file."""
    doc = json.loads(path.read_text())
    out = []
    for c in doc["chunks"]:
        s = c["stats"] or {}
        e, o, chk = s.get("estimate", {}), s.get("observed") or {}, s.get("site_check", {})
        tr = s.get("training_check", {})
        out.append({
            "site": site, "month": c["chunk"], "n": c["n"], "verdict": chk.get("verdict"),
            "domain_auc": (chk.get("effect") or {}).get("auc"), "verdict_training": tr.get("verdict"),
            "prevalence_bbse": chk.get("prevalence"), "ood_share": s.get("ood", {}).get("share"),
            "fired": ", ".join(str(x).split(":")[0] for x in chk.get("reasons") or []),
            "alerts": ";".join(f"{a['kind']}{'' if a['new'] else '(still)'}" for a in c["alerts"]),
            "work_up": s.get("work_up", {}).get("rate"),
            "est": e.get("sensitivity"), "est_lo": (e.get("interval") or [None, None])[0],
            "est_hi": (e.get("interval") or [None, None])[1], "est_valid": e.get("valid"),
            "prior_adjusted": e.get("prior_adjusted"), "n_cancers": o.get("n_cancers"),
            "obs": o.get("sensitivity"), "obs_lo": (o.get("sensitivity_ci") or [None, None])[0],
            "obs_hi": (o.get("sensitivity_ci") or [None, None])[1], "obs_oe": o.get("oe"), "obs_ece": o.get("ece"),
            "threshold": doc["threshold"], "promise": doc["rule"].get("promise")})
    return out


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| month | verdict vs calibration CTs (domain AUC) | what fired | alerts | work-up | "
             "CBPE sensitivity [95 %] | observed sensitivity [95 % CP] (cancers) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        valid = "" if r["est_valid"] else " **not valid**"
        valid += " (prior-adj.)" if r["prior_adjusted"] else ""
        lines.append(f"| {r['month']} | {r['verdict']} ({_f(_num(r['domain_auc']), 2)}) | {r['fired'] or '-'} | "
                     f"{r['alerts'] or '-'} | "
                     f"{_f(_num(r['work_up']), 2)} | {_f(_num(r['est']))} [{_f(_num(r['est_lo']))}, "
                     f"{_f(_num(r['est_hi']))}]{valid} | {_f(_num(r['obs']))} [{_f(_num(r['obs_lo']))}, "
                     f"{_f(_num(r['obs_hi']))}] ({r['n_cancers']}) |")
    return "\n".join(lines)


def pooled(rows: list[dict[str, Any]], months: range) -> tuple[float, float, int]:
    """Mean CBPE estimate, and the pooled observed sensitivity (all the months' cancers) with their count."""
    sel = [r for r in rows if r["month"] in months]
    found = sum(_num(r["obs"]) * r["n_cancers"] for r in sel if r["n_cancers"])
    n = sum(r["n_cancers"] or 0 for r in sel)
    est = sum(_num(r["est"]) for r in sel) / len(sel) if sel else math.nan
    return est, found / n if n else math.nan, n


def cmd_tables(args: argparse.Namespace) -> None:
    rows = {"stable": month_rows(Path(args.stable), "stable"), "change": month_rows(Path(args.change), "change")}
    r0 = rows["stable"][0]
    print(f"threshold {_f(_num(r0['threshold']), 4)}, promised sensitivity {_f(_num(r0['promise']))}\n")
    for name, title in (("stable", "Stable site (go-live scanner, 12 months)"),
                        ("change", f"Scanner change in month {CHANGE_MONTH} (noise 20 -> 30 HU, kernel 0.8 -> 1.2 "
                                   "mm)")):
        print(f"**{title}**\n\n{table(rows[name])}\n")
        first = next((r["month"] for r in rows[name] if r["alerts"]), None)
        print(f"first alert: month {first or 'none'}; alerting months: "
              f"{', '.join(str(r['month']) for r in rows[name] if r['alerts']) or 'none'}\n")
    print("| site | months | mean CBPE estimate | pooled observed sensitivity (cancers) |\n|---|---|---|---|")
    for name, months in (("stable", range(1, 13)), ("change", range(1, CHANGE_MONTH)),
                         ("change", range(CHANGE_MONTH, 13))):
        est, obs, n = pooled(rows[name], months)
        print(f"| {name} | {months.start}-{months.stop - 1} | {_f(est)} | {_f(obs)} ({n}) |")
    if args.csv:
        flat = rows["stable"] + rows["change"]
        path = Path(args.csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(flat[0]))
            w.writeheader()
            w.writerows(flat)
        print(f"\nwrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sites", help="render the go-live site's calibration CTs and the monthly chunks; write "
                                     "stable.json and change.json")
    s.add_argument("--out", default="runs/mon/sites")
    s.add_argument("--workers", type=int, default=1)
    s.set_defaults(func=cmd_sites)
    t = sub.add_parser("tables", help="the markdown tables from the two monitor --json files")
    t.add_argument("stable")
    t.add_argument("change")
    t.add_argument("--csv", help="also write the per-month rows here (.csv.gz)")
    t.set_defaults(func=cmd_tables)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
