"""``lungcal recalibrate``: the CT engine's command-line sub-command.

Heavy imports (torch, MLflow, MONAI) happen inside the command, so ``lungcal --help`` stays fast
(the only function-local imports the lint contract allows). User errors are
:class:`lungcal.errors.LungcalError`; :mod:`lungcal.cli` prints them in one line.
"""
from __future__ import annotations

import argparse

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recalibrate`` to the ``lungcal`` parser."""
    p = subparsers.add_parser(
        "recalibrate", help="fit recalibrators on a site's own validation split (no retraining)",
        description="Load a stage-1 model (MLflow run id or checkpoint), fit recalibrators on the site's "
        "validation split only (and/or adjust to the site's prevalence), and report each on the test split: "
        "ECE, calibration slope and intercept, O/E, AUC and ACC with 95% CIs, and p(calibrated). The chosen "
        "calibrator is stored on an MLflow run; `inference.json --site NAME` applies it.")
    p.add_argument("--model", required=True, help="stage-1 MLflow run id, or a checkpoint file (.pt)")
    p.add_argument("--datalist", required=True, help="the site's datalist JSON (with train/val/test splits)")
    p.add_argument("--method", default="auto", metavar="{ts,platt,vector,isotonic,histogram,auto,prior}",
                   help="the calibrator to fit and store (default: auto = the best of ts/platt/isotonic by "
                        "5-fold cross-validated NLL on the val split; prior = store the prior adjustment)")
    p.add_argument("--prevalence", default=None, metavar="P",
                   help="the site's known prevalence (fraction of cancers, in (0, 1)): adds a row with the shipped "
                        "probabilities re-weighted to it (no labels needed)")
    p.add_argument("--unlabelled", default=None, metavar="DATALIST",
                   help="site CTs without outcomes (a datalist or a folder of CTs): adds a row re-weighted to the "
                        "prevalence estimated on them by EM (Saerens et al. 2002)")
    p.add_argument("--source-prevalence", default=None, metavar="P",
                   help="the prevalence the shipped model is calibrated to (default: read from the stage-1 run)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and of the cross-validation folds")
    p.add_argument("--site", default=None, help="site name for the lungcal.site tag (default: from the datalist)")
    p.add_argument("--experiment", default="nlst", help="MLflow experiment to log into (default: nlst)")
    p.add_argument("--n-bins", type=int, default=10, help="ECE bins (default: 10, the study's CT setting)")
    p.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    p.add_argument("--output-dir", default=None, help="output folder for caches (default: ./runs or $LUNGCAL_HOME)")
    p.add_argument("--num-workers", type=int, default=0, help="parallel workers for bag building")
    p.set_defaults(func=_recalibrate)


def _recalibrate(args: argparse.Namespace) -> int:
    from lungcal.engine.recalibrate import format_summary, recalibrate

    res = recalibrate(args.model, args.datalist, method=args.method, prevalence=args.prevalence,
                      unlabelled=args.unlabelled, source_prevalence=args.source_prevalence, site=args.site,
                      experiment=args.experiment, n_bins=args.n_bins, n_bootstrap=args.n_bootstrap, seed=args.seed,
                      tracking_uri=args.tracking_uri, output_dir=args.output_dir, num_workers=args.num_workers)
    print(format_summary(res))
    return 0
