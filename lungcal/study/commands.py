"""``lungcal study | report``: the study's command-line sub-commands.

Heavy imports (torch, MLflow, MONAI) happen inside each command, so ``lungcal --help`` stays fast
(the only function-local imports the lint contract allows). User errors are
:class:`lungcal.errors.LungcalError`; :mod:`lungcal.cli` prints them in one line.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from lungcal.errors import ConfigError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``study`` and ``report`` to the ``lungcal`` parser."""
    p = subparsers.add_parser(
        "study", help="run the study grid (dataset x stage-1 x stage-2) through the bundles, resuming",
        description="Run a grid of dataset x stage-1 method x stage-2 method through the bundles. "
        "Configurations with a FINISHED run in MLflow are skipped.")
    p.add_argument("--datasets", nargs="+", default=["nlst"], help="nlst, cifar10, cifar10lt (default: nlst)")
    p.add_argument("--stage1", nargs="+", default=None, help="stage-1 methods (default: ce focal mixup focal_mixup)")
    p.add_argument("--stage2", nargs="+", default=None, help="stage-2 methods (default: none ts las)")
    p.add_argument("--preset", choices=["reduced", "full"], default="reduced",
                   help="reduced: CPU-friendly schedule (default); full: the study's schedule")
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="extra bundle override, repeatable (e.g. -o epochs=3)")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="run every configuration once per seed (default: the bundles' own seed)")
    p.add_argument("--datalist", default=None,
                   help="datalist JSON for the CT bundles (default: the synthetic demo cohort; with --preset full "
                        "the NLST-like study cohort, generated once)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI: sqlite:///..., postgresql://USER@HOST:5432/DB (a team store) or "
                        "http(s)://SERVER (default: the project's SQLite store)")
    p.add_argument("--bundle-dir", default=None, help="folder with the bundle JSONs (default: ./bundles)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (run / skip) and exit")
    p.add_argument("--force", action="store_true", help="rerun configurations that already have a finished run")
    p.add_argument("--in-process", action="store_true",
                   help="run bundles with monai.bundle.run in this process (faster start, no isolation)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="run up to N jobs at once, each in its own process (default 1); a LAS job waits for its "
                        "stage-1 job. Each job still uses its own num_workers for bags: split the cores. Many "
                        "writers: a PostgreSQL store (--tracking-uri postgresql://..., the [team] extra)")
    p.set_defaults(func=_study)

    p = subparsers.add_parser(
        "report", help="build the study's comparison tables from MLflow (Markdown, CSV, HTML)",
        description="Rows: stage-1 methods; column groups: stage-2 methods; cells ACC, AUC, ECE with 95% CIs.")
    p.add_argument("--experiment", required=True, help="MLflow experiment: nlst, cifar10, cifar10lt, ...")
    p.add_argument("--out", default=None, help="output folder (default: <runs>/reports/<experiment>)")
    p.add_argument("--split", default="test", help="split whose final metrics are tabulated (default: test)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    p.add_argument("--no-log", action="store_true", help="do not log the report as an MLflow run")
    p.set_defaults(func=_report)


def _parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not KEY=VALUE", field="--override",
                              fix="write e.g. --override epochs=3")
        out[key.strip()] = value
    return out


def _study(args: argparse.Namespace) -> int:
    from lungcal.study.runner import inprocess_runner, plan_study, print_plan, run_study

    plan = plan_study(args.datasets, stage1=args.stage1, stage2=args.stage2, preset=args.preset,
                      overrides=_parse_overrides(args.override), datalist=args.datalist,
                      tracking_uri=args.tracking_uri, bundle_dir=args.bundle_dir, force=args.force,
                      seeds=args.seeds)
    if args.in_process:
        plan.runner = inprocess_runner
    print_plan(plan)
    if args.dry_run:
        return 0
    results = run_study(plan, workers=args.workers)
    failed = [r for r in results if r.status == "failed"]
    return 1 if failed else 0


def _report(args: argparse.Namespace) -> int:
    from lungcal.study.report import build_report

    res = build_report(args.experiment, args.out, tracking_uri=args.tracking_uri, split=args.split,
                       log_run=not args.no_log)
    print(Path(res["markdown"]).read_text())
    print(f"wrote {res['markdown']}\n      {res['csv']}\n      {res['html']}")
    if res["run_id"]:
        print(f"logged as MLflow run {res['run_id']} (experiment {args.experiment})")
    return 0
