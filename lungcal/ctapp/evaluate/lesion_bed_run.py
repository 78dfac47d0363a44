"""``lungcal lesion-bed``: the lesion test bed (:mod:`lungcal.ctapp.evaluate.lesion_bed`) as a command.

:func:`find_backgrounds` reads the backgrounds: every CT a folder holds (as ``lungcal qc`` reads a
folder, :func:`lungcal.data.folder.find_cts`: a folder of case folders such as ``../shared/data/ct``, or
of CT files), each with the real lesions annotated beside it (:func:`~lungcal.ctapp.evaluate.lesion_bed.
real_lesions`); a CT the pipeline would refuse (unreadable, or failing a series check with the default
thresholds) is skipped with its reason, as training skips it. :func:`run_lesion_bed` inserts lesions into
them and scores every detector at every preset (:func:`~lungcal.ctapp.evaluate.lesion_bed.bed_rows`,
with a progress bar), scores the backgrounds' own lesions (:func:`~lungcal.ctapp.evaluate.lesion_bed.
score_real`), and writes into the output folder:

- ``rows.csv``: one row per inserted lesion, preset and detector (kind, place, size, rank, in the bag,
  candidates, the share of the lesion inside the lung mask, detection seconds);
- ``real.csv``: the same for the real lesions;
- with ``write_scans``, ``scans/``: each inserted scan as NIfTI with ``truth.csv`` and ``datalist.json``
  (:func:`lungcal.data.synthetic.insertion.write_lesion_bed`), for a site's own pipeline.

:func:`format_report` gives the tables the command prints. User errors (a folder with no usable CT, an
unknown kind, place, preset or detector) are :class:`lungcal.errors.LungcalError`.
"""
from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monai.bundle import ConfigParser
from tqdm.auto import tqdm

from lungcal.candidates.detector_config import detector_config, detector_from_config
from lungcal.ct.qc import check_series
from lungcal.ctapp.evaluate.lesion_bed import (
    HU_WINDOW,
    PRESETS,
    Preset,
    RealLesion,
    bed_rows,
    real_lesions,
    score_real,
    sensitivity_table,
    summary,
)
from lungcal.data.folder import CT_SUFFIXES, find_cts
from lungcal.data.synthetic.insertion import (
    KINDS,
    PLACES,
    Background,
    InsertedLesion,
    load_background,
    write_lesion_bed,
)
from lungcal.errors import ConfigError, DataError, LungcalError
from lungcal.paths import atomic_write_text, default_output_dir

__all__ = ["BedRun", "REAL_FIELDS", "cells_of", "detectors_of", "find_backgrounds", "format_report", "presets_of",
           "run_lesion_bed"]

#: the annotation files :func:`~lungcal.ctapp.evaluate.lesion_bed.real_lesions` reads
_ANNOTATIONS = ("nodules_consensus.csv", "luna16_annotation.csv", "lesions.csv", "tumor_bboxes.csv")
_DETECTOR_FIX = ("use NAME=SPEC with SPEC {} (the bundles' LoG detector), a class path "
                 "(lungcal.candidates.subsolid.SubsolidLoGDetector), a JSON object of a detector config, or a JSON "
                 "file holding a 'detector' section (bundles/nlst_subsolid.json)")


@dataclass
class BedRun:
    """What :func:`run_lesion_bed` did: the rows, the real-lesion rows, where they went, what was skipped."""

    rows: list[dict[str, Any]]
    real: list[dict[str, Any]]
    out: Path
    backgrounds: list[str]
    skipped: list[str] = field(default_factory=list)
    requested: int = 0
    seconds: float = 0.0
    truth: Path | None = None


def cells_of(kinds: Sequence[str] | None, places: Sequence[str] | None, per_cell: int) -> dict[tuple[str, str], int]:
    """``{(kind, place): per_cell}`` for every kind and place asked (default: all)."""
    kinds = list(kinds or KINDS)
    places = list(places or PLACES)
    for name, got, known in (("--kinds", kinds, KINDS), ("--places", places, PLACES)):
        bad = [x for x in got if x not in known]
        if bad:
            raise ConfigError(f"unknown {name[2:-1]} {', '.join(map(repr, bad))}", field=name,
                              fix=f"use any of {' '.join(known)}")
    if per_cell < 1:
        raise ConfigError(f"--per-cell must be at least 1, got {per_cell}", field="--per-cell",
                          fix="e.g. --per-cell 30 (the issue's tables use at least 30 lesions per cell)")
    return {(k, p): int(per_cell) for k in dict.fromkeys(kinds) for p in dict.fromkeys(places)}


