"""``lungcal recalibrate``, ``lungcal cancers-needed``, ``lungcal site-check``, ``lungcal monitor``, ``lungcal
build-bags``, ``lungcal predict`` and ``lungcal lesion-bed``: the CT application's sub-commands.

Heavy imports (torch, MLflow, MONAI) happen inside the command, so ``lungcal --help`` stays fast
(the only function-local imports the lint contract allows). User errors are
:class:`lungcal.errors.LungcalError`; :mod:`lungcal.cli` prints them in one line.
"""
from __future__ import annotations

import argparse

from lungcal.ct.commands import add_qc_options, qc_config

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``recalibrate``, ``cancers-needed``, ``site-check``, ``monitor``, ``adapt-curve``, ``build-bags``,
    ``predict`` and ``lesion-bed`` to the ``lungcal`` parser."""
    _add_recalibrate(subparsers)
    _add_cancers_needed(subparsers)
    _add_site_check(subparsers)
    _add_monitor(subparsers)
    _add_adapt_curve(subparsers)
    _add_build_bags(subparsers)
    _add_predict(subparsers)
    _add_lesion_bed(subparsers)


def _add_recalibrate(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal recalibrate``: recalibrators fitted on a site's own CTs."""
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
    p.add_argument("--force", action="store_true",
                   help="with --prevalence/--unlabelled: go on although the site check (run first, on the val and "
                        "test CTs) found scanner_shift or could not run (too few CTs); the run is tagged "
                        "lungcal.forced_past_site_check and predict --site warns on every use")
    p.add_argument("--source-prevalence", default=None, metavar="P",
                   help="the prevalence the shipped model is calibrated to (default: read from the stage-1 run)")
    p.add_argument("--miss-rate", default=None, metavar="ALPHA",
                   help="also choose a decision threshold (work-up when p(cancer) >= it) on the val split whose "
                        "missed-cancer rate is at most ALPHA (e.g. 0.05) with probability --confidence over the "
                        "val draw (Learn-then-Test, exact binomial tail); reports its work-up rate on val and test "
                        "and the test sensitivity with a CI, and warns when it sends over 90%% of CTs to work-up; "
                        "`predict --site` applies it. Refused when val has too few cancers (`lungcal "
                        "cancers-needed`), or when its CTs trained the model or chose its checkpoint")
    p.add_argument("--confidence", default=None, metavar="1-DELTA",
                   help="the probability that the --miss-rate guarantee holds over the val draw (default: 0.9)")
    p.add_argument("--guarantee", default=None, choices=("ltt", "crc"),
                   help="ltt (default): the missed-cancer rate is at most ALPHA with probability --confidence; crc: "
                        "conformal risk control, at most ALPHA on average over val draws (a weaker promise, no "
                        "--confidence; it allows more misses, so fewer work-ups, from fewer cancers)")
    p.add_argument("--certify-split", default=None, choices=("val", "test"),
                   help="the split the --miss-rate threshold is chosen on (default: val). test: when the model's "
                        "checkpoint was chosen on val (the fine-tune route); no split is then left to check it")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and of the cross-validation folds")
    p.add_argument("--site", default=None, help="site name for the lungcal.site tag (default: from the datalist)")
    p.add_argument("--experiment", default="nlst", help="MLflow experiment to log into (default: nlst)")
    p.add_argument("--n-bins", type=int, default=10, help="ECE bins (default: 10, the study's CT setting)")
    p.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    p.add_argument("--output-dir", default=None, help="output folder for caches (default: ./runs or $LUNGCAL_HOME)")
    p.add_argument("--num-workers", type=int, default=0, help="parallel workers for bag building")
    p.add_argument("--no-qc", action="store_true",
                   help="score every CT, also those that fail a series check (default: leave them out, as training "
                        "does; inference refuses them)")
    add_qc_options(p)
    p.set_defaults(func=_recalibrate)


