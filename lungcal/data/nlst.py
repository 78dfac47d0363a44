"""NLST importer: the TCIA tree plus the NLST clinical CSV -> one datalist row per screening CT.

Layout read (as TCIA's downloader writes it)::

    <tcia_root>/NLST/<pid>/<study>/<series>/*.dcm      (or <tcia_root>/<pid>/... directly)

The study folder name starts with TCIA's shifted study date, which codes the screening round:
``01-02-1999`` -> T0, ``01-02-2000`` -> T1, ``01-02-2001`` -> T2. Study folders with another date
are skipped (counted in the summary). Within a study the series folder with the most files is
used (TCIA usually holds one reconstruction per kernel; the loader still picks the axial CT
series inside the folder). A study folder without DICOM files (a converted tree) is read as
``lungcal qc`` reads a case folder (:func:`lungcal.data.folder.case_ct`): its one CT file, masks and
annotations beside it skipped; one holding no CT or several is skipped and counted.

The CT-level label (defined here, one year after the screen)
    ``label = 1`` when lung cancer was diagnosed within ``window_days`` (365) after that screen:
    ``0 <= candx_days - scr_days{T} <= window_days``. Otherwise ``label = 0`` **if** the participant
    was followed for at least ``window_days`` after the screen (``fup_days - scr_days{T} >=
    window_days``) or was diagnosed later than the window; else the CT is *censored* and dropped.
    A screen after the diagnosis (``candx_days < scr_days{T}``) is not a screening CT and is
    dropped. When ``scr_days{T}`` is missing, the nominal ``365 * T`` days is used.

Clinical CSV columns used: ``pid, candx_days, fup_days, scr_days0, scr_days1, scr_days2``
(empty or ``NA`` for missing). Participant IDs become salted pseudonyms; splits are by patient,
stratified, seeded.
"""
from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from lungcal.errors import DataError

from .folder import case_ct, holds_dicom
from .manifest import save_manifest, validate_rows
from .sites import read_csv_rows
from .splits import apply_splits, get_salt, pseudonym

__all__ = ["NLST_COLUMNS", "STUDY_YEAR_TO_ROUND", "nlst_label", "import_nlst"]

log = logging.getLogger(__name__)

NLST_COLUMNS = ("pid", "candx_days", "fup_days", "scr_days0", "scr_days1", "scr_days2")
STUDY_YEAR_TO_ROUND = {"1999": 0, "2000": 1, "2001": 2}
_STUDY_RE = re.compile(r"^(\d{2})-(\d{2})-(\d{4})")


def _num(value: str, path: Path, i: int, field: str) -> float | None:
    v = (value or "").strip()
    if v == "" or v.upper() in ("NA", "NAN", ".", "NULL"):
        return None
    try:
        return float(v)
    except ValueError:
        raise DataError(f"not a number: {v!r}", file=path, row=i, field=field,
                        fix="use a number of days, or leave it empty / NA") from None


def nlst_label(scr_day: float | None, round_: int, candx_days: float | None, fup_days: float | None,
               window_days: int = 365) -> int | None:
    """CT-level label of one screen (see the module docstring); ``None`` = censored / not a screen."""
    scr = 365.0 * round_ if scr_day is None else scr_day
    if candx_days is not None:
        delta = candx_days - scr
        if delta < 0:
            return None  # screen after the diagnosis
        if delta <= window_days:
            return 1
        return 0
    if fup_days is not None and fup_days - scr >= window_days:
        return 0
    return None


def _round_of(study_dir: Path) -> int | None:
    m = _STUDY_RE.match(study_dir.name)
    if not m or (m.group(1), m.group(2)) != ("01", "02"):
        return None
    return STUDY_YEAR_TO_ROUND.get(m.group(3))


def _best_series(study_dir: Path) -> Path | None:
    best, n_best = None, 0
    for series in sorted(p for p in study_dir.iterdir() if p.is_dir()):
        n = sum(1 for f in series.iterdir() if f.is_file())
        if n > n_best:
            best, n_best = series, n
    if best is None and any(f.is_file() for f in study_dir.iterdir()):
        return study_dir  # files directly in the study folder
    return best


