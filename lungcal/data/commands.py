"""``lungcal synth | import-nlst | import-site | check-data`` (registered by :mod:`lungcal.cli`)."""
from __future__ import annotations

import argparse
import logging
from collections import Counter

from lungcal.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["register"]


def _floats(text: str, n: int, name: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{name} must be numbers separated by commas, got {text!r}", field=name,
                          fix=f"e.g. --{name} " + ",".join(["1"] * n)) from None
    if len(vals) == 1 and n == 3:
        vals = vals * 3
    if len(vals) != n:
        raise ConfigError(f"{name} needs {n} numbers, got {text!r}", field=name,
                          fix=f"pass {n} comma-separated numbers")
    return vals


#: one pinned scanner unless --scanner-mix: these flags' defaults (None on the parser, so that an explicit one is seen)
_PINNED_NOISE_HU, _PINNED_KERNEL_MM, _PINNED_SPACING = 20.0, 0.7, "2.5,2.5,2.5"
_PINS = ("noise_hu", "kernel_mm", "spacing")


def _cmd_synth(args) -> int:
    from .synthetic import ScannerProfile, make_cohort

    shape = tuple(int(v) for v in _floats(args.shape, 3, "shape"))
    pins = [k for k in _PINS if getattr(args, k) is not None]
    if args.scanner_mix and pins:
        flags = ", ".join("--" + k.replace("_", "-") for k in pins)
        raise ConfigError(f"{flags} pin one scanner, --scanner-mix draws each CT's scanner", field=pins[0],
                          fix=f"drop {flags} (the mix draws noise, kernel, pixel and slice sizes; --shape x 2.5 mm is "
                              "the field of view), or drop --scanner-mix")
    noise = _PINNED_NOISE_HU if args.noise_hu is None else float(args.noise_hu)
    kernel = _PINNED_KERNEL_MM if args.kernel_mm is None else float(args.kernel_mm)
    spacing = _PINNED_SPACING if args.spacing is None else str(args.spacing)
    scanner = ScannerProfile(site=args.site, noise_hu=noise, kernel_sigma_mm=kernel, hu_offset=args.hu_offset)
    path = make_cohort(args.out, n_subjects=args.n, prevalence=args.prevalence, seed=args.seed, shape=shape,
                       spacing=_floats(spacing, 3, "spacing"), formats=tuple(args.formats.split(",")),
                       scanner=scanner, scanner_mix=args.scanner_mix or None,
                       nodule_types=args.nodule_types, masses=args.masses, splits=_floats(args.splits, 3, "splits"),
                       dicom_splits=args.dicom_splits.split(",") if args.dicom_splits else None,
                       num_workers=args.workers)
    print(f"wrote {path}")
    return 0


def _cmd_import_nlst(args) -> int:
    from .nlst import import_nlst

    rows = import_nlst(args.tcia_root, args.clinical_csv, out=args.out, seed=args.seed,
                       fractions=_floats(args.splits, 3, "splits"), window_days=args.window_days)
    print(f"wrote {args.out}: {len(rows)} CTs, {sum(r['label'] for r in rows)} positive")
    return 0


def _cmd_import_site(args) -> int:
    from .sites import import_site

    rows = import_site(args.csv, args.site, out=args.out, seed=args.seed, fractions=_floats(args.splits, 3, "splits"))
    print(f"wrote {args.out}: {len(rows)} CTs, {sum(r['label'] for r in rows)} positive")
    return 0


def _range(values) -> str:
    if not values:
        return "-"
    cols = list(zip(*values))
    return " x ".join(f"{min(c):g}-{max(c):g}" for c in cols)


