"""The series checks over a datalist, cached: which rows a run may use, and the ``qc.csv`` it logs.

Policy (issue 19): training and study datalists *skip* a series that fails a check
(:func:`skipped_table` says how many and why; :func:`write_qc_csv` writes the rows logged to
MLflow), scoring *refuses* it (:func:`refuse_failed`: one :class:`~lungcal.errors.DataError`
naming the pseudonym, the check and the measured value). Warnings never stop a run; they are
logged with the pseudonym, never the path.

Each CT is checked once: :func:`screen` stores a report per (source, ``series_uid``, thresholds,
lung masker, code of ``lungcal.ct``) as ``<sha256>.json`` in the cache folder (written
atomically; the name is a hash, no identifier), and a warm run reads it back. A row whose image
cannot be read at all gets no report: the bag builder then refuses it as before.

The report carries the CT's acquisition statistics (:mod:`lungcal.ct.acquisition`, measured on the
volume the checks read anyway; ``qc-v2`` on): :func:`acquisitions` hands them out per row, and
:meth:`lungcal.ctapp.data.cohort.CTCohort.acquisition_summary` summarises a split's for its run.
"""
from __future__ import annotations

import concurrent.futures as cf
import csv
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from lungcal.candidates.cache import hash_source
from lungcal.ct.acquisition import AcquisitionStats
from lungcal.ct.masking import LungMasker, Masker
from lungcal.ct.masking import __file__ as _ct_masking_file
from lungcal.ct.qc import QCCheck, QCConfig, QCReport, check_series
from lungcal.errors import DataError, LungcalError
from lungcal.paths import atomic_write, atomic_write_text

__all__ = ["QC_VERSION", "qc_key", "screen", "screen_one", "report_path", "read_report", "store_report",
           "skipped_table", "qc_csv_rows", "write_qc_csv", "refuse_failed", "log_warnings", "acquisitions"]

logger = logging.getLogger(__name__)

#: qc-v2: the report holds the acquisition statistics (qc-v1 entries are checked again)
QC_VERSION = "qc-v2"
QC_COLUMNS = ("pseudonym", "check", "verdict", "value")


