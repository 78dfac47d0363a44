"""Hospital-site importer: a UPMC/UCD-style CSV -> datalist rows.

The CSV has a header with the columns ``subject_id, image, label`` and optionally ``split`` and
``study_date`` (other columns are ignored). ``study_date``, the CT's acquisition date (``YYYY-MM-DD`` or DICOM's
``YYYYMMDD``), is written to the row as ``YYYY-MM-DD`` for ``lungcal monitor``, which groups CTs by it; where the
CSV gives none and the CT is a DICOM series (or file), it is read from the series' DICOM ``StudyDate``
(:func:`dicom_study_date`: one header, pixels not read; a missing or malformed ``StudyDate`` leaves the row without
one). A date is a patient identifier, so it stays in the datalist (never logged, never in an error message; the
log counts the rows dated from DICOM, nothing more).

``image`` is a DICOM series folder, a NIfTI/MHD/MHA/NRRD file, or a case folder holding one CT file beside its
masks and annotations (read as ``lungcal qc`` reads a folder: :func:`lungcal.data.folder.case_ct`; the row
then names that CT file); relative paths resolve against the CSV's folder, absolute paths are kept, and
Windows backslashes (``scans\\ct01``) are read as folder separators.

CSVs as hospitals write them (:func:`read_csv_rows`): UTF-8, UTF-8 with a byte-order mark (Excel's
"CSV UTF-8"), UTF-16 with its mark (Excel's "Unicode text"), or Windows-1252 (Excel's plain "CSV" on
a Western-European Windows; read with a warning, as the encoding cannot be proven); the delimiter
is a comma, a semicolon (Excel where the decimal mark is a comma) or a tab, whichever splits the
header into the required columns. A file that is none of these encodings is one
:class:`~lungcal.errors.DataError` naming the line. ``label`` is 0 or 1. ``split`` (train/val/test)
is kept when given; subjects without one are split by patient, stratified by label, seeded.
``subject_id`` is replaced by a salted pseudonym (:func:`lungcal.data.splits.pseudonym`): the
real ID never reaches the datalist.
"""
from __future__ import annotations

import codecs
import csv
import io
import logging
import os
from collections.abc import Sequence
from datetime import date
from pathlib import Path

from lungcal.errors import DataError

from .folder import case_ct, dicom_study_date
from .manifest import save_manifest, validate_rows
from .splits import SPLITS, apply_splits, get_salt, pseudonym

__all__ = ["SITE_COLUMNS", "import_site", "read_csv_rows", "decode_csv", "site_path"]

log = logging.getLogger(__name__)

SITE_COLUMNS = ("subject_id", "image", "label")
DELIMITERS = (",", ";", "\t")
_DELIMITER_NAMES = {",": "comma", ";": "semicolon", "\t": "tab"}


def decode_csv(data: bytes, path: str | os.PathLike | None = None) -> tuple[str, str]:
    """Decode a CSV's bytes: ``(text, encoding)``.

    A byte-order mark decides (UTF-8 or UTF-16); otherwise strict UTF-8, then Windows-1252 with a
    warning. Bytes that are neither raise a :class:`DataError` naming the line.
    """
    if data.startswith(codecs.BOM_UTF8):
        return data[len(codecs.BOM_UTF8):].decode("utf-8", errors="strict"), "utf-8-sig"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16"), "utf-16"
        except UnicodeDecodeError as exc:
            raise _undecodable(data, exc, path, "UTF-16") from None
    try:
        return data.decode("utf-8", errors="strict"), "utf-8"
    except UnicodeDecodeError:
        pass
    try:
        text = data.decode("cp1252", errors="strict")
    except UnicodeDecodeError as exc:
        raise _undecodable(data, exc, path, "UTF-8 or Windows-1252") from None
    log.warning("%s is not UTF-8: read as Windows-1252 (cp1252), as Excel on Windows writes it; check accented "
                "names in the datalist, or save the CSV as 'CSV UTF-8'", Path(path).name if path else "the CSV")
    return text, "cp1252"


def _undecodable(data: bytes, exc: UnicodeDecodeError, path, tried: str) -> DataError:
    start = data.rfind(b"\n", 0, exc.start) + 1
    line = data.count(b"\n", 0, exc.start) + 1
    return DataError(f"line {line} is not {tried} text (byte 0x{data[exc.start]:02x} at character "
                     f"{exc.start - start + 1})", file=path, fix="save the file from Excel as 'CSV UTF-8'")


def _sniff(text: str, required: Sequence[str]) -> str:
    """The delimiter that splits the header into the required columns (else the one giving most)."""
    header = text.splitlines()[0] if text else ""
    best, best_n = ",", -1
    for delim in DELIMITERS:
        cols = [c.strip() for c in next(csv.reader([header], delimiter=delim), [])]
        if all(c in cols for c in required):
            return delim
        if len(cols) > best_n:
            best, best_n = delim, len(cols)
    return best


def site_path(value: str, base: Path) -> Path:
    """An image path from a site CSV: absolute kept, relative resolved against ``base``; Windows
    backslashes are folder separators (on POSIX)."""
    text = value.strip()
    if os.sep == "/" and "\\" in text:
        text = text.replace("\\", "/")
    p = Path(text).expanduser()
    return p if p.is_absolute() else base / p


