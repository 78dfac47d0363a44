"""Site CTs without outcomes (``lungcal recalibrate --unlabelled``): a datalist or a folder of CTs.

Labels are not needed and, when a datalist has them, not read: the CTs only feed the EM estimate
of the site's prevalence (:func:`lungcal.calibration.prior.estimate_prior_em`). Rows get
positional pseudonyms (``u0000``...), since neither file names nor a site's subject ids may reach a
log.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from lungcal.ctapp.data.inputs import resolve_image
from lungcal.data.folder import CT_SUFFIXES, find_cts
from lungcal.errors import DataError

__all__ = ["CT_SUFFIXES", "unlabelled_rows"]


def _row(image: Path, i: int) -> dict:
    return {"image": str(image), "label": -1, "subject": f"u{i:04d}", "site": "unlabelled", "split": "test"}


def unlabelled_rows(path: str | os.PathLike) -> list[dict]:
    """Rows for the CTs of ``path``: a datalist JSON (``rows`` with an ``image`` each; any split,
    labels ignored) or a folder holding one NIfTI/MHD/NRRD file or DICOM series folder per CT (read as
    ``lungcal predict`` and ``lungcal qc`` read it: :func:`lungcal.data.folder.find_cts`; masks, label
    maps and other files are skipped).

    Raises:
        DataError: missing path, unreadable JSON, a row without an existing image, or no CT at all.
    """
    path = Path(path).expanduser()
    fix = "pass a datalist JSON whose rows name the site's CTs, or a folder with one CT (file or DICOM folder) each"
    if path.is_dir():
        return [_row(p, i) for i, p in enumerate(find_cts(path, field="--unlabelled").cts)]
    if not path.is_file():
        raise DataError("--unlabelled not found", file=path, field="--unlabelled", fix=fix)
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"not valid JSON ({exc})", file=path, field="--unlabelled", fix=fix) from None
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise DataError("the --unlabelled datalist has no images", file=path, field="rows", fix=fix)
    out = []
    for i, r in enumerate(rows):
        image = r.get("image") if isinstance(r, dict) else None
        if not image:
            raise DataError("a row has no 'image'", file=path, row=i, field="image", fix=fix)
        out.append(_row(resolve_image(image, path, i), i))
    return out
