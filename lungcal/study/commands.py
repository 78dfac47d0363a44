"""``lungcal study | report | compare | uncertainty``: the study's command-line sub-commands.

Heavy imports (torch, MLflow, MONAI) happen inside each command, so ``lungcal --help`` stays fast
(the only function-local imports the lint contract allows). User errors are
:class:`lungcal.errors.LungcalError`; :mod:`lungcal.cli` prints them in one line.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from lungcal.errors import ConfigError
from lungcal.study.sections import SECTIONS, parse_sections

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``study``, ``report``, ``compare``, ``archive`` and ``uncertainty`` to the ``lungcal`` parser."""
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
        "report", help="the study report from MLflow: tables, accuracy by class, post-hoc fixes (Markdown, CSV, HTML)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The study report of one MLflow experiment, from its finished runs, in sections:\n"
        "  study    the tables: rows stage-1 methods, column groups stage-2 methods, cells ACC, AUC, ECE with\n"
        "           95% CIs, beside the published numbers (a synthetic NLST-like cohort beside the numbers\n"
        "           published on real NLST, labelled so); referral at 90% coverage; the paired differences\n"
        "           that carry the study's claims (default)\n"
        "  classes  accuracy per class and per many/medium/few group (CIFAR-10-LT: MiSLAS's groups), with CIs\n"
        "  posthoc  per CIFAR stage-1 run: TS, the ECE-best T, logit adjustment, prior+TS and vector scaling\n"
        "           fitted on val, scored on test, beside its LAS runs, with paired differences\n"
        "Writes report.md, report.csv (the study tables) and report.html.",
        epilog="examples:\n  lungcal report --experiment nlst\n"
        "  lungcal report --experiment cifar10lt --sections study,classes,posthoc\n"
        "  lungcal report --experiment cifar10lt --sections posthoc --tracking-uri sqlite:///runs/gpu_study/ce.db")
    p.add_argument("--experiment", required=True, help="MLflow experiment: nlst, cifar10, cifar10lt, ...")
    p.add_argument("--sections", default=None, metavar="NAME[,NAME...]",
                   help=f"which sections, comma-separated: {', '.join(SECTIONS)} or all (default: study)")
    p.add_argument("--n-bootstrap", type=int, default=1000,
                   help="bootstrap resamples of the classes and posthoc sections' CIs (default 1000)")
    p.add_argument("--out", default=None, help="output folder (default: <runs>/reports/<experiment>)")
    p.add_argument("--split", default="test", help="split whose final metrics are tabulated (default: test)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    p.add_argument("--no-log", action="store_true", help="do not log the report as an MLflow run")
    p.set_defaults(func=_report)

    p = subparsers.add_parser(
        "compare", help="paired bootstrap of two runs' predictions on the same cases: A - B with 95%% CIs",
        description="Paired bootstrap of metric(A) - metric(B) for two models scored on the same cases\n"
        "(resampled jointly). A and B are MLflow run IDs (their logged predictions/<split>_predictions.npz\n"
        "or .csv) or such files; they must hold the same cases with the same labels.",
        epilog="example:\n  lungcal compare <run A> <run B> --metrics auc ece brier",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A", help="run ID or predictions file of model A")
    p.add_argument("b", metavar="B", help="run ID or predictions file of model B")
    p.add_argument("--metrics", nargs="+", default=["auc", "ece"],
                   help="acc, auc, ece, nll, brier, mce, ... (default: auc ece)")
    p.add_argument("--split", default="test", help="split of a run's predictions (default: test)")
    p.add_argument("--n-bootstrap", type=int, default=2000, help="paired resamples (default 2000)")
    p.add_argument("--n-bins", type=int, default=None, help="ECE bins (default: 10 for binary CT, 15 otherwise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    p.set_defaults(func=_compare)

    p = subparsers.add_parser(
        "archive", help="keep runs' test predictions, config, commit and data hashes in a file each; check them",
        description="Write each run's split predictions (probabilities and labels, no identifiers), its params,\n"
        "its lungcal tags and commit, and the metrics it logged, into\n"
        "<DIR>/<experiment>_<stage1>_<stage2>_seed<s>_<id>.npz,\n"
        "so a results table can be recomputed after the run store is gone. --check recomputes every archive in\n"
        "DIR with the run's own bins, bootstrap and seed and compares with what the run logged (exit 1 if not).",
        epilog="examples:\n  lungcal archive <run id> <run id> --out docs/results/data/study\n"
        "  lungcal archive --experiment cifar10lt --tracking-uri sqlite:///runs/gpu_study/cifar10lt_ce.db --out DIR\n"
        "  lungcal archive --check docs/results/data/study",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", metavar="RUN", help="run IDs to archive")
    p.add_argument("--experiment", default=None, help="archive every finished run of this experiment that logged "
                   "predictions of the split")
    p.add_argument("--out", default=None, help="the folder the archives go to")
    p.add_argument("--split", default="test", help="split whose predictions are archived (default: test)")
    p.add_argument("--check", default=None, metavar="DIR", help="recompute and compare every archive in DIR")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    p.set_defaults(func=_archive)

    p = subparsers.add_parser(
        "uncertainty", help="compare single model, +TS, MC dropout, deep ensemble and ensemble+TS on CT",
        description="Train a deep ensemble with bundles/nlst_ensemble.json (or reuse one: --parent-run), then\n"
        "score on the same test CTs: member 0 (+TS), MC dropout of member 0 (+TS), the ensemble (+TS, pool\n"
        "then calibrate): ECE and AUC with CIs, NLL, Brier, AURC, mean entropy and MI, ΔECE against the\n"
        "single model, and the inference cost. Run from the project root.",
        epilog="examples:\n  lungcal uncertainty --members 3 --epochs 30 --output-dir runs/uncertainty\n"
        "  lungcal uncertainty --parent-run <id> --output-dir runs/uncertainty --shift-datalist siteB.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parent-run", default=None, help="reuse this ensemble parent run instead of training")
    p.add_argument("--members", type=int, default=3, help="ensemble size M when training (default 3)")
    p.add_argument("--epochs", type=int, default=30, help="epochs per member when training (bundle default 120)")
    p.add_argument("--mc-samples", type=int, default=20, help="MC-dropout passes (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-bootstrap", type=int, default=1000)
    p.add_argument("--datalist", default=None, help="datalist JSON (default: the synthetic demo cohort)")
    p.add_argument("--output-dir", default=None, help="output_dir of the runs (default: the bundle's)")
    p.add_argument("--shift-datalist", default=None,
                   help="also score this datalist's test split (another site), with nothing refitted")
    p.add_argument("--out", default=None, help="also write the Markdown table here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="any other bundle override, e.g. --set num_workers=4 (repeatable)")
    p.set_defaults(func=_uncertainty)


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
                       log_run=not args.no_log, sections=parse_sections(args.sections),
                       n_bootstrap=args.n_bootstrap)
    print(Path(str(res["markdown"])).read_text())
    print(f"wrote {res['markdown']}\n      {res['csv']}\n      {res['html']}")
    if res["run_id"]:
        print(f"logged as MLflow run {res['run_id']} (experiment {args.experiment})")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from lungcal.study.differences import compare_predictions, predictions_of

    a, b = (predictions_of(x, args.split, args.tracking_uri) for x in (args.a, args.b))
    res = compare_predictions(a, b, args.metrics, n_bootstrap=args.n_bootstrap, seed=args.seed, n_bins=args.n_bins)
    print(f"A = {args.a}\nB = {args.b}\n{res['n']} cases, {res['n_bins']} ECE bins, 95% paired-bootstrap CIs "
          f"({args.n_bootstrap} resamples)")
    for metric, d in res["diffs"].items():
        verdict = "" if d["significant"] else "  not significant"
        print(f"{metric}: A - B = {d['diff']:+.4f} [{d['ci_low']:+.4f}, {d['ci_high']:+.4f}]  p = {d['p_value']:.3g}"
              + verdict)
    return 0


def _archive(args: argparse.Namespace) -> int:
    from lungcal.errors import ConfigError
    from lungcal.study.archive import archive_run, check_archive
    from lungcal.tracking.tracker import default_tracking_uri, open_store

    if args.check:
        files = sorted(Path(args.check).glob("*.npz"))
        if not files:
            raise ConfigError(f"no archive (*.npz) in {args.check}", field="--check",
                              fix="write archives with lungcal archive RUN --out DIR")
        bad = 0
        for f in files:
            problems = check_archive(f)
            bad += bool(problems)
            print(f"{f.name}: " + ("reproduced" if not problems else "MISMATCH: " + "; ".join(problems)))
        print(f"{len(files) - bad} of {len(files)} archives reproduce their runs' logged metrics")
        return 1 if bad else 0
    if not args.out or not (args.runs or args.experiment):
        raise ConfigError("archive needs RUN ids or --experiment, and --out", field="--out",
                          fix="lungcal archive <run id> --out DIR, or lungcal archive --check DIR")
    client = open_store(args.tracking_uri or default_tracking_uri())
    runs = list(args.runs)
    if args.experiment:
        exp = client.get_experiment_by_name(args.experiment)
        if exp is None:
            raise ConfigError(f"no experiment {args.experiment!r} in the store", field="--experiment",
                              fix="pass --tracking-uri of the store that holds it")
        runs += [r.info.run_id for r in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
                 if any(k.startswith(f"{args.split}/") for k in r.data.metrics)]
    for run_id in runs:
        print(archive_run(client, run_id, args.out, args.split))
    return 0


def _uncertainty(args: argparse.Namespace) -> int:
    from lungcal.paths import atomic_write_text
    from lungcal.study.uncertainty import compare_uncertainty

    overrides: dict[str, object] = {}
    if args.datalist:
        overrides["datalist"] = str(Path(args.datalist).resolve())
    if args.output_dir:
        overrides["output_dir"] = str(Path(args.output_dir).resolve())
    for item in args.set:
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError(item)
            overrides[key.strip()] = json.loads(value)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise ConfigError(f"--set {item!r} is not KEY=JSON", field="--set",
                              fix="write e.g. --set num_workers=4 (strings in JSON quotes)") from exc
    text = compare_uncertainty(args.parent_run, members=args.members, epochs=args.epochs, mc_samples=args.mc_samples,
                               seed=args.seed, n_bootstrap=args.n_bootstrap, overrides=overrides,
                               shift_datalist=args.shift_datalist)
    print(text, flush=True)
    if args.out:
        atomic_write_text(Path(args.out), text + "\n")
    return 0
