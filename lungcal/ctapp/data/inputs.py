"""What ``lungcal predict`` and ``bundles/inference.json`` score: CTs that need only an image.

``PATH`` is one of:

- a CT file or a folder, read by :func:`lungcal.data.folder.find_cts` exactly as ``lungcal qc`` reads
  it: a NIfTI / MHD / MHA / NRRD file, a DICOM series folder, or a folder holding them (a case
  folder as exported, or a folder of studies). A volume that is not a CT image (a nodule mask, a
  label map) and every other file (annotation XML, CSVs) are skipped and listed by name with why;
- a datalist JSON (``{"rows": [...]}`` or a plain list): each row needs only ``image`` (relative
  paths resolve against the datalist's folder); ``label``, ``site`` and ``split`` are not needed
  and not read; ``series_uid`` is kept.

Pseudonyms: files and folders get ``ct0000``, ``ct0001``... in sorted order (file names can hold
identifiers). A datalist row keeps its ``subject`` (datalists made by ``lungcal import-*`` hold
pseudonyms), or its ``ct`` key where a subject has several CTs; a row with neither gets the
positional name. :func:`write_key` writes the local key ``inputs.csv`` (pseudonym -> input path,
and what became of it: scored, refused and why, or skipped and why) beside the outputs; it is never
logged to MLflow.
"""
from __future__ import annotations

import csv
import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from lungcal.data.folder import CT_SUFFIXES, find_cts, is_dicom_folder
from lungcal.errors import DataError
from lungcal.paths import atomic_write

__all__ = ["CT_SUFFIXES", "KEY_FILE", "Inputs", "input_rows", "is_dicom_folder", "read_inputs", "write_key"]

#: the local key from pseudonym to input, written beside the outputs (never logged)
KEY_FILE = "inputs.csv"
_FIX = ("pass a NIfTI/MHD/NRRD file, a DICOM series folder, a folder with one such file or DICOM folder per CT, "
        "or a datalist JSON whose rows have an 'image'")


def _row(image: Path, subject: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"image": str(image), "label": -1, "subject": subject, "site": "inference", "split": "test",
            **(extra or {})}


class Inputs(NamedTuple):
    """What :func:`read_inputs` found: the scoring rows, and the skipped entries of a folder as
    ``(name, why)`` (:class:`lungcal.data.folder.Found`)."""

    rows: list[dict[str, Any]]
    skipped: list[tuple[str, str]]


def read_inputs(path: str | os.PathLike, field: str = "inputs") -> Inputs:
    """Scoring rows ``{"image", "subject" (pseudonym), "label": -1, "site", "split", [series_uid]}`` for
    ``path``, and what a folder held besides its CTs.

    Raises:
        DataError: a missing path, a file that is not a CT (naming what it is), a folder without a
            CT (listing what it holds), a datalist that does not parse, has no rows, or names an
            image that does not exist (naming the row).
    """
    path = Path(str(path)).expanduser()
    if path.is_dir() or not path.exists() or path.name.lower().endswith(CT_SUFFIXES):
        found = find_cts(path, field=field)
        return Inputs([_row(p, f"ct{i:04d}") for i, p in enumerate(found.cts)], found.skipped)
    return Inputs(_datalist_rows(path, field), [])


def input_rows(path: str | os.PathLike, field: str = "inputs") -> list[dict[str, Any]]:
    """The rows of :func:`read_inputs` (what a folder held besides its CTs is dropped)."""
    return read_inputs(path, field).rows


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


def write_key(rows: Sequence[Mapping[str, Any]], folder: str | os.PathLike,
              status: Mapping[str, str] | None = None, skipped: Sequence[tuple[str, str]] = (),
              source: str | os.PathLike | None = None) -> Path:
    """Write ``<folder>/inputs.csv`` (local only: it holds paths): ``pseudonym,image,series_uid,status``
    per row, ``status`` from ``status[pseudonym]`` (``scored``, ``refused: why``; ``pending`` when not
    given), then one line per ``skipped`` entry of the input folder ``source`` (no pseudonym,
    ``skipped: why``)."""
    path = Path(folder) / KEY_FILE
    status = status or {}
    with atomic_write(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["pseudonym", "image", "series_uid", "status"])
        for r in rows:
            w.writerow([r["subject"], r["image"], r.get("series_uid", ""), status.get(str(r["subject"]), "pending")])
        base = Path(str(source)).expanduser().absolute() if source is not None else None
        for name, why in skipped:
            w.writerow(["", str(base / name) if base is not None and base.is_dir() else name, "", f"skipped: {why}"])
    return path