def _add_cancers_needed(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal cancers-needed``: the calibration cancers a guaranteed threshold needs."""
    n = subparsers.add_parser(
        "cancers-needed", help="how many labelled cancers a guaranteed threshold needs (recalibrate --miss-rate)",
        description="Print the table of the fewest cancers the certify split of `lungcal recalibrate --miss-rate` "
        "needs before a threshold that misses 0, 1, 2, ... of them can be certified: Learn-then-Test (the exact "
        "binomial tail, P(Bin(n, ALPHA) <= k) <= 1 - CONFIDENCE) per --miss-rate and --confidence, and conformal "
        "risk control ((k + 1) / (n + 1) <= ALPHA, on average). More allowed misses mean a higher threshold, so "
        "fewer work-ups. docs/hospital.md publishes the default table.")
    n.add_argument("--miss-rate", nargs="+", default=["0.05", "0.1"], metavar="ALPHA",
                   help="missed-cancer rates (default: 0.05 0.1)")
    n.add_argument("--confidence", nargs="+", default=["0.95", "0.9"], metavar="1-DELTA",
                   help="confidences of the Learn-then-Test guarantee (default: 0.95 0.9)")
    n.add_argument("--max-misses", type=int, default=3, metavar="K", help="columns 0..K missed cancers (default 3)")
    n.add_argument("--no-crc", action="store_true", help="leave out the conformal-risk-control rows")
    n.set_defaults(func=_cancers_needed)


def _add_site_check(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal site-check``: is a site the model's kind of data?"""
    c = subparsers.add_parser(
        "site-check", help="is a new site's data the model's kind of data? (verdict and the valid routes)",
        description="Compare a site's CTs (labels not needed) with a stage-1 model's training data: their "
        "acquisition (slice thickness, pixel size, HU of air, noise, sharpness) against the summary the run logged, "
        "and the model's outputs and embeddings against its validation split re-weighted to the prevalence "
        "estimated on the site (black-box shift detection, permutation p-values). Prints one verdict, "
        "comparable, prevalence_shift or scanner_shift, with the routes valid for it; logs an MLflow run (tag "
        "lungcal.site_check). Exit code 2 when too few CTs pass the series checks to tell.")
    c.add_argument("datalist", metavar="DATALIST_OR_FOLDER",
                   help="the site's datalist JSON (any splits; labels not needed) or a folder holding its CTs")
    c.add_argument("--run", required=True, metavar="ID", help="the stage-1 MLflow run id of the model")
    c.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON here")
    c.add_argument("--alpha", type=float, default=0.05,
                   help="false-alarm rate of a scanner_shift verdict on a same-scanner site (default 0.05)")
    c.add_argument("--site", default=None, help="site name for the lungcal.site tag (default: from the datalist)")
    c.add_argument("--reference", default=None, metavar="DATALIST",
                   help="for a run trained before site checks: the datalist it was trained on (its val split is "
                        "scored as the reference)")
    c.add_argument("--permutations", type=int, default=1000, help="permutations per test (default 1000)")
    c.add_argument("--seed", type=int, default=0, help="seed of the permutations and subsamples")
    add_qc_options(c)
    c.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    c.add_argument("--output-dir", default=None, help="output folder for caches (default: ./runs or $LUNGCAL_HOME)")
    c.add_argument("--num-workers", type=int, default=0, help="parallel workers for the series checks and bags")
    c.set_defaults(func=_site_check)


def _add_monitor(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal monitor``: a site's months after go-live."""
    mo = subparsers.add_parser(
        "monitor", help="follow a site after go-live, month by month: shifts, work-up, sensitivity with or "
        "without labels, alerts",
        description="Group a site's CTs by acquisition date (the datalist's study_date: YYYY-MM-DD or YYYYMMDD) into "
        "chunks (calendar months, or N CTs), score them with the model and the calibrator `lungcal recalibrate` "
        "stored at the site, and report per chunk: the site check against the site's calibration CTs and against "
        "the training data (verdict, effect size), the share of CTs out of distribution, the work-up rate at the "
        "site's threshold, the sensitivity estimated without labels (CBPE; valid only while the chunk is "
        "comparable, or prevalence_shift once prior-adjusted) and, where labels have arrived, the observed "
        "sensitivity, work-up rate, O/E and ECE with CIs. A chunk whose site check leaves comparable, or whose "
        "sensitivity falls below the site's promise, is an alert (printed, tagged lungcal.monitor_alerts). Rows "
        "without a usable date or image, CTs failing a series check and chunks too small to say anything are "
        "reported in one line each; the rest goes on. Chunks are named by ordinal, never by date; one MLflow run "
        "per pass with the picture.")
    mo.add_argument("datalist", metavar="DATALIST", help="the site's datalist JSON: rows with image, study_date and, "
                    "where it has arrived, label")
    mo.add_argument("--run", required=True, metavar="ID", help="the stage-1 MLflow run id of the model")
    mo.add_argument("--site", default=None, help="the site `lungcal recalibrate` was run for (default: the rows' site)")
    mo.add_argument("--chunk", default="month", metavar="month|N",
                    help="one chunk per calendar month (default), or per N CTs in date order (N >= 20)")
    mo.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON here")
    mo.add_argument("--alpha", type=float, default=0.05,
                    help="false-alarm rate of a scanner alert over a year of 12 chunks (each chunk: ALPHA/12)")
    mo.add_argument("--threshold", type=float, default=None,
                    help="the work-up threshold (default: the one recalibrate --miss-rate stored at the site)")
    mo.add_argument("--promise", type=float, default=None,
                    help="the promised sensitivity (default: 1 - the miss rate the site's guarantee allows)")
    mo.add_argument("--false-alarm-years", type=int, default=0, metavar="N",
                    help="also measure the alert rule's false-alarm rate over N simulated stable years (chunks "
                         "drawn from the site's calibration CTs; slow: minutes per 10 years)")
    mo.add_argument("--permutations", type=int, default=1000, help="permutations per test (raised as the level needs)")
    mo.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs")
    mo.add_argument("--seed", type=int, default=0, help="seed of the permutations, draws and bootstrap")
    add_qc_options(mo)
    mo.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    mo.add_argument("--output-dir", default=None, help="output folder for caches (default: ./runs or $LUNGCAL_HOME)")
    mo.add_argument("--num-workers", type=int, default=0, help="parallel workers for the series checks and bags")
    mo.set_defaults(func=_monitor)


def _add_adapt_curve(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal adapt-curve``: the adaptation routes against the number of labelled CTs."""
    a = subparsers.add_parser(
        "adapt-curve", help="how many labelled site CTs for which route? (recalibrate, fine-tune, from scratch)",
        description="On a labelled site datalist (train/val/test), draw nested stratified sets of N labelled CTs "
        "from train+val and score on the fixed test split: the model as shipped, recalibrated on the N CTs, "
        "fine-tuned on them (--init_run_id), and trained from scratch on them; test AUC, ECE, slope, intercept, "
        "O/E with 95%% CIs and the paired differences against the shipped model and between routes, over --draws "
        "repetitions (each its own draw and training seed; CIs over draws and test CTs). Logged as one MLflow run "
        "(tag lungcal.adaptation) with the curve's plot; each training route is its own stage-1 run.")
    a.add_argument("datalist", metavar="DATALIST", help="the site's labelled datalist (train, val and test splits)")
    a.add_argument("--run", required=True, metavar="ID", help="the shipped model's stage-1 MLflow run id")
    a.add_argument("--sizes", default="50,100,200,400", help="numbers of labelled site CTs (default 50,100,200,400)")
    a.add_argument("--routes", default="shipped,recalibrate,finetune,scratch",
                   help="which routes (default all four; shipped is always scored)")
    a.add_argument("--bundle", default="bundles/nlst_focal.json", help="the stage-1 bundle the training routes run")
    a.add_argument("--epochs", type=int, default=None, help="epochs of the training routes (default: the bundle's)")
    a.add_argument("--override", action="append", metavar="KEY=JSON", default=[],
                   help="a bundle key for the training routes, e.g. --override 'patch_size=8' (repeatable)")
    a.add_argument("--json", default=None, metavar="PATH", help="also write the curve as JSON here")
    a.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples for the CIs")
    a.add_argument("--seed", type=int, default=0,
                   help="seed of the draws, the trainings and the bootstrap (draw d uses seed + d)")
    a.add_argument("--draws", type=int, default=3,
                   help="repetitions per point, each its own draw of labelled CTs and training seed (default 3; "
                   "1: one draw, CIs over the test CTs only)")
    a.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    a.add_argument("--output-dir", default=None, help="output folder (default: ./runs or $LUNGCAL_HOME)")
    a.add_argument("--num-workers", type=int, default=0, help="parallel workers for bag building")
    a.set_defaults(func=_adapt_curve)


def _add_build_bags(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal build-bags``: the bag cache, built ahead (locally or on a Dask cluster)."""
    b = subparsers.add_parser(
        "build-bags", help="build the bag cache ahead of training (local processes or a Dask cluster)",
        description="Build every cached bag a training run of the bundle would build for DATALIST (the same "
        "preprocessing, lung masker, detector, spacing, HU window, K, patch size, series checks and output_dir), "
        "so the run then finds them all cached. Entries already built are kept; a row that fails does not stop "
        "the others and is reported with its pseudonym; the exit code is then 2.")
    b.add_argument("datalist", metavar="DATALIST", help="datalist JSON ('synthetic' for the built-in demo cohort)")
    b.add_argument("--params", required=True, nargs="+", metavar="BUNDLE_OR_JSON",
                   help="a CT bundle (run from the project root, e.g. bundles/nlst_focal.json) optionally followed "
                        "by override files merged over it; or one JSON of bag parameters (spacing, hu_window, "
                        "margin_mm, k, patch_size, detector, preprocess, harmonize_mm), as a stage-1 checkpoint "
                        "stores them")
    b.add_argument("--scheduler", default=None, metavar="local:N|tcp://HOST:8786",
                   help="run the tasks on Dask (pip install 'lungcal[cluster]'): local:N starts a LocalCluster of N "
                        "worker processes; tcp://HOST:8786 uses a running scheduler whose workers see the same "
                        "output_dir (shared filesystem) and run the same lungcal. Default: local processes")
    b.add_argument("--num-workers", type=int, default=None,
                   help="local processes without --scheduler (default: the bundle's num_workers; 0 = in-process)")
    b.add_argument("--output-dir", default=None,
                   help="output folder; bags go to <output_dir>/cache/bags (default: the bundle's, else ./runs or "
                        "$LUNGCAL_HOME)")
    b.add_argument("--splits", default="train,val,test", help="comma-separated splits to build (default: all)")
    b.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for a --scheduler address to answer (default: 10)")
    b.set_defaults(func=_build_bags)


def _add_predict(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal predict``: calibrated probabilities for new CTs."""
    q = subparsers.add_parser(
        "predict", help="score new CTs: calibrated probability, referral, top candidates, a picture per CT",
        description="Score one CT (a NIfTI/MHD/NRRD file or a DICOM series folder), a folder holding CTs (read as "
        "`lungcal qc` reads it: masks, label maps, XML and CSV files are skipped and listed by name), or a datalist "
        "(rows need only 'image') with a stage-1 model. Writes cases/<pseudonym>.json and .png per CT, "
        "predictions.csv, candidates/<pseudonym>.csv, qc.csv and the local key inputs.csv (pseudonym -> input "
        "file and what became of it; never logged), prints one line per CT, and records an MLflow run linked to the "
        "model's run (inputs count, QC summary, predictions, gallery). A CT that fails a series check, cannot be "
        "read or is too small is refused with its reason; the others are scored, and the exit code is then 2.")
    q.add_argument("path", metavar="PATH",
                   help="a CT file, a DICOM series folder, a folder holding CTs (a case folder), or a datalist JSON")
    q.add_argument("--run", required=True, metavar="ID", help="the stage-1 MLflow run id (or a checkpoint .pt)")
    q.add_argument("--site", default=None, help="apply the calibrator `lungcal recalibrate` stored for this site "
                   "(default: the run's reference calibrator), and its guaranteed decision threshold when it stored "
                   "one (--miss-rate): each CT is then called work-up or not, and its JSON states the guarantee")
    q.add_argument("--refer-below", type=float, default=None, metavar="C",
                   help="refer a CT whose confidence max(p, 1-p) is below C (default: the calibrator's validation "
                        "rule: the confidence below which its 10%% least confident validation cases fall)")
    q.add_argument("--output", default=None, help="output folder (default: <output_dir>/inference/<timestamp>)")
    q.add_argument("--no-pictures", action="store_true", help="skip the per-CT PNGs and the gallery")
    add_qc_options(q, legacy_qc=True)
    q.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the project's SQLite store)")
    q.add_argument("--output-dir", default=None, help="output folder for caches (default: ./runs or $LUNGCAL_HOME)")
    q.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    q.add_argument("--num-workers", type=int, default=0, help="parallel workers for bag building and checks")
    q.add_argument("--batch-size", type=int, default=16, help="CTs per forward pass")
    q.set_defaults(func=_predict)


def _add_lesion_bed(subparsers: argparse._SubParsersAction) -> None:
    """``lungcal lesion-bed``: lesions inserted into real CTs, and what each detector puts in the bag."""
    lb = subparsers.add_parser(
        "lesion-bed", help="insert lesions into real CTs and measure what reaches each detector's bag",
        description="Insert simulated lesions (solid, part-solid and ground-glass nodules of 4-30 mm, masses of "
        "30-70 mm; free in the lung, against the costal pleura, against the mediastinum, touching a vessel) into "
        "the real CTs of a folder (docs/phantoms.md: partial volume, a lift over the local tissue, the scan's "
        "measured point spread, its noise kept), run each inserted scan through the pipeline's preprocessing "
        "and each detector at each bag preset, and score every lesion: in the bag (a nodule's centre 5 mm inside "
        "a bag patch; a mass: a bag candidate on it), its rank, the candidates per CT. The CTs' own annotated "
        "lesions are scored as they are. Writes rows.csv and real.csv, prints the tables. A CT that cannot be "
        "read or fails a series check is skipped with its reason.")
    lb.add_argument("--backgrounds", required=True, metavar="DIR",
                    help="a folder of real chest CTs or of case folders (e.g. ../shared/data/ct); annotations "
                         "beside a CT (nodules_consensus.csv, luna16_annotation.csv, lesions.csv, tumor_bboxes.csv) "
                         "are its real lesions, which inserted ones keep clear of")
    lb.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                    help="only these cases (case folder names, or file names without suffix)")
    lb.add_argument("--per-cell", type=int, default=30, metavar="N",
                    help="lesions per kind x place, shared out over the backgrounds (default 30)")
    lb.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                    help="lesion kinds: solid part-solid ground-glass mass (default: all)")
    lb.add_argument("--places", nargs="+", default=None, metavar="PLACE",
                    help="places: free pleura mediastinum vessel (default: all)")
    lb.add_argument("--preset", nargs="+", default=None, metavar="NAME",
                    help="bag presets: default (2.5 mm voxels, K 16, P 16), fullres (1 mm, K 16, P 32); "
                         "default: default")
    lb.add_argument("--detector", action="append", default=None, metavar="NAME=SPEC",
                    help="a detector to score (repeatable): SPEC is {} (the solid LoG search, LoGBlobDetector), a "
                         "class path, a JSON object of its config, or a bundle JSON with a 'detector' section (e.g. "
                         "subsolid=bundles/nlst_subsolid.json); default: default=the CT bundles' detector "
                         "(LesionDetector)")
    lb.add_argument("--seed", type=int, default=0, help="seed of the lesions' kinds, sizes and places (default 0)")
    lb.add_argument("--out", default=None, metavar="DIR",
                    help="output folder (default: <output_dir>/lesion_bed/<timestamp>); must not hold a bed already")
    lb.add_argument("--write-scans", action="store_true",
                    help="also write each inserted scan (NIfTI, int16 HU) with truth.csv and datalist.json under "
                         "<out>/scans, so a site can run its own pipeline on them")
    lb.set_defaults(func=_lesion_bed)


def _cancers_needed(args: argparse.Namespace) -> int:
    from lungcal.calibration.guarantee import cancers_needed_table
    from lungcal.ctapp.site.threshold import check_levels

    for a in args.miss_rate:
        for c in args.confidence:
            check_levels(a, c)
    print(cancers_needed_table(tuple(float(a) for a in args.miss_rate), tuple(float(c) for c in args.confidence),
                               max_misses=args.max_misses, crc=not args.no_crc))
    return 0


def _recalibrate(args: argparse.Namespace) -> int:
    from lungcal.ctapp.site.recalibrate import DEFAULT_QC, format_summary, recalibrate

    qc = None if args.no_qc else (qc_config(args) if args.set else DEFAULT_QC)  # --set: the same syntax as qc
    res = recalibrate(args.model, args.datalist, method=args.method, prevalence=args.prevalence,
                      unlabelled=args.unlabelled, source_prevalence=args.source_prevalence, site=args.site,
                      experiment=args.experiment, n_bins=args.n_bins, n_bootstrap=args.n_bootstrap, seed=args.seed,
                      tracking_uri=args.tracking_uri, output_dir=args.output_dir, num_workers=args.num_workers,
                      qc=qc, miss_rate=args.miss_rate, confidence=args.confidence, guarantee=args.guarantee,
                      certify_split=args.certify_split, force=args.force)
    print(format_summary(res))
    return 0


def _site_check(args: argparse.Namespace) -> int:
    from lungcal.ctapp.site.site_check import format_report, site_check

    res = site_check(args.run, args.datalist, tracking_uri=args.tracking_uri, output_dir=args.output_dir,
                     json_path=args.json, alpha=args.alpha, site=args.site, reference=args.reference,
                     qc=qc_config(args), num_workers=args.num_workers, n_resamples=args.permutations, seed=args.seed)
    print(format_report(res))
    return 0


def _monitor(args: argparse.Namespace) -> int:
    from lungcal.ctapp.site.monitor import format_report, monitor

    res = monitor(args.run, args.datalist, site=args.site, chunk=args.chunk, json_path=args.json, alpha=args.alpha,
                  threshold=args.threshold, promise=args.promise, tracking_uri=args.tracking_uri,
                  output_dir=args.output_dir, qc=qc_config(args), num_workers=args.num_workers,
                  n_resamples=args.permutations, n_bootstrap=args.n_bootstrap,
                  false_alarm_years=args.false_alarm_years, seed=args.seed)
    print(format_report(res))
    return 0


def _overrides(items: list[str]) -> dict:
    import json

    from lungcal.errors import ConfigError

    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"bad --override {item!r}", field="--override", fix="use KEY=VALUE, e.g. patch_size=8")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def _adapt_curve(args: argparse.Namespace) -> int:
    from lungcal.ctapp.site.adaptation import adaptation_curve, format_curve
    from lungcal.errors import ConfigError

    try:
        sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"bad --sizes {args.sizes!r}", field="--sizes", fix="e.g. --sizes 50,100,200,400") from None
    routes = [x.strip() for x in str(args.routes).split(",") if x.strip()]
    curve = adaptation_curve(args.run, args.datalist, sizes=sizes, routes=routes, bundle=args.bundle,
                             overrides=_overrides(args.override), epochs=args.epochs, tracking_uri=args.tracking_uri,
                             output_dir=args.output_dir, n_bootstrap=args.n_bootstrap, seed=args.seed,
                             num_workers=args.num_workers, json_path=args.json, draws=args.draws)
    print(format_curve(curve))
    return 0


def _build_bags(args: argparse.Namespace) -> int:
    from lungcal.ctapp.data.bagbuild import LocalRunner, Runner, build_cohort, cohort_from_params
    from lungcal.errors import ConfigError

    splits = [s.strip() for s in str(args.splits).split(",") if s.strip()]
    cohort = cohort_from_params(args.params, args.datalist, output_dir=args.output_dir, num_workers=args.num_workers)
    runner: Runner
    if args.scheduler:
        try:
            from lungcal.ctapp.data.dask_bags import DaskRunner
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in ("dask", "distributed"):
                raise
            raise ConfigError("--scheduler needs Dask distributed, which is not installed", field="--scheduler",
                              fix="pip install 'lungcal[cluster]' (or drop --scheduler for local processes)") from None
        runner = DaskRunner(args.scheduler, timeout=args.connect_timeout)
    else:
        runner = LocalRunner(cohort.num_workers)
    with runner:
        report = build_cohort(cohort, splits, runner)
    print(report.summary(), flush=True)
    report.raise_for_failures()
    return 0


def _predict(args: argparse.Namespace) -> int:
    from lungcal.ctapp.infer.inference import InferenceRun

    qc = qc_config(args)  # --set NAME=VALUE (and the older --qc JSON), checked before anything loads
    InferenceRun(inputs=args.path, stage1_run_id=args.run, site=args.site, output=args.output,
                 output_dir=args.output_dir, tracking_uri=args.tracking_uri, device=args.device,
                 num_workers=args.num_workers, batch_size=args.batch_size, qc=qc,
                 refer_below=args.refer_below, pictures=not args.no_pictures, mode="predict").run()
    return 0


def _lesion_bed(args: argparse.Namespace) -> int:
    from lungcal.ctapp.evaluate.lesion_bed_run import format_report, run_lesion_bed

    run = run_lesion_bed(args.backgrounds, cases=args.cases, per_cell=args.per_cell, kinds=args.kinds,
                         places=args.places, presets=args.preset, detectors=args.detector, seed=args.seed,
                         out=args.out, write_scans=args.write_scans)
    print(format_report(run))
    return 0
