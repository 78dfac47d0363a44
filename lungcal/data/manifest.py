"""Datalists (manifests): the validated list of CTs every later step reads.

A datalist file is JSON::

    {"version": 1, "source": "synthetic" | "nlst" | "site:<name>" | ..., "rows": [
        {"image": "dicom/S0a1b.../", "label": 0, "subject": "S0a1b...", "site": "synthetic",
         "split": "train"}, ...]}

``image`` is a DICOM series folder or a NIfTI/MHD/MHA/NRRD file; a relative path resolves
against the folder of the datalist file. ``label`` is 0 or 1, ``subject`` a salted pseudonym,
``split`` one of train/val/test. Rows may carry extra keys (``ct``, ...) which are kept.

Every check raises :class:`~lungcal.errors.DataError` naming the file, the row, the field and the
fix: a missing file, a label not in {0, 1}, duplicate rows (the same image twice), a subject in
two splits, an empty manifest, wrong or missing columns. Unreadable images are found by
``lungcal check-data`` (:func:`check_images`), which opens every image.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lungcal.ct.io import load_ct
from lungcal.errors import DataError, LungcalError

from .splits import SPLITS

__all__ = ["REQUIRED_KEYS", "MANIFEST_VERSION", "load_manifest", "save_manifest", "validate_rows",
           "rows_for_split", "check_images"]

REQUIRED_KEYS = ("image", "label", "subject", "site", "split")
MANIFEST_VERSION = 1


def _resolve(image: str, base: Path | None) -> str:
    p = Path(image).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    return str(p)


def validate_rows(rows: Sequence[dict], *, file: str | os.PathLike | None = None,
                  base: str | os.PathLike | None = None, check_files: bool = True) -> list[dict]:
    """Validate datalist rows and return them with ``image`` resolved against ``base``.

    Args:
        rows: the rows (dicts with at least :data:`REQUIRED_KEYS`).
        file: the datalist file, for error messages.
        base: folder relative image paths resolve against (default: as given).
        check_files: also check that each image path exists.

    Raises:
        DataError: empty manifest, wrong columns, bad label/split/subject, missing file, duplicate
            image, subject in two splits.
    """
    if not isinstance(rows, (list, tuple)) or len(rows) == 0:
        raise DataError("the manifest has no rows", file=file, field="rows",
                        fix="add at least one row, or regenerate the datalist")
    base_p = None if base is None else Path(base)
    out: list[dict] = []
    seen_image: dict[str, int] = {}
    subject_split: dict[str, tuple[str, int]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"a row must be an object with keys {list(REQUIRED_KEYS)}, got {type(row).__name__}",
                            file=file, row=i, fix="rewrite the row as a JSON object")
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise DataError(f"missing column(s) {missing}; a row needs {list(REQUIRED_KEYS)}", file=file, row=i,
                            field=missing[0], fix="add the missing keys (see docs/architecture.md, lungcal.data)")
        label = row["label"]
        if isinstance(label, bool) or not isinstance(label, int) or label not in (0, 1):
            raise DataError(f"label must be 0 or 1, got {label!r}", file=file, row=i, field="label",
                            fix="write the CT-level label as the integer 0 (no cancer) or 1 (cancer)")
        for key in ("image", "subject", "site"):
            if not isinstance(row[key], str) or not row[key].strip():
                raise DataError(f"{key} must be a non-empty string, got {row[key]!r}", file=file, row=i, field=key,
                                fix=f"fill in the {key}")
        if row["split"] not in SPLITS:
            raise DataError(f"split must be one of {list(SPLITS)}, got {row['split']!r}", file=file, row=i,
                            field="split", fix="assign the row to train, val or test")
        r = dict(row)
        r["image"] = _resolve(row["image"], base_p)
        key = os.path.normpath(r["image"])
        if key in seen_image:
            raise DataError(f"duplicate row: the same image as row {seen_image[key]}", file=file, row=i,
                            field="image", fix="remove one of the two rows")
        seen_image[key] = i
        prev = subject_split.get(r["subject"])
        if prev is not None and prev[0] != r["split"]:
            raise DataError(f"subject {r['subject']} is in split '{r['split']}' here and in '{prev[0]}' at row "
                            f"{prev[1]}", file=file, row=i, field="split",
                            fix="put all CTs of a subject in one split (splits are by patient)")
        subject_split.setdefault(r["subject"], (r["split"], i))
        if check_files and not Path(r["image"]).exists():
            raise DataError(f"image not found: {r['image']}", file=file, row=i, field="image",
                            fix="fix the path (relative paths resolve against the datalist's folder) or drop the row")
        out.append(r)
    return out


def load_manifest(path: str | os.PathLike, check_files: bool = True) -> list[dict]:
    """Read and validate a datalist JSON; image paths come back absolute.

    Raises:
        DataError: the file is missing or not JSON, has the wrong layout/version, or a row is bad
            (see :func:`validate_rows`).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError("datalist not found", file=path, fix="check the path, or create one with lungcal synth / "
                        "import-nlst / import-site")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"not valid JSON ({exc})", file=path, fix="repair or regenerate the datalist") from None
    if not isinstance(doc, dict) or "rows" not in doc:
        raise DataError("a datalist is an object with 'version', 'source' and 'rows'", file=path, field="rows",
                        fix="wrap the rows as {\"version\": 1, \"source\": ..., \"rows\": [...]}")
    if doc.get("version", MANIFEST_VERSION) != MANIFEST_VERSION:
        raise DataError(f"unsupported datalist version {doc.get('version')!r}", file=path, field="version",
                        fix=f"regenerate it with this lungcal (version {MANIFEST_VERSION})")
    return validate_rows(doc["rows"], file=path, base=path.parent.absolute(), check_files=check_files)