def _cmd_check_data(args) -> int:
    from .manifest import check_images, load_manifest

    rows = load_manifest(args.datalist)
    counts = Counter((r["split"], r["label"], r["site"]) for r in rows)
    print(f"{args.datalist}: {len(rows)} CTs, {len({r['subject'] for r in rows})} subjects")
    print(f"{'split':<6} {'label':>5} {'site':<16} {'CTs':>6}")
    for (split, label, site), n in sorted(counts.items()):
        print(f"{split:<6} {label:>5} {site:<16} {n:>6}")
    if args.no_images:
        return 0
    report = check_images(rows, progress=True, allow_gaps=args.allow_gaps)
    print(f"shape (voxels): {_range(report['shapes'])}")
    print(f"spacing (mm):   {_range(report['spacings'])}")
    if report["errors"]:
        print(f"{len(report['errors'])} unreadable image(s):")
        for i, msg in report["errors"]:
            print(f"  row {i}: {msg}")
        return 1
    print("all images readable")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the data commands to the ``lungcal`` parser."""
    p = subparsers.add_parser("synth", help="generate a synthetic chest-CT cohort (DICOM/NIfTI + datalist)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--n", type=int, default=200, help="number of subjects / CTs (default 200)")
    p.add_argument("--prevalence", type=float, default=0.4, help="P(cancer) (default 0.4; NLST-like 0.11)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="128,128,96", help="voxels X,Y,Z (default 128,128,96)")
    p.add_argument("--spacing", default=None, help="mm (default 2.5,2.5,2.5); pins one scanner's grid")
    p.add_argument("--formats", default="dicom,nifti",
                   help="dicom, nifti (.nii.gz) and/or nii (plain .nii, fastest to read); the datalist uses the first")
    p.add_argument("--dicom-splits", default=None, metavar="SPLITS",
                   help="write only these splits' CTs as DICOM series and the others in the NIfTI format of --formats "
                        "(e.g. --formats nii,dicom --dicom-splits test, as the built-in demo does)")
    p.add_argument("--site", default="synthetic", help="site name in the rows")
    p.add_argument("--noise-hu", type=float, default=None, help="image noise SD in HU (default 20); pins one scanner")
    p.add_argument("--kernel-mm", type=float, default=None,
                   help="reconstruction blur sigma in mm (default 0.7); pins one scanner")
    p.add_argument("--scanner-mix", default=None, metavar="NAME",
                   help="each CT draws its slice thickness, pixel size, kernel and noise from this mix of named "
                        "scanner profiles (four_vendors; lungcal/data/synthetic/scanners.py); default: one scanner")
    p.add_argument("--hu-offset", type=float, default=0.0, help="HU calibration offset")
    p.add_argument("--nodule-types", default="classic", metavar="MIX",
                   help="classic (default: the nodule model as it was), screening (solid, part-solid and ground-glass "
                        "nodules at screening frequencies) or even (a third each); "
                        "lungcal/data/synthetic/nodule_types.py, docs/phantoms.md")
    p.add_argument("--masses", type=float, default=0.0, metavar="P",
                   help="probability that a cancer is a 3-6 cm mass against the mediastinum or pleura (default 0)")
    p.add_argument("--splits", default="0.6,0.2,0.2", help="train,val,test fractions")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
    p.set_defaults(func=_cmd_synth)

    p = subparsers.add_parser("import-nlst", help="NLST TCIA tree + clinical CSV -> datalist (one row per screen)")
    p.add_argument("tcia_root", help="TCIA download folder (holding NLST/<pid>/...)")
    p.add_argument("clinical_csv", help="NLST participant CSV (pid, candx_days, fup_days, scr_days0-2)")
    p.add_argument("--out", required=True, help="datalist JSON to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--splits", default="0.6,0.2,0.2")
    p.add_argument("--window-days", type=int, default=365, help="label: cancer diagnosed within this many days")
    p.set_defaults(func=_cmd_import_nlst)

    p = subparsers.add_parser("import-site", help="site CSV (subject_id,image,label[,split]) -> datalist")
    p.add_argument("csv", help="site CSV; image paths relative to it")
    p.add_argument("--site", required=True, help="site name, e.g. upmc")
    p.add_argument("--out", required=True, help="datalist JSON to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--splits", default="0.6,0.2,0.2")
    p.set_defaults(func=_cmd_import_site)

    p = subparsers.add_parser("check-data", help="validate a datalist and open every image")
    p.add_argument("datalist")
    p.add_argument("--no-images", action="store_true", help="check the rows only")
    p.add_argument("--allow-gaps", action="store_true", help="interpolate across missing DICOM slices")
    p.set_defaults(func=_cmd_check_data)