def presets_of(names: Sequence[str] | None) -> list[Preset]:
    """The bag presets named (default: ``default``)."""
    names = list(names or ["default"])
    bad = [n for n in names if n not in PRESETS]
    if bad:
        raise ConfigError(f"unknown preset {', '.join(map(repr, bad))}", field="--preset",
                          fix=f"use any of {' '.join(PRESETS)} ({'; '.join(_describe(p) for p in PRESETS.values())})")
    return [PRESETS[n] for n in dict.fromkeys(names)]


def _describe(p: Preset) -> str:
    return f"{p.name}: {p.spacing:g} mm voxels, K {p.k}, P {p.patch_size}"


def _detector_spec(name: str, spec: str) -> dict[str, Any]:
    """One ``--detector NAME=SPEC``'s config (see ``_DETECTOR_FIX``)."""
    text = spec.strip()
    path = Path(text).expanduser()
    if text.startswith("{"):
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--detector {name}: not a JSON object ({exc.msg})", field="--detector",
                              fix=_DETECTOR_FIX) from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"--detector {name}: not a JSON object", field="--detector", fix=_DETECTOR_FIX)
    elif text.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"--detector {name}: file not found", file=path, field="--detector", fix=_DETECTOR_FIX)
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--detector {name}: cannot read it as JSON ({exc})", file=path, field="--detector",
                              fix=_DETECTOR_FIX) from None
        if not isinstance(content, dict):
            raise ConfigError(f"--detector {name}: not a JSON object", file=path, field="--detector",
                              fix=_DETECTOR_FIX)
        if "detector" not in content:  # a detector config on its own
            cfg = content
        else:  # a bundle or an override file: its section, its @references resolved (hu_window: the bundles')
            parser = ConfigParser({"hu_window": list(HU_WINDOW), **content})
            try:
                cfg = detector_config(parser.get_parsed_content("detector"))
            except LungcalError:
                raise
            except Exception as exc:  # MONAI wraps what the constructor raises
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise ConfigError(f"--detector {name}: its 'detector' section could not be built "
                                  f"({type(exc).__name__}: {first})", file=path, field="detector",
                                  fix=_DETECTOR_FIX) from None
    elif text and all(part.isidentifier() for part in text.split(".")) and "." in text:
        cfg = {"_target_": text}
    else:
        raise ConfigError(f"--detector {name}={spec!r} is neither JSON, a JSON file nor a class path",
                          field="--detector", fix=_DETECTOR_FIX)
    detector_from_config(dict(cfg), field="--detector")  # builds it once: an unknown class or argument fails here
    return dict(cfg)


#: the CT bundles' detector section (bundles/nlst_focal.json; its ``hu_window`` is the bundles', the default)
DEFAULT_DETECTOR = {"_target_": "lungcal.candidates.lesions.LesionDetector"}


def detectors_of(items: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """``["NAME=SPEC", ...]`` -> ``{NAME: detector config}`` (default ``{"default": <the CT bundles' detector>}``,
    :data:`DEFAULT_DETECTOR`)."""
    if not items:
        return {"default": dict(DEFAULT_DETECTOR)}
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"bad --detector {item!r}", field="--detector", fix=_DETECTOR_FIX)
        if name in out:
            raise ConfigError(f"--detector {name} given twice", field="--detector",
                              fix="give each detector its own name")
        out[name] = _detector_spec(name, spec)
    return out


