"""``lungcal qc DATALIST_OR_PATH``: the series checks of every CT (registered by :mod:`lungcal.cli`).

A CT file or a folder is read as ``lungcal predict`` reads it (:func:`lungcal.data.folder.find_cts`:
the CTs in it get the same pseudonyms ``ct0000``...; masks, label maps and other files are listed
as skipped, by name, with why). Prints each CT's report (check, verdict, measured value, reason),
then a summary with the count of each failed check; ``--csv`` writes ``qc.csv`` (pseudonym, check,
verdict, value: no paths). Exit code 0 when no series failed (warnings allowed), 2 when any failed
or could not be read.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from lungcal.errors import ConfigError

if TYPE_CHECKING:
    from lungcal.ct.qc import QCConfig

__all__ = ["register", "parse_settings", "add_qc_options", "qc_settings", "qc_config"]

_ROW_FIELDS = ("pseudonym", "check", "verdict", "value")


def parse_settings(items: list[str] | None) -> dict:
    """``["max_slice_thickness_mm=2.5", ...]`` -> QCConfig keyword arguments (typed like the defaults)."""
    from .qc import QCConfig

    fields = {f.name: f.default for f in dataclasses.fields(QCConfig) if f.default is not dataclasses.MISSING}
    out = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ConfigError(f"bad --set {item!r}", field="qc",
                              fix=f"use --set NAME=VALUE with NAME one of {sorted(fields)}")
        kind = type(fields[name])
        try:
            out[name] = kind(text.strip())
        except ValueError:
            raise ConfigError(f"--set {name} needs a {kind.__name__}, got {text!r}", field=f"qc.{name}",
                              fix=f"e.g. --set {name}={fields[name]}") from None
    return out


_SET_HELP = ("a series-check threshold (a field of lungcal.ct.qc.QCConfig), e.g. --set max_slice_thickness_mm=3.5; "
             "repeatable; thresholds not set keep their documented defaults")
_QC_FIX = "use --set NAME=VALUE (repeatable), e.g. --set max_slice_thickness_mm=3.5"


def add_qc_options(parser: argparse.ArgumentParser, *, legacy_qc: bool = False) -> None:
    """The series-check thresholds of a command: ``--set NAME=VALUE``, repeatable (``lungcal qc`` and
    ``lungcal predict``). ``legacy_qc`` adds ``--qc JSON``, the form ``lungcal predict`` took before: a JSON
    object of the same fields, or the path of a JSON file holding one (a bundle's ``qc`` section, with its
    ``_target_``, is accepted as it is); ``--set`` applies over it. Read them back with :func:`qc_config`."""
    parser.add_argument("--set", action="append", metavar="NAME=VALUE", help=_SET_HELP)
    if legacy_qc:
        parser.add_argument("--qc", default=None, metavar="JSON",
                            help="the older form of --set, kept for scripts written before it: a JSON object of "
                                 "QCConfig fields ('{\"max_slice_thickness_mm\": 3.5}') or a JSON file holding one")


def _legacy_qc(text: str) -> dict:
    p = Path(text)
    source = p.read_text(encoding="utf-8") if not text.lstrip().startswith("{") and p.is_file() else text
    try:
        value = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--qc is neither a JSON object nor a JSON file ({exc.msg})", field="--qc",
                          fix=_QC_FIX) from None
    if not isinstance(value, dict):
        raise ConfigError("--qc must be a JSON object", field="--qc", fix=_QC_FIX)
    if str(value.get("_target_", "")).endswith("QCConfig"):  # a bundle's qc section, as it is
        value.pop("_target_")
    return value


def qc_settings(items: list[str] | None, legacy_qc: str | None = None) -> dict:
    """QCConfig keyword arguments: ``--set NAME=VALUE`` items (:func:`parse_settings`) over an older
    ``--qc`` JSON object or file (:func:`add_qc_options`)."""
    return {**(_legacy_qc(legacy_qc) if legacy_qc else {}), **parse_settings(items)}


def qc_config(args: argparse.Namespace) -> QCConfig:
    """The series-check thresholds a command line set with :func:`add_qc_options` (checked: unknown names,
    wrong types and thresholds out of order are a :class:`ConfigError`)."""
    from .qc import QCConfig

    return QCConfig.from_any(qc_settings(args.set, getattr(args, "qc", None)))


def _targets(target: str) -> tuple[list[dict], list[tuple[str, str]]]:
    """The rows to check and the skipped entries of a folder (``(name, why)``)."""
    from lungcal.data.folder import find_cts
    from lungcal.data.manifest import load_manifest

    p = Path(target)
    if p.is_file() and p.suffix.lower() == ".json":
        return load_manifest(p, check_files=False), []
    found = find_cts(p, field="target")
    return [{"image": str(c), "subject": f"ct{i:04d}"} for i, c in enumerate(found.cts)], found.skipped


def _cmd_qc(args) -> int:
    from lungcal.errors import LungcalError
    from lungcal.paths import atomic_write_text

    from .qc import check_series

    config = qc_config(args)
    rows, skipped = _targets(args.target)
    if args.series_uid and len(rows) > 1:
        raise ConfigError("--series-uid applies to a single DICOM folder", field="series_uid",
                          fix="put a series_uid column in the datalist rows instead")
    table: list[dict] = []
    verdicts: Counter = Counter()
    reasons: Counter = Counter()
    for r in rows:
        who = r.get("subject") or ""
        label = f"{who} {r['image']}".strip()
        try:
            report = check_series(r["image"], config=config, name=label,
                                  series_uid=args.series_uid or r.get("series_uid") or None)
        except LungcalError as exc:
            print(f"{label}: FAIL (cannot be read)\n  {exc}")
            verdicts["fail"] += 1
            reasons["unreadable"] += 1
            table.append({"pseudonym": who, "check": "read", "verdict": "fail", "value": "-"})
            continue
        print(report.format())
        verdicts[report.verdict] += 1
        reasons.update(c.name for c in report.failed)
        table += report.as_rows(who)
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    print(f"\n{len(rows)} CT(s): {verdicts['pass']} pass, {verdicts['warn']} warn, {verdicts['fail']} fail"
          + (f"; {len(skipped)} other file(s) skipped" if skipped else ""))
    for name, n in reasons.most_common():
        print(f"  {name:<16} failed {n}")
    if args.csv:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=_ROW_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(table)
        atomic_write_text(args.csv, buf.getvalue())
        print(f"wrote {args.csv}")
    return 2 if verdicts["fail"] else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``lungcal qc`` to the ``lungcal`` parser."""
    p = subparsers.add_parser("qc", help="series checks: is each CT a chest CT lungcal can score?",
                              description="Run the series checks (lungcal.ct.qc) on a datalist or one CT; "
                                          "exit code 2 when any series fails.")
    p.add_argument("target", metavar="DATALIST_OR_PATH",
                   help="a datalist JSON, a NIfTI/MHD/NRRD file, a DICOM series folder, or a folder holding them "
                        "(read as `lungcal predict` reads it: masks, label maps and other files are skipped)")
    add_qc_options(p)
    p.add_argument("--series-uid", default=None, help="DICOM folder with several series: the one to check")
    p.add_argument("--csv", default=None, help="write the qc.csv table (pseudonym, check, verdict, value)")
    p.set_defaults(func=_cmd_qc)
