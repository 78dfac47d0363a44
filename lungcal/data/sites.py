"""Hospital-site importer: a UPMC/UCD-style CSV -> datalist rows.

The CSV has a header with the columns ``subject_id, image, label`` and optionally ``split``
(other columns are ignored). ``image`` is a DICOM series folder or a NIfTI/MHD/MHA/NRRD file;
relative paths resolve against the CSV's folder. ``label`` is 0 or 1. ``split`` (train/val/test)
is kept when given; subjects without one are split by patient, stratified by label, seeded.
``subject_id`` is replaced by a salted pseudonym (:func:`lungcal.data.splits.pseudonym`): the
real ID never reaches the datalist.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Sequence

from lungcal.errors import DataError

from .manifest import save_manifest, validate_rows
from .splits import SPLITS, apply_splits, get_salt, pseudonym

__all__ = ["SITE_COLUMNS", "import_site", "read_csv_rows"]

SITE_COLUMNS = ("subject_id", "image", "label")


def read_csv_rows(path: str | os.PathLike, required: Sequence[str]) -> list[dict]:
    """Read a CSV with a header into dicts; DataError when the file or a required column is missing."""
    path = Path(path)
    if not path.is_file():
        raise DataError("CSV not found", file=path, fix="check the path")
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        cols = [c.strip() for c in (reader.fieldnames or [])]
        missing = [c for c in required if c not in cols]
        if missing:
            raise DataError(f"wrong columns: missing {missing}, found {cols}", file=path, field=missing[0],
                            fix=f"the header must contain {list(required)}")
        rows = [{(k or "").strip(): (v or "").strip() for k, v in r.items()} for r in reader]
    if not rows:
        raise DataError("the CSV has no data rows", file=path, fix="add one row per CT")
    return rows


def _label(value: str, path: Path, i: int) -> int:
    if value not in ("0", "1"):
        raise DataError(f"label must be 0 or 1, got {value!r}", file=path, row=i, field="label",
                        fix="write 1 for a CT with cancer, 0 otherwise")
    return int(value)


def import_site(csv_path: str | os.PathLike, site: str, *, out: str | os.PathLike | None = None,
                salt: str | None = None, seed: int = 0, fractions: Sequence[float] = (0.6, 0.2, 0.2),
                check_files: bool = True) -> list[dict]:
    """Import a site CSV (``subject_id,image,label[,split]``) as datalist rows.

    Args:
        csv_path: the CSV; relative image paths resolve against its folder.
        site: site name written into every row (e.g. ``"upmc"``).
        out: when given, also write the datalist there (``source = "site:<site>"``).
        salt: pseudonym salt (default :func:`~lungcal.data.splits.get_salt`).
        seed: split seed.
        fractions: train/val/test fractions for subjects without a split.
        check_files: check that every image exists.

    Returns:
        validated rows ``{image (absolute), label, subject, site, split}``.

    Raises:
        DataError: missing CSV/columns, a label not 0/1, a bad split, a missing image, a
            duplicate row, a subject in two splits (each naming the CSV row and field).
    """
    path = Path(csv_path).absolute()
    if not site or not str(site).strip():
        raise DataError("the site name is empty", field="site", fix="pass a site name such as upmc")
    raw = read_csv_rows(path, SITE_COLUMNS)
    salt = get_salt() if salt is None else salt
    rows = []
    seen: dict[tuple[str, str], int] = {}
    for i, r in enumerate(raw):
        if not r.get("subject_id"):
            raise DataError("empty subject_id", file=path, row=i, field="subject_id", fix="fill in the patient ID")
        if not r.get("image"):
            raise DataError("empty image path", file=path, row=i, field="image", fix="fill in the image path")
        img = Path(r["image"]).expanduser()
        img = img if img.is_absolute() else path.parent / img
        key = (r["subject_id"], os.path.normpath(img))
        if key in seen:
            raise DataError(f"duplicate row: the same subject and image as row {seen[key]}", file=path, row=i,
                            field="image", fix="remove the repeated row")
        seen[key] = i
        if check_files and not img.exists():
            raise DataError(f"image not found: {img}", file=path, row=i, field="image",
                            fix="fix the path (relative paths resolve against the CSV's folder) or drop the row")
        split = r.get("split", "")
        if split and split not in SPLITS:
            raise DataError(f"split must be one of {list(SPLITS)} or empty, got {split!r}", file=path, row=i,
                            field="split", fix="use train, val, test, or leave it empty")
        rows.append({"image": str(img), "label": _label(r["label"], path, i),
                     "subject": pseudonym(r["subject_id"], salt), "site": str(site), "split": split})
    rows = apply_splits(rows, fractions, seed=seed, keep_existing=True) if any(not r["split"] for r in rows) else rows
    # a subject given two different splits in the CSV is caught here, naming the row
    rows = validate_rows(rows, file=path, check_files=False)
    if out is not None:
        save_manifest(rows, out, source=f"site:{site}")
    return rows