def import_nlst(tcia_root: str | os.PathLike, clinical_csv: str | os.PathLike, *,
                out: str | os.PathLike | None = None, salt: str | None = None, seed: int = 0,
                fractions: Sequence[float] = (0.6, 0.2, 0.2), window_days: int = 365,
                progress: bool = True) -> list[dict]:
    """Import NLST: one row per screening CT with the one-year label (module docstring).

    Args:
        tcia_root: the TCIA download folder (holding ``NLST/`` or the participant folders).
        clinical_csv: the NLST participant CSV.
        out: when given, also write the datalist there (``source = "nlst"``).
        salt: pseudonym salt (default :func:`~lungcal.data.splits.get_salt`).
        seed: split seed.
        fractions: train/val/test fractions.
        window_days: the label window after a screen.
        progress: show a tqdm bar.

    Returns:
        validated rows ``{image, label, subject, site="nlst", split, ct, round}``; a summary of
        skipped studies is logged (counts only, no identifiers).

    Raises:
        DataError: missing folder/CSV/columns, a participant listed twice in the CSV, a bad number,
            or no usable screening CT at all.
    """

    root = Path(tcia_root)
    if (root / "NLST").is_dir():
        root = root / "NLST"
    if not root.is_dir():
        raise DataError("TCIA folder not found", file=tcia_root, fix="point to the folder holding NLST/<pid>/...")
    csv_path = Path(clinical_csv)
    table = read_csv_rows(csv_path, NLST_COLUMNS)
    clinical: dict[str, dict] = {}
    for i, r in enumerate(table):
        pid = r["pid"]
        if not pid:
            raise DataError("empty pid", file=csv_path, row=i, field="pid", fix="fill in the participant ID")
        if pid in clinical:
            raise DataError(f"participant listed twice (also row {clinical[pid]['row']})", file=csv_path, row=i,
                            field="pid", fix="keep one row per participant")
        clinical[pid] = {"row": i, **{k: _num(r[k], csv_path, i, k) for k in NLST_COLUMNS[1:]}}
    salt = get_salt() if salt is None else salt
    skipped: Counter = Counter()
    rows = []
    pids = sorted(p for p in root.iterdir() if p.is_dir())
    for pdir in tqdm(pids, desc="import-nlst", unit="patient", disable=not progress):
        c = clinical.get(pdir.name)
        if c is None:
            skipped["participant not in the clinical CSV"] += 1
            continue
        subject = pseudonym(pdir.name, salt)
        for study in sorted(p for p in pdir.iterdir() if p.is_dir()):
            t = _round_of(study)
            if t is None:
                skipped["study date code not 01-02-1999/2000/2001"] += 1
                continue
            if holds_dicom(study) or not any(p for p in study.iterdir() if not p.name.startswith(".")):
                series = _best_series(study)
            else:  # a converted tree: the CT file of the study folder, as lungcal qc reads a case folder
                try:
                    series = case_ct(study)
                except DataError as exc:
                    skipped["study folder without one CT (" + exc.message.split(";")[0].split(" (")[0] + ")"] += 1
                    continue
            if series is None:
                skipped["empty study folder"] += 1
                continue
            label = nlst_label(c[f"scr_days{t}"], t, c["candx_days"], c["fup_days"], window_days)
            if label is None:
                skipped["censored or screen after diagnosis"] += 1
                continue
            rows.append({"image": str(series.absolute()), "label": label, "subject": subject, "site": "nlst",
                         "split": "", "ct": f"{subject}_T{t}", "round": t})
    for reason, n in sorted(skipped.items()):
        log.info("import-nlst: skipped %d: %s", n, reason)
    if not rows:
        raise DataError("no usable screening CT found", file=tcia_root,
                        fix="check the tree layout NLST/<pid>/<01-02-YYYY...>/<series>/*.dcm and that the pids "
                            "match the clinical CSV")
    rows = apply_splits(rows, fractions, seed=seed, keep_existing=False)
    rows = validate_rows(rows, file=csv_path, check_files=False)
    if out is not None:
        save_manifest(rows, out, source="nlst", window_days=window_days)
    return rows