def _case_of(ct: Path, root: Path) -> tuple[str, Path | None]:
    """A CT's name (its case folder's, or the file's without suffix) and the folder its annotations are in."""
    try:
        parts = ct.relative_to(root).parts
    except ValueError:
        parts = ()
    if len(parts) > 1:  # inside a case folder: the annotations lie in it (beside dicom/ or ct.nii.gz)
        case = root / parts[0]
        holder = next((d for d in (ct, ct.parent, case) if d.is_dir() and any((d / a).is_file() for a in _ANNOTATIONS)),
                      None)
        return parts[0], holder
    name = ct.name
    for suffix in CT_SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name, (ct if ct.is_dir() and any((ct / a).is_file() for a in _ANNOTATIONS) else None)


def find_backgrounds(folder: str | Path, cases: Sequence[str] | None = None, qc: bool = True
                     ) -> tuple[list[tuple[Background, list[RealLesion]]], list[str]]:
    """The usable backgrounds of ``folder`` (read, with their real lesions) and a line per CT skipped.

    Raises:
        DataError: the folder does not exist or holds no CT, a named case is not in it, or no CT in it
            can be used (each one's reason is named).
    """
    root = Path(str(folder)).expanduser()
    if not root.is_dir():
        raise DataError("not a folder", file=root, field="--backgrounds",
                        fix="point at a folder of CTs or of case folders (e.g. ../shared/data/ct)")
    found = find_cts(root, field="--backgrounds")
    # the annotation files, masks and notes beside the CTs: counted, not listed (lungcal qc lists them)
    skipped = [f"{len(found.skipped)} other file(s) are not CT images (annotations, masks, notes)"] \
        if found.skipped else []
    named = [(ct, *_case_of(ct, root.absolute())) for ct in found.cts]
    if cases:
        known = [n for _, n, _ in named]
        missing = [c for c in cases if c not in known]
        if missing:
            raise DataError(f"no case {', '.join(map(repr, missing))} in it", file=root, field="--cases",
                            fix=f"name any of {' '.join(known)}")
        named = [x for x in named if x[1] in cases]
    out: list[tuple[Background, list[RealLesion]]] = []
    for ct, name, holder in named:
        try:
            reals = real_lesions(holder) if holder is not None else []
            bg = load_background(ct, name, [(r.centre_ras, r.diameter_mm / 2) for r in reals])
        except (LungcalError, OSError, ValueError, KeyError) as exc:
            skipped.append(f"skipped {name}: cannot be read or masked ({exc})")
            continue
        if qc:
            info = bg.meta.get("series_info") if isinstance(bg.meta, Mapping) else None
            report = check_series(bg.hu, spacing=bg.spacing, mask=bg.lung, info=info, name=name, acquisition=False)
            if not report.ok:
                first = report.failed[0]
                skipped.append(f"skipped {name}: series check '{first.name}' failed: {first.reason} "
                               f"(measured: {first.value})")
                continue
        out.append((bg, reals))
    if not out:
        raise DataError("no usable background CT in it" + (f" ({'; '.join(skipped)})" if skipped else ""),
                        file=root, field="--backgrounds",
                        fix="point at a folder holding chest CTs that pass `lungcal qc` (e.g. ../shared/data/ct)")
    return out, skipped


#: the columns of real.csv (:func:`~lungcal.ctapp.evaluate.lesion_bed.score_real`), written also when empty
REAL_FIELDS = ("case", "lesion", "diameter_mm", "preset", "detector", "rank", "in_bag", "n_candidates", "mask_share")


