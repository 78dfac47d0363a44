"""What ``lungcal predict`` and ``bundles/inference.json`` score: CTs that need only an image.

``PATH`` is one of:

- one study: a NIfTI / MHD / MHA / NRRD file, or a DICOM series folder (a folder that holds DICOM
  files itself: ``*.dcm``, or files with the ``DICM`` preamble);
- a folder of studies: each such file or sub-folder directly inside it is one CT (hidden entries
  are skipped; sub-folders are read as DICOM series, recursively);
- a datalist JSON (``{"rows": [...]}`` or a plain list): each row needs only ``image`` (relative
  paths resolve against the datalist's folder); ``label``, ``site`` and ``split`` are not needed
  and not read; ``series_uid`` is kept.

Pseudonyms: files and folders get ``ct0000``, ``ct0001``... in sorted order (file names can hold
identifiers). A datalist row keeps its ``subject`` (datalists made by ``lungcal import-*`` hold
pseudonyms), or its ``ct`` key where a subject has several CTs; a row with neither gets the
positional name. :func:`write_key` writes the local key ``inputs.csv`` (pseudonym -> input path)
beside the outputs; it is never logged to MLflow.
"""
from __future__ import annotations

import csv
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from lungcal.errors import DataError
from lungcal.paths import atomic_write

__all__ = ["CT_SUFFIXES", "KEY_FILE", "input_rows", "is_dicom_folder", "write_key"]

CT_SUFFIXES = (".nii", ".nii.gz", ".mha", ".mhd", ".nrrd")
#: the local key from pseudonym to input, written beside the outputs (never logged)
KEY_FILE = "inputs.csv"
_FIX = ("pass a NIfTI/MHD/NRRD file, a DICOM series folder, a folder with one such file or DICOM folder per CT, "
        "or a datalist JSON whose rows have an 'image'")


def _row(image: Path, subject: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"image": str(image), "label": -1, "subject": subject, "site": "inference", "split": "test",
            **(extra or {})}


def _is_dicom_file(p: Path) -> bool:
    if p.suffix.lower() == ".dcm":
        return True
    if p.suffix:  # a named file type that is not DICOM (e.g. .json, .txt, .nii)
        return False
    try:
        with open(p, "rb") as fh:
            fh.seek(128)
            return fh.read(4) == b"DICM"
    except OSError:
        return False


def is_dicom_folder(path: str | os.PathLike) -> bool:
    """True when the folder holds DICOM files itself (one series: one study), not only sub-folders."""
    return any(p.is_file() and _is_dicom_file(p) for p in Path(path).iterdir() if not p.name.startswith("."))


def input_rows(path: str | os.PathLike, field: str = "inputs") -> list[dict[str, Any]]:
    """Scoring rows ``{"image", "subject" (pseudonym), "label": -1, "site", "split", [series_uid]}`` for ``path``.

    Raises:
        DataError: a missing path, a folder without a CT, a datalist that does not parse, has no
            rows, or names an image that does not exist (naming the row).
    """
    path = Path(str(path)).expanduser()
    if path.is_dir():
        if is_dicom_folder(path):
            return [_row(path.absolute(), "ct0000")]
        items = sorted(p for p in path.iterdir() if not p.name.startswith("."))
        cts = [p for p in items if p.is_dir() or p.name.lower().endswith(CT_SUFFIXES)]
        if not cts:
            raise DataError("no CT found in the folder", file=path, field=field,
                            fix="put one NIfTI/MHD/NRRD file or DICOM series folder per CT in it")
        return [_row(p.absolute(), f"ct{i:04d}") for i, p in enumerate(cts)]
    if not path.is_file():
        raise DataError("inputs not found", file=path, field=field, fix=_FIX)
    if path.name.lower().endswith(CT_SUFFIXES):
        return [_row(path.absolute(), "ct0000")]
    return _datalist_rows(path, field)


def resolve_image(image: Any, datalist: Path, row: int) -> Path:
    """A datalist row's ``image`` as an existing path; a relative one resolves against the datalist's folder."""
    p = Path(str(image)).expanduser()
    p = p if p.is_absolute() else datalist.parent.absolute() / p
    if not p.exists():
        raise DataError(f"image not found: {p}", file=datalist, row=row, field="image",
                        fix="fix the path (relative paths resolve against the datalist's folder) or drop the row")
    return p


def _datalist_rows(path: Path, field: str) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"not a CT and not a datalist JSON ({exc.__class__.__name__})", file=path, field=field,
                        fix=_FIX) from None
    rows = doc.get("rows") if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise DataError("the datalist has no rows", file=path, field="rows", fix=_FIX)
    subjects = Counter(str(r.get("subject")) for r in rows if isinstance(r, dict) and r.get("subject"))
    out = []
    for i, r in enumerate(rows):
        image = r.get("image") if isinstance(r, dict) else None
        if not image:
            raise DataError("a datalist row has no 'image'", file=path, row=i, field="image", fix=_FIX)
        p = resolve_image(image, path, i)
        subject = str(r.get("subject") or "")
        if not subject or subjects[subject] > 1:  # several CTs of one subject: their CT key
            subject = str(r.get("ct") or f"ct{i:04d}")
        extra = {k: r[k] for k in ("series_uid", "ct") if r.get(k)}
        out.append(_row(p, subject, extra))
    seen = Counter(r["subject"] for r in out)
    for i, r in enumerate(out):  # still repeated (the same CT twice): positional names keep outputs apart
        if seen[r["subject"]] > 1:
            r["subject"] = f"{r['subject']}_{i:04d}"
    return out


def write_key(rows: list[dict[str, Any]], folder: str | os.PathLike) -> Path:
    """Write ``<folder>/inputs.csv``: ``pseudonym,image[,series_uid]`` per row (local only: it holds paths)."""
    path = Path(folder) / KEY_FILE
    with atomic_write(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["pseudonym", "image", "series_uid"])
        for r in rows:
            w.writerow([r["subject"], r["image"], r.get("series_uid", "")])
    return path