def qc_key(source: str | os.PathLike, config: QCConfig, masker: Masker, series_uid: str | None = None) -> str:
    """sha256 naming the cached report of ``source`` under ``config`` and ``masker``."""
    config_of = getattr(masker, "config", None)  # LungMasker.config(); a plain function has none
    masker_cfg = config_of() if callable(config_of) else type(masker).__qualname__
    payload = {"version": QC_VERSION, "code": _ct_fingerprint(), "source": hash_source(source),
               "series_uid": series_uid or "", "config": dataclasses.asdict(config), "masker": masker_cfg}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def screen(rows: Sequence[Mapping[str, Any]], config: QCConfig | Mapping[str, Any] | None, cache_dir: str | os.PathLike,
           masker: Masker | None = None, num_workers: int = 0, progress: bool = True) -> list[QCReport | None]:
    """The :class:`QCReport` of every row (in order), from the cache or computed once and cached.

    ``None`` for a row whose image cannot be read (the bag builder reports that one).
    """
    cfg = QCConfig.from_any(config)
    masker = masker or LungMasker()
    root = Path(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    jobs = [(str(r["image"]), r.get("series_uid") or None) for r in rows]
    bar = tqdm(total=len(jobs), desc="series checks", unit="CT", disable=not progress or not jobs)
    try:
        if num_workers <= 0 or len(rows) <= 1:
            out = []
            for src, uid in jobs:
                out.append(screen_one(src, uid, cfg, masker, str(root)))
                bar.update(1)
            return out
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
        with cf.ProcessPoolExecutor(max_workers=num_workers, mp_context=ctx) as ex:
            results = ex.map(screen_one, *zip(*jobs), *([x] * len(jobs) for x in (cfg, masker, str(root))))
            out = []
            for rep in results:  # in order; the bar moves as they come
                out.append(rep)
                bar.update(1)
            return out
    finally:
        bar.close()


def skipped_table(rows: Sequence[Mapping[str, Any]], reports: Sequence[QCReport | None]) -> str:
    """``N of M CT(s) skipped`` and, per failed check, how many CTs failed it; empty when none failed."""
    failed = [rep for rep in reports if rep is not None and rep.failed]
    if not failed:
        return ""
    counts = Counter(c.name for rep in failed for c in rep.failed)
    width = max(len(n) for n in counts)
    lines = [f"series checks: {len(failed)} of {len(rows)} CT(s) skipped (failed a check; see qc.csv)",
             f"  {'check':<{width}}  CTs  reason (first)"]
    for name, n in counts.most_common():
        first = next(c for rep in failed for c in rep.failed if c.name == name)
        lines.append(f"  {name:<{width}}  {n:>3}  {first.reason} ({first.value})")
    return "\n".join(lines)


def keep_passing(rows: Sequence[Mapping[str, Any]], reports: Sequence[QCReport | None], title: str | None = None,
                 show: bool = True) -> tuple[list[Any], list[str]]:
    """What training, ``build-bags`` and ``recalibrate`` do with the reports: log the warnings, print
    the skipped table (under ``title`` when given; only when ``show``), and split the rows into those
    that failed no check and the pseudonyms of those that failed one."""
    log_warnings(rows, reports)
    table = skipped_table(rows, reports)
    if table and show:
        print(f"{title}:\n{table}" if title else table, flush=True)
    keep = [rep is None or not rep.failed for rep in reports]
    return ([r for r, k in zip(rows, keep) if k],
            [str(r.get("subject", "")) for r, k in zip(rows, keep) if not k])


def qc_csv_rows(rows: Sequence[Mapping[str, Any]], reports: Sequence[QCReport | None]) -> list[dict[str, str]]:
    """``pseudonym, check, verdict, value`` per check of every checked row (no paths, no reasons)."""
    out = []
    for i, (row, rep) in enumerate(zip(rows, reports)):
        if rep is not None:
            out += rep.as_rows(_pseudonym(row, i))
    return out


def acquisitions(reports: Sequence[QCReport | None]) -> list[AcquisitionStats | None]:
    """The acquisition statistics of each report (None where a row has no report or the report none)."""
    return [None if rep is None else rep.acquisition for rep in reports]


def write_qc_csv(path: str | os.PathLike, rows: Sequence[Mapping[str, str]]) -> Path:
    """Write :func:`qc_csv_rows` atomically."""
    path = Path(path)
    with atomic_write(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(QC_COLUMNS))
        w.writeheader()
        w.writerows(rows)
    return path


def refuse_failed(rows: Sequence[Mapping[str, Any]], reports: Sequence[QCReport | None]) -> None:
    """Raise a :class:`DataError` for the first row that failed a check: its pseudonym, the check,
    the measured value and the fix (never the path)."""
    for i, (row, rep) in enumerate(zip(rows, reports)):
        if rep is None or not rep.failed:
            continue
        first, rest = rep.failed[0], rep.failed[1:]
        also = f"; also failed: {', '.join(c.name for c in rest)}" if rest else ""
        raise DataError(f"subject {_pseudonym(row, i)} is not scored: series check '{first.name}' failed: "
                        f"{first.reason} (measured: {first.value}{also})", row=i, field=f"qc.{first.name}",
                        fix=first.fix or "remove this CT from the inputs (lungcal qc shows every check)")


#: above this many warnings, one summary line per check is logged (each CT's line goes to DEBUG)
MAX_WARNING_LINES = 10


def log_warnings(rows: Sequence[Mapping[str, Any]], reports: Sequence[QCReport | None]) -> int:
    """Log each warning with the row's pseudonym, or, when there are more than
    :data:`MAX_WARNING_LINES`, one line per check (count and first case; a site whose every scan has
    3 mm slices gets one line, not one per CT); return how many there were."""
    found = [(c, _pseudonym(row, i)) for i, (row, rep) in enumerate(zip(rows, reports))
             for c in (rep.warnings if rep is not None else ())]
    many = len(found) > MAX_WARNING_LINES
    for c, who in found:
        logger.log(logging.DEBUG if many else logging.WARNING, "series check %s warns for %s: %s (%s)",
                   c.name, who, c.reason, c.value)
    if many:
        for name, n in Counter(c.name for c, _ in found).most_common():
            c, who = next((c, w) for c, w in found if c.name == name)
            logger.warning("series check %s warns for %d of %d CT(s) (first: %s: %s (%s)); qc.csv and "
                           "`lungcal qc` list each", name, n, len(rows), who, c.reason, c.value)
    return len(found)


# --------------------------------------------------------------------------------------------
def _pseudonym(row: Mapping[str, Any], i: int) -> str:
    return str(row.get("subject") or f"row{i}")


@functools.lru_cache(maxsize=1)
def _ct_fingerprint() -> str:
    """sha256 of the source of ``lungcal.ct`` (reader, masker, checks): an edit re-runs the checks."""
    h = hashlib.sha256()
    for src in sorted(Path(_ct_masking_file).parent.glob("*.py")):
        if src.name not in ("__init__.py", "commands.py"):
            h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def screen_one(source: str, series_uid: str | None, cfg: QCConfig, masker: Masker, root: str) -> QCReport | None:
    """The cached report of one CT, computed and stored under ``root`` when missing (one task of
    :func:`screen`, and of ``lungcal build-bags`` on a cluster); ``None`` when the image cannot be read."""
    path = report_path(source, series_uid, cfg, masker, root)
    if path is None:
        return None  # a missing image: the bag builder names the row
    cached = read_report(path)
    if cached is not None:
        return cached
    try:
        report = check_series(source, config=cfg, masker=masker, series_uid=series_uid)
    except LungcalError:
        return None
    store_report(path, report)
    return report


def report_path(source: str, series_uid: str | None, cfg: QCConfig, masker: Masker, root: str | os.PathLike
                ) -> Path | None:
    """Where the report of ``source`` under ``cfg`` and ``masker`` is cached (None: the image is missing)."""
    try:
        return Path(root) / f"{qc_key(source, cfg, masker, series_uid)}.json"
    except OSError:
        return None


def read_report(path: Path) -> QCReport | None:
    """The cached report at ``path``; None when there is none (a corrupt or older entry counts as none)."""
    if not path.is_file():
        return None
    try:
        return _from_json(json.loads(path.read_text()))
    except ValueError as e:
        if str(e) != "old version":
            logger.warning("re-running the series checks of a corrupt cache entry %s", path.name)
    except (KeyError, TypeError):
        logger.warning("re-running the series checks of a corrupt cache entry %s", path.name)
    return None


def store_report(path: Path, report: QCReport) -> None:
    """Cache ``report`` at ``path`` atomically, without the path it was read from."""
    report.name = None  # never store the path
    atomic_write_text(path, json.dumps(_to_json(report), sort_keys=True))


def _to_json(report: QCReport) -> dict[str, Any]:
    return {"version": QC_VERSION, "checks": [dataclasses.asdict(c) for c in report.checks],
            "seconds": report.seconds, "lung_volume_ml": report.lung_volume_ml,
            "acquisition": None if report.acquisition is None else report.acquisition.as_dict()}


def _from_json(d: Mapping[str, Any]) -> QCReport:
    if d.get("version") != QC_VERSION:
        raise ValueError("old version")
    acq = d.get("acquisition")
    return QCReport([QCCheck(**c) for c in d["checks"]], seconds=float(d["seconds"]),
                    lung_volume_ml=d["lung_volume_ml"],
                    acquisition=None if acq is None else AcquisitionStats.from_dict(acq))