def _csv_text(rows: Sequence[Mapping[str, Any]], fields: Sequence[str] = ()) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else list(fields), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def run_lesion_bed(backgrounds: str | Path, *, cases: Sequence[str] | None = None, per_cell: int = 30,
                   kinds: Sequence[str] | None = None, places: Sequence[str] | None = None,
                   presets: Sequence[str] | None = None, detectors: Sequence[str] | None = None, seed: int = 0,
                   out: str | Path | None = None, write_scans: bool = False, qc: bool = True,
                   progress: bool = True) -> BedRun:
    """Run the lesion bed on the CTs of ``backgrounds`` (module docstring); arguments as the command's."""
    cells = cells_of(kinds, places, per_cell)
    chosen = presets_of(presets)
    dets = detectors_of(detectors)
    out_dir = Path(out) if out is not None else default_output_dir() / "lesion_bed" / time.strftime("%Y%m%d-%H%M%S")
    if (out_dir / "rows.csv").exists() or (out_dir / "scans" / "truth.csv").exists():
        raise ConfigError("the output folder already holds a lesion bed", file=out_dir, field="--out",
                          fix="name a new folder (truth.csv and datalist.json would be appended to)")
    t0 = time.perf_counter()
    bgs, skipped = find_backgrounds(backgrounds, cases, qc=qc)
    out_dir.mkdir(parents=True, exist_ok=True)
    scans_dir = out_dir / "scans"
    truth: Path | None = None

    def write(bg: Background, scan: str, lesions: list[InsertedLesion]) -> None:
        nonlocal truth
        truth = write_lesion_bed(bg, [(scan, lesions)], scans_dir)

    requested = sum(cells.values())
    rows: list[dict[str, Any]] = []
    with tqdm(total=requested * len(chosen) * len(dets), desc="lesion bed", unit="row", disable=not progress) as bar:
        def note(text: str) -> None:
            bar.set_postfix_str(text, refresh=False)

        for row in bed_rows(bgs, dets, chosen, cells, seed=seed, progress=note, on_scan=write if write_scans else None):
            rows.append(row)
            bar.update(1)
        bar.total = bar.n  # lesions whose place had no room on a background were not inserted
        bar.refresh()
    real = score_real(bgs, dets, chosen)
    atomic_write_text(out_dir / "rows.csv", _csv_text(rows))
    atomic_write_text(out_dir / "real.csv", _csv_text(real, REAL_FIELDS))
    return BedRun(rows, real, out_dir, [bg.name for bg, _ in bgs], skipped, requested * len(chosen) * len(dets),
                  time.perf_counter() - t0, truth)


def _real_table(real: Sequence[Mapping[str, Any]]) -> str:
    cols = sorted({(r["preset"], r["detector"]) for r in real})
    keys = list(dict.fromkeys((r["case"], r["lesion"], r["diameter_mm"]) for r in real))
    at = {(r["case"], r["lesion"], r["diameter_mm"], r["preset"], r["detector"]): r for r in real}
    lines = ["| case | lesion | diameter (mm) | " + " | ".join(f"{p} {d}" for p, d in cols) + " |",
             "|" + "---|" * (3 + len(cols))]
    for key in keys:
        cells = []
        for c in cols:
            r = at.get((*key, *c))
            cells.append("-" if r is None else f"{'in bag' if r['in_bag'] else 'missed'}, rank {r['rank']} "
                         f"of {r['n_candidates']}, mask {r['mask_share']:.2f}")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_report(run: BedRun) -> str:
    """The tables the command prints: in the bag per kind x place and per kind x size band, the real lesions,
    candidates per CT and detection seconds per preset and detector, and where the files went."""
    lines = [f"lesion bed: {len(run.rows)} of {run.requested} lesion rows on {len(run.backgrounds)} background(s) "
             f"({', '.join(run.backgrounds)}) in {run.seconds:.0f} s"]
    lines += [f"  {s}" for s in run.skipped]
    if run.rows:
        lines += ["", "In the bag, by kind x place (count, share, Wilson 95 % CI; a nodule: its centre 5 mm inside a "
                      "bag patch; a mass: a bag candidate on it):", sensitivity_table(run.rows, ("kind", "place")),
                  "", "In the bag, by kind x size band (mm):", sensitivity_table(run.rows, ("kind", "band"))]
        per = summary(run.rows)
        lines += ["", "| preset | detector | inserted scans | candidates per CT (median) "
                      "| detection s per CT (median) |", "|---|---|---|---|---|"]
        lines += [f"| {p} | {d} | {v['scans']} | {v['candidates_median']:.0f} | {v['seconds_median']:.2f} |"
                  for (p, d), v in sorted(per.items())]
    if run.real:
        lines += ["", "The backgrounds' own lesions (a lesion of 30 mm or more judged as a mass):",
                  _real_table(run.real)]
    lines += ["", f"rows: {run.out / 'rows.csv'}", f"real lesions: {run.out / 'real.csv'}"]
    if run.truth is not None:
        lines.append(f"inserted scans: {run.truth.parent} (truth.csv, datalist.json)")
    return "\n".join(lines)