def read_csv_rows(path: str | os.PathLike, required: Sequence[str]) -> list[dict]:
    """Read a CSV with a header into dicts (encoding and delimiter as hospitals write them, see the
    module docstring); DataError when the file, its encoding or a required column is wrong."""
    path = Path(path)
    if not path.is_file():
        raise DataError("CSV not found", file=path, fix="check the path")
    text, encoding = decode_csv(path.read_bytes(), path)
    delim = _sniff(text, required)
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delim)
    cols = [(c or "").strip() for c in (reader.fieldnames or [])]
    missing = [c for c in required if c not in cols]
    if missing:
        raise DataError(f"wrong columns: missing {missing}, found {cols}", file=path, field=missing[0],
                        fix=f"the header must contain {list(required)}, separated by commas, semicolons or tabs")
    rows = [{(k or "").strip(): (v or "").strip() for k, v in r.items() if not isinstance(v, list)} for r in reader]
    if not any(any(r.values()) for r in rows):
        raise DataError("the CSV has no data rows", file=path, fix="add one row per CT")
    log.debug("%s: %d rows, %s, %s-separated", path.name, len(rows), encoding, _DELIMITER_NAMES[delim])
    return rows


def _study_date(value: str, path: Path, i: int) -> str:
    """``YYYY-MM-DD`` from a CSV's ``YYYY-MM-DD`` or ``YYYYMMDD`` (the value itself is never echoed)."""
    text = value.strip()
    digits = text.replace("-", "") if len(text) == 10 and text[4] == "-" and text[7] == "-" else text
    try:
        if len(digits) != 8 or not digits.isdigit():
            raise ValueError
        return date(int(digits[:4]), int(digits[4:6]), int(digits[6:])).isoformat()
    except ValueError:
        raise DataError("study_date is not a date in the form YYYY-MM-DD or YYYYMMDD", file=path, row=i,
                        field="study_date", fix="write the CT's acquisition date as YYYY-MM-DD, or leave it empty"
                        ) from None


def _label(value: str, path: Path, i: int) -> int:
    if value not in ("0", "1"):
        raise DataError(f"label must be 0 or 1, got {value!r}", file=path, row=i, field="label",
                        fix="write 1 for a CT with cancer, 0 otherwise")
    return int(value)


def import_site(csv_path: str | os.PathLike, site: str, *, out: str | os.PathLike | None = None,
                salt: str | None = None, seed: int = 0, fractions: Sequence[float] = (0.6, 0.2, 0.2),
                check_files: bool = True, dicom_dates: bool = True) -> list[dict]:
    """Import a site CSV (``subject_id,image,label[,split][,study_date]``) as datalist rows.

    Args:
        csv_path: the CSV; relative image paths resolve against its folder.
        site: site name written into every row (e.g. ``"upmc"``).
        out: when given, also write the datalist there (``source = "site:<site>"``).
        salt: pseudonym salt (default :func:`~lungcal.data.splits.get_salt`).
        seed: split seed.
        fractions: train/val/test fractions for subjects without a split.
        check_files: check that every image exists.
        dicom_dates: fill ``study_date`` from a DICOM CT's ``StudyDate`` where the CSV gives none.

    Returns:
        validated rows ``{image (absolute), label, subject, site, split[, study_date]}``.

    Raises:
        DataError: missing CSV/columns, a label not 0/1, a bad split, a missing image, a
            duplicate row, a subject in two splits (each naming the CSV row and field).
    """
    path = Path(csv_path).absolute()
    if not site or not str(site).strip():
        raise DataError("the site name is empty", file=path, field="site", fix="pass a site name such as upmc")
    raw = read_csv_rows(path, SITE_COLUMNS)
    salt = get_salt() if salt is None else salt
    rows = []
    seen: dict[tuple[str, str], int] = {}
    from_dicom = 0
    for i, r in enumerate(raw):
        if not any(r.values()):  # a line of bare delimiters, as Excel leaves below the table
            continue
        if not r.get("subject_id"):
            raise DataError("empty subject_id", file=path, row=i, field="subject_id", fix="fill in the patient ID")
        if not r.get("image"):
            raise DataError("empty image path", file=path, row=i, field="image", fix="fill in the image path")
        img = site_path(r["image"], path.parent)
        key = (r["subject_id"], os.path.normpath(img))
        if key in seen:
            raise DataError(f"duplicate row: the same subject and image as row {seen[key]}", file=path, row=i,
                            field="image", fix="remove the repeated row")
        seen[key] = i
        if check_files and not img.exists():
            raise DataError(f"image not found: {img}", file=path, row=i, field="image",
                            fix="fix the path (relative paths resolve against the CSV's folder) or drop the row")
        try:
            img = case_ct(img)  # a case folder: the CT in it
        except DataError as exc:
            raise DataError(f"image {img}: {exc.message}", file=path, row=i, field="image", fix=exc.fix) from None
        split = r.get("split", "")
        if split and split not in SPLITS:
            raise DataError(f"split must be one of {list(SPLITS)} or empty, got {split!r}", file=path, row=i,
                            field="split", fix="use train, val, test, or leave it empty")
        row = {"image": str(img), "label": _label(r["label"], path, i),
               "subject": pseudonym(r["subject_id"], salt), "site": str(site), "split": split}
        if r.get("study_date"):
            row["study_date"] = _study_date(r["study_date"], path, i)
        elif dicom_dates:
            found = dicom_study_date(img)
            if found is not None:
                row["study_date"] = found
                from_dicom += 1
        rows.append(row)
    if from_dicom:
        log.info("%s: %d of %d rows dated from their DICOM StudyDate", path.name, from_dicom, len(rows))
    rows = apply_splits(rows, fractions, seed=seed, keep_existing=True) if any(not r["split"] for r in rows) else rows
    # a subject given two different splits in the CSV is caught here, naming the row
    rows = validate_rows(rows, file=path, check_files=False)
    if out is not None:
        save_manifest(rows, out, source=f"site:{site}")
    return rows