def manifest_source(path: str | os.PathLike) -> str:
    """The ``source`` field of a datalist file (``"unknown"`` when absent)."""
    return str(json.loads(Path(path).read_text()).get("source", "unknown"))


def save_manifest(rows: Iterable[dict], path: str | os.PathLike, source: str = "unknown", **meta: Any) -> Path:
    """Validate ``rows`` and write them atomically as a datalist JSON at ``path``.

    Image paths under the datalist's folder are written relative to it (so the folder can move);
    other paths stay absolute. Extra ``meta`` keys are stored at the top level.
    """
    path = Path(path).absolute()
    rows = validate_rows(list(rows), file=path, base=path.parent, check_files=False)
    out = []
    for r in rows:
        r = dict(r)
        img = Path(r["image"])
        try:
            r["image"] = img.relative_to(path.parent).as_posix() + ("/" if img.is_dir() else "")
        except ValueError:
            r["image"] = str(img)
        out.append(r)
    doc = {"version": MANIFEST_VERSION, "source": source, **meta, "rows": out}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def rows_for_split(rows: Sequence[dict], split: str) -> list[dict]:
    """The rows of one split (``train``, ``val`` or ``test``)."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}", field="split", fix=f"use one of {list(SPLITS)}")
    return [r for r in rows if r["split"] == split]


def check_images(rows: Sequence[dict], progress: bool = True, allow_gaps: bool = False) -> dict:
    """Open every image; return ``{"shapes", "spacings", "errors": [(row, message)]}``.

    Used by ``lungcal check-data``: an unreadable image does not stop the scan, it is listed.
    """


    shapes, spacings, errors = [], [], []
    for i, r in enumerate(tqdm(rows, desc="check-data", unit="ct", disable=not progress)):
        try:
            img = load_ct(r["image"], allow_gaps=allow_gaps)
        except LungcalError as exc:
            errors.append((i, str(exc)))
            continue
        except Exception as exc:  # anything a broken file can throw inside a reader
            errors.append((i, f"{r['image']}: unreadable image ({type(exc).__name__}: {exc})"))
            continue
        shapes.append(tuple(int(s) for s in img.shape[1:]))
        spacings.append(tuple(float(s) for s in np.asarray(img.pixdim)[:3]))
    return {"shapes": shapes, "spacings": spacings, "errors": errors}
