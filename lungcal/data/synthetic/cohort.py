"""A synthetic cohort on disk, and the named presets that lungcal generates once and reuses.

Outputs of :func:`make_cohort` (folder ``out_dir``)
    * ``dicom/<ct>/slice_XXXX.dcm``: one series per CT with planted *fake* identifiers
      (:mod:`.writers`);
    * ``nifti/<ct>.nii.gz`` (if ``"nifti"`` in ``formats``), ``nifti/<ct>.nii`` (plain, if ``"nii"``);
      with ``dicom_splits`` the CTs of those splits are DICOM series only, the others NIfTI only
      (the demo: its 200 test CTs are DICOM series, its 800 train and validation CTs plain NIfTI);
    * ``annotations.csv``: LUNA16 style ``seriesuid, coordX, coordY, coordZ, diameter_mm`` (world
      mm, LPS as in LUNA16/ITK) plus ``malignant, margin, attenuation, subject, ct, rasX, rasY, rasZ``.
      ``seriesuid`` is a (fake) DICOM UID: key ground truth by ``ct`` / ``subject`` (pseudonyms),
      never by the UID, in anything that is logged;
    * ``truth.csv``: per CT ``ct, subject, label, bayes_p, n_nodules`` (the Bayes posterior of
      :mod:`.nodules`);
    * ``cohort.json``: the parameters, the nodule model and the Bayes-reader AUC per split;
    * ``planted_identifiers.json``: every planted identifier, so privacy tests can scan logs, MLflow
      runs and caches for them. Nothing references this file;
    * ``datalist.json`` (written last): rows ``{image, label, subject, site, split, ct, acquisition}``,
      split by patient, stratified, seeded. ``acquisition`` says how the CT was acquired, never by
      whom or on which machine: ``{profile, manufacturer, slice_thickness_mm, pixel_mm, kernel,
      kernel_sigma_mm, noise_hu, hu_offset}`` (:class:`~.scanners.Acquisition`).

Folder and file names use pseudonyms only. Everything is deterministic by ``seed`` (each CT draws
from its own generator ``default_rng([seed, index, 7])``, its image noise from ``[seed, index, 8]``,
its scanner from ``[seed, index, 9]``), so a cohort does not depend on the number of worker processes.

Scanners: by default every CT comes from one pinned scanner (``scanner`` at ``spacing``; rows name
the profile ``pinned``). With ``scanner_mix`` (a name in :data:`~.scanners.SCANNER_MIXES`, e.g.
``"four_vendors"``) each CT draws its slice thickness, pixel size, kernel and noise from the mix's
named profiles (:mod:`.scanners` documents the mix). Its patient is the same as in the pinned
cohort of the same seed: label, nodules (placed on the nominal ``shape`` x ``spacing`` grid) and
body; only the acquisition, the tissue texture and the vessel tree are drawn anew on its own grid
over the same field of view. So a mixed and a pinned cohort of one seed hold the same subjects in
the same splits, and a model trained on one can be scored on the other's test CTs, paired.

Presets (:data:`COHORT_PRESETS`, :func:`ensure_cohort`): ``"demo"`` is the built-in default data;
``"study"`` is the NLST-like cohort of the study (prevalence 0.11, larger val/test splits). Both
are single-scanner; ``ensure_cohort(preset, scanner_mix="four_vendors")`` makes the mixed version
(folder ``..._scanner_mix-four_vendors``), which ships as an option: whether it should be the
default is decided by the paired ΔAUC on the same test CTs (issue 32 item 1).
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lungcal.calibration.metrics import auroc
from lungcal.errors import ConfigError
from lungcal.paths import atomic_write, atomic_write_text, lungcal_home

from ..manifest import load_manifest, save_manifest
from ..splits import SPLITS, apply_splits, pseudonym
from .nodule_types import draw_mass, draw_types, nodule_type_of, resolve_type_mix, typed_bayes_posterior
from .nodules import ATTENUATIONS, NODULE_MODEL, bayes_posterior, sample_nodule_features
from .phantom import ScannerProfile, lung_masks, make_phantom, place_nodules, sample_anatomy
from .scanners import Acquisition, ScannerMix, ct_grid, draw_acquisition, mix_summary, pinned_acquisition, resolve_mix
from .writers import fake_identifiers, read_nifti, write_dicom_series, write_nifti

__all__ = [
    "DEMO_DEFAULTS",
    "STUDY_DEFAULTS",
    "COHORT_PRESETS",
    "make_cohort",
    "ensure_cohort",
    "cohort_datalist_path",
    "ensure_demo_cohort",
    "ensure_study_cohort",
    "cohort_bayes_auc",
]

log = logging.getLogger(__name__)

#: the built-in demo cohort (see :func:`ensure_demo_cohort`)
DEMO_DEFAULTS = {
    "n_subjects": 1000,
    "prevalence": 0.4,
    "seed": 0,
    "shape": (128, 128, 96),
    "spacing": (2.5, 2.5, 2.5),
    "formats": ("nii", "dicom"),
    "dicom_splits": ("test",),
    # every nodule type (issue 43 item 4): the screening type mix (.nodule_types: benign 80/5/15 %,
    # malignant 62/26/12 % solid / part-solid / ground glass) and a cancer that is a 3-6 cm mass in
    # DEMO_MASSES of the positive CTs
    "nodule_types": "screening",
    "masses": 0.15,
}
#: the share of the demo's cancers drawn as a 3-6 cm mass against the mediastinum or the pleura: a
#: modelling assumption of the order of the screen-detected cancers larger than 3 cm (T2 by size and
#: above), not fitted to a registry
DEMO_MASSES = DEMO_DEFAULTS["masses"]

_STUDY_SPLIT_SIZES = (1000, 1000, 1500)  # train / val / test CTs
#: the NLST-like study cohort (see :func:`ensure_study_cohort`)
STUDY_DEFAULTS = {
    "n_subjects": sum(_STUDY_SPLIT_SIZES),
    "prevalence": 0.11,
    "seed": 1,
    "shape": (128, 128, 96),
    "spacing": (2.5, 2.5, 2.5),
    "formats": ("dicom",),
    "splits": tuple(n / sum(_STUDY_SPLIT_SIZES) for n in _STUDY_SPLIT_SIZES),
}

#: named cohorts that :func:`ensure_cohort` generates once and reuses
COHORT_PRESETS = {"demo": DEMO_DEFAULTS, "study": STUDY_DEFAULTS}


def make_cohort(
    out_dir: str | os.PathLike,
    n_subjects: int = 200,
    prevalence: float = 0.11,
    seed: int = 0,
    shape: Sequence[int] = (128, 128, 96),
    spacing: Sequence[float] = (2.5, 2.5, 2.5),
    formats: Sequence[str] = ("dicom", "nifti"),
    *,
    scanner: ScannerProfile | dict | None = None,
    scanner_mix: str | ScannerMix | None = None,
    nodule_types: str = "classic",
    masses: float = 0.0,
    splits: Sequence[float] = (0.6, 0.2, 0.2),
    image_format: str | None = None,
    dicom_splits: Sequence[str] | None = None,
    salt: str | None = None,
    num_workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Generate a synthetic cohort (one CT per subject) into ``out_dir``; return the datalist path.

    Args:
        out_dir: output folder (created; existing files of the same names are overwritten).
        n_subjects: number of subjects (= CTs).
        prevalence: P(label = 1); NLST-like 0.11, the demo uses 0.4.
        seed: everything is deterministic by seed.
        shape: ``(X, Y, Z)`` voxels per CT.
        spacing: ``(dx, dy, dz)`` mm (with ``scanner_mix``: the nominal grid; ``shape x spacing``
            is every CT's field of view).
        formats: any of ``"dicom"``, ``"nifti"`` (``.nii.gz``), ``"nii"`` (plain NIfTI: fast to write and read).
        scanner: :class:`ScannerProfile` (or its dict): site name, noise, kernel, HU offset. With
            ``scanner_mix`` only its site name and HU offset apply.
        scanner_mix: None (every CT from ``scanner`` at ``spacing``), or a mix (a name in
            :data:`~.scanners.SCANNER_MIXES` or a :class:`~.scanners.ScannerMix`) each CT draws
            its acquisition from.
        nodule_types: ``"classic"`` (the nodule model as it always was: solid, calcified and
            -480 HU part-solid nodules), or a typed mix of solid, part-solid and ground-glass
            nodules (``"screening"``, ``"even"``; :mod:`.nodule_types`). A typed cohort holds
            the classic cohort's patients and nodules (sizes, margins, places), paired CT for CT.
        masses: the probability that a positive CT's malignant nodule is a 3-6 cm mass against the
            mediastinum or the pleura (:mod:`.nodule_types`); 0 (default): none.
        splits: train/val/test fractions (patient-level, stratified, seeded).
        image_format: which format the datalist points to (default: the first of ``formats``).
        dicom_splits: the splits (``"train"``, ``"val"``, ``"test"``) whose CTs are written as DICOM
            series, the others in the other format of ``formats`` (which needs ``"dicom"`` and one
            NIfTI format); each row points to the one file its CT has. None (default): every CT in
            every format of ``formats``. The demo writes its test split as DICOM, so that the real
            DICOM reader scores every test CT, and trains on plain NIfTI, read ~20x faster.
        salt: pseudonym salt (default ``"synthetic-<seed>"`` so a cohort is reproducible).
        num_workers: processes (default: all CPUs).
        progress: show a tqdm bar.
    """
    formats = tuple(formats)
    image_format = image_format or (formats[0] if formats else None)
    _check_parameters(n_subjects, prevalence, shape, spacing, formats, image_format)
    dicom_splits = _check_dicom_splits(dicom_splits, formats)
    if dicom_splits is not None:  # rendered in the NIfTI format; the DICOM splits' CTs converted below
        image_format = next(f for f in formats if f != "dicom")
    nodule_types = resolve_type_mix(nodule_types)
    if not 0.0 <= float(masses) <= 1.0:
        raise ConfigError(f"masses must be a probability in [0, 1], got {masses}", field="masses",
                          fix="e.g. 0.3 (30 % of the cancers are 3-6 cm masses), or 0 for none")
    scanner = ScannerProfile(**scanner) if isinstance(scanner, dict) else (scanner or ScannerProfile())
    mix = resolve_mix(scanner_mix)
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    salt = salt if salt is not None else f"synthetic-{seed}"
    tasks = [{"seed": int(seed), "index": i, "shape": tuple(int(s) for s in shape),
              "spacing": tuple(float(s) for s in spacing), "prevalence": float(prevalence),
              "scanner": asdict(scanner), "mix": mix,
              "nodule_types": nodule_types, "masses": float(masses),
              "formats": formats if dicom_splits is None else (image_format,),
              "out_dir": str(out), "salt": salt}
             for i in range(n_subjects)]
    workers = num_workers if num_workers is not None else (os.cpu_count() or 1)
    t0 = time.perf_counter()
    bar = tqdm(total=n_subjects, desc="synth", unit="ct", disable=not progress)
    results = []
    if workers > 1 and n_subjects > 1:
        with ProcessPoolExecutor(max_workers=min(workers, n_subjects)) as pool:
            for res in pool.map(_make_one, tasks, chunksize=max(1, n_subjects // (8 * workers))):
                results.append(res)
                bar.update()
    else:
        for t in tasks:
            results.append(_make_one(t))
            bar.update()
    bar.close()

    rows = [{"image": r["images"][image_format], "label": r["label"], "subject": r["subject"],
             "site": scanner.site, "split": "", "ct": r["ct"], "acquisition": r["acquisition"]} for r in results]
    rows = apply_splits(rows, splits, seed=seed, keep_existing=False)
    if dicom_splits is not None:
        _convert_to_dicom(out, rows, results, dicom_splits, seed, workers, progress)
    _write_annotations(out / "annotations.csv", results)
    _write_truth(out / "truth.csv", results)
    atomic_write_text(out / "planted_identifiers.json", json.dumps(
        {"note": "fake identifiers planted in the synthetic DICOM headers; none may appear in logs, "
                 "MLflow or cache names", "cts": [r["ids"] for r in results]}, indent=1))
    elapsed = time.perf_counter() - t0
    auc = _auc_by_split([r["label"] for r in results], [r["bayes_p"] for r in results], [r["split"] for r in rows])
    params = {"n_subjects": n_subjects, "prevalence": prevalence, "seed": seed, "shape": list(shape),
              "spacing": list(spacing), "formats": list(formats), "scanner": asdict(scanner),
              "scanner_mix": None if mix is None else mix_summary(mix),
              "splits": list(splits), "image_format": image_format}
    if dicom_splits is not None:  # named only when set: cohorts made before read the same
        params["dicom_splits"] = list(dicom_splits)
    if nodule_types != "classic" or masses:  # named only when set: cohorts made before read the same
        params.update(nodule_types=nodule_types, masses=float(masses))
    atomic_write_text(out / "cohort.json", json.dumps({**params, "nodule_model": NODULE_MODEL, "bayes_auc": auc,
                                                       "generation_seconds": round(elapsed, 2)}, indent=1))
    log.info("synthetic cohort: %d CTs in %.1f s -> %s (Bayes-reader AUC %s)", n_subjects, elapsed, out, auc)
    return save_manifest(rows, out / "datalist.json", source="synthetic", site=scanner.site)


def cohort_datalist_path(preset: str = "demo", root: str | os.PathLike | None = None, **overrides) -> Path:
    """Where :func:`ensure_cohort` keeps the datalist of ``preset`` with ``overrides`` (nothing is generated)."""
    if preset not in COHORT_PRESETS:
        raise ConfigError(f"unknown synthetic cohort preset {preset!r}", field="preset",
                          fix=f"use one of {sorted(COHORT_PRESETS)}")
    defaults = COHORT_PRESETS[preset]
    root = Path(root if root is not None else lungcal_home() / "data").absolute()
    overrides = {k: v for k, v in overrides.items() if k not in defaults or not _same(v, defaults[k])}
    return root / _folder_name(preset, defaults, overrides) / "datalist.json"


def ensure_cohort(preset: str = "demo", root: str | os.PathLike | None = None, progress: bool = True,
                  **overrides) -> Path:
    """Return the datalist of the preset cohort ``preset`` (:data:`COHORT_PRESETS`), generating it once.

    The cohort lives in ``<root>/synthetic_<preset>_<n_subjects>`` (``root`` defaults to
    ``$LUNGCAL_HOME/data`` or ``./runs/data``), so a change of a preset's default never reuses an
    older cohort. It is generated in a temporary sibling folder and renamed into place, so an
    interrupted run never leaves a half-written cohort. ``overrides`` (any :func:`make_cohort`
    argument) change the defaults and the folder name: ``synthetic_<key-value...>`` for the demo
    (as before presets existed), ``synthetic_<preset>_<key-value...>`` for the others.
    """
    datalist = cohort_datalist_path(preset, root, **overrides)
    if datalist.is_file():
        return datalist
    defaults = COHORT_PRESETS[preset]
    overrides = {k: v for k, v in overrides.items() if k not in defaults or not _same(v, defaults[k])}
    final, root = datalist.parent, datalist.parent.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        make_cohort(tmp, progress=progress, **{**defaults, **overrides})
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race
            if not datalist.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return datalist


def ensure_demo_cohort(root: str | os.PathLike | None = None, progress: bool = True, **overrides) -> Path:
    """Return the datalist of the built-in demo cohort, generating it once (see :func:`ensure_cohort`).

    The demo (:data:`DEMO_DEFAULTS`): 1000 subjects (600/200/200 train/val/test), prevalence 0.4,
    seed 0, 128x128x96 voxels at 2.5 mm; the 200 test CTs are DICOM series (so the real DICOM reader
    scores every test CT), the 800 train and validation CTs plain NIfTI (the same volumes, read ~20x
    faster than a 96-file series); about 2 min on two cores and 3.2 GB on disk. A demo folder made
    before (every CT a DICOM series) is reused as it is. The MIL model is data-hungry: with 120
    training CTs it learns nothing (test AUC ~0.45), with 360 it reached 0.64-0.71, with 600
    0.69-0.70 (same model; single-orientation logits), and 200 test CTs give a 95% CI of about
    +-0.07 instead of +-0.09. Its nodules are of every type: the ``"screening"`` type mix and a 3-6 cm
    mass for :data:`DEMO_MASSES` of the cancers (:mod:`.nodule_types`). It lives in
    ``<root>/synthetic_demo_1000_types-screening_masses-0.15`` (a folder of the classic nodule model,
    ``synthetic_demo_1000``, is a different cohort and is not reused).
    """
    return ensure_cohort("demo", root, progress, **overrides)


def ensure_study_cohort(root: str | os.PathLike | None = None, progress: bool = True, **overrides) -> Path:
    """Return the datalist of the NLST-like study cohort, generating it once (see :func:`ensure_cohort`).

    The study cohort (:data:`STUDY_DEFAULTS`): 3500 subjects split 1000/1000/1500 train/val/test
    (patient-level, stratified; 110/110/166 positives), prevalence 0.11 as NLST, seed 1 (so none of
    its CTs or pseudonyms repeats the demo's), otherwise as the demo (128x128x96 at 2.5 mm, DICOM).
    Val and test are large because ECE needs them (the demo's 200 test CTs give +-0.07; 1500 give
    about +-0.025 by 1/sqrt(n)) and evaluation-only CTs are cheap: they are only generated and
    bagged. Bayes-reader AUC 0.889 (test split 0.889; the demo's: 0.872, test 0.863). About 3.5x
    the demo's generation time and disk (~12 GB; ``formats=("nifti",)`` halves the disk and reads
    6x faster, but generates ~1.5x slower and names another folder). It lives in
    ``<root>/synthetic_study_3500``; its ``cohort.json`` holds the Bayes-reader AUC of each split.
    """
    return ensure_cohort("study", root, progress, **overrides)


def cohort_bayes_auc(path: str | os.PathLike) -> dict[str, float | None]:
    """The Bayes-reader AUC of a generated cohort (its folder or ``datalist.json``), overall and per split.

    It is the AUC of ``truth.csv``'s exact posterior against the labels: the ceiling of any model on
    that split (``None`` where a split has one class only). Works on cohorts written before
    ``cohort.json`` carried it.
    """
    path = Path(path)
    folder = path.parent if path.is_file() else path
    split_of = {r["ct"]: r["split"] for r in load_manifest(folder / "datalist.json", check_files=False)}
    with open(folder / "truth.csv", newline="") as fh:
        truth = list(csv.DictReader(fh))
    return _auc_by_split([int(t["label"]) for t in truth], [float(t["bayes_p"]) for t in truth],
                         [split_of[t["ct"]] for t in truth])


def _check_dicom_splits(dicom_splits: Sequence[str] | None, formats: tuple[str, ...]) -> tuple[str, ...] | None:
    if dicom_splits is None:
        return None
    chosen = (dicom_splits,) if isinstance(dicom_splits, str) else tuple(dicom_splits)
    if not chosen or any(s not in ("train", "val", "test") for s in chosen):
        raise ConfigError(f"dicom_splits must name splits among train, val and test, got {dicom_splits!r}",
                          field="dicom_splits", fix="e.g. ['test'] (the demo), or None for one format everywhere")
    if "dicom" not in formats or len([f for f in formats if f != "dicom"]) != 1:
        raise ConfigError(f"dicom_splits needs 'dicom' and one NIfTI format in formats, got {formats}",
                          field="formats", fix="use formats=('nii', 'dicom') with dicom_splits")
    return chosen


def _to_dicom(task: dict) -> str:
    """Rewrite one CT from its NIfTI file as a DICOM series (its planted identifiers, its scanner's
    manufacturer); the NIfTI file is removed. Runs in a worker process."""
    out, src = Path(task["out_dir"]), Path(task["out_dir"]) / task["image"]
    hu, origin, spacing = read_nifti(src)
    rng = np.random.default_rng([task["seed"], task["index"], 10])
    write_dicom_series(hu, origin, spacing, out / "dicom" / task["ct"], task["ids"], rng, task["manufacturer"])
    src.unlink()
    return f"dicom/{task['ct']}/"


def _convert_to_dicom(out: Path, rows: list[dict], results: list[dict], dicom_splits: tuple[str, ...], seed: int,
                      workers: int, progress: bool) -> None:
    """Write the CTs of ``dicom_splits`` as DICOM series and point their rows there (rows and results
    are in the same order)."""
    todo = [(row, {"out_dir": str(out), "image": row["image"], "seed": int(seed), "index": res["index"],
                   "ct": res["ct"], "ids": res["ids"], "manufacturer": res["manufacturer"]})
            for row, res in zip(rows, results) if row["split"] in dicom_splits]
    bar = tqdm(total=len(todo), desc="synth: DICOM series", unit="ct", disable=not progress or not todo)
    tasks = [t for _, t in todo]
    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=min(workers, len(todo))) as pool:
            images = []
            for image in pool.map(_to_dicom, tasks, chunksize=max(1, len(todo) // (8 * workers))):
                images.append(image)
                bar.update()
    else:
        images = []
        for t in tasks:
            images.append(_to_dicom(t))
            bar.update()
    bar.close()
    for (row, _), image in zip(todo, images):
        row["image"] = image


def _check_parameters(n_subjects, prevalence, shape, spacing, formats, image_format) -> None:
    if not formats or any(f not in ("dicom", "nifti", "nii") for f in formats):
        raise ConfigError(f"formats must be a non-empty subset of ('dicom', 'nifti', 'nii'), got {formats}",
                          field="formats", fix="use formats=('dicom',) or ('dicom', 'nifti')")
    if image_format not in formats:
        raise ConfigError(f"image_format {image_format!r} is not among formats {formats}", field="image_format",
                          fix="add it to formats")
    if not 0 < prevalence < 1:
        raise ConfigError(f"prevalence must be in (0, 1), got {prevalence}", field="prevalence", fix="e.g. 0.11")
    if n_subjects < 1:
        raise ConfigError("n_subjects must be at least 1", field="n_subjects", fix="e.g. 200")
    if len(shape) != 3 or len(spacing) != 3 or min(shape) < 16:
        raise ConfigError(f"shape {shape} / spacing {spacing} must be 3 numbers each, shape >= 16 voxels",
                          field="shape", fix="e.g. shape=(128,128,96), spacing=(2.5,2.5,2.5)")


def _make_one(task: dict) -> dict:
    """Draw, render and write one CT (runs in a worker process; all randomness from its seed and index)."""
    seed, i = task["seed"], task["index"]
    rng = np.random.default_rng([seed, i, 7])
    shape, spacing, prevalence = task["shape"], task["spacing"], task["prevalence"]
    scanner = ScannerProfile(**task["scanner"])
    acq = _acquisition(task, scanner)
    label = int(rng.random() < prevalence)
    nb = int(rng.poisson(NODULE_MODEL["lam"]))
    db, mb, ab = sample_nodule_features(rng, False, nb)
    feats = [(db[j], mb[j], ab[j], False) for j in range(nb)]
    if label:
        dm, mm, am = sample_nodule_features(rng, True, 1)
        feats.insert(int(rng.integers(nb + 1)), (dm[0], mm[0], am[0], True))
    anat = sample_anatomy(rng, shape, spacing)
    origin = -(np.asarray(shape) - 1) / 2 * np.asarray(spacing, np.float32)
    lung_mask, _ = lung_masks(tuple(shape), np.asarray(spacing, np.float32), origin, anat)
    nodules = place_nodules(rng, lung_mask[0] | lung_mask[1], spacing, origin, feats)
    types, has_mass = _type_nodules(task, nodules, feats, anat, lung_mask, origin)
    if task["mix"] is not None:  # the same patient on this CT's own scanner and grid (same field of view)
        shape, spacing = ct_grid(acq, np.asarray(shape) * np.asarray(spacing))
        scanner = acq.scanner(scanner.site)
    hu, origin, _ = make_phantom(np.random.default_rng([seed, i, 8]), shape, spacing, nodules, scanner, anat=anat)
    ids = fake_identifiers(rng)
    subject_id = f"SIM-{seed}-{i:05d}"
    subject = pseudonym(subject_id, task["salt"])
    ct = f"{subject}_T0"
    out = Path(task["out_dir"])
    images = {}
    if "dicom" in task["formats"]:
        write_dicom_series(hu, origin, spacing, out / "dicom" / ct, ids, rng, scanner.manufacturer)
        images["dicom"] = f"dicom/{ct}/"
    if "nifti" in task["formats"]:
        write_nifti(hu, origin, spacing, out / "nifti" / f"{ct}.nii.gz")
        images["nifti"] = f"nifti/{ct}.nii.gz"
    if "nii" in task["formats"]:
        write_nifti(hu, origin, spacing, out / "nifti" / f"{ct}.nii")
        images["nii"] = f"nifti/{ct}.nii"
    if types is None and not has_mass:
        p = bayes_posterior([f[0] for f in feats], [f[1] for f in feats], [f[2] for f in feats], prevalence)
    else:
        p = typed_bayes_posterior([f[0] for f in feats], [f[1] for f in feats], [f[2] for f in feats], types,
                                  task["nodule_types"], prevalence, has_mass)
    return {"subject": subject, "ct": ct, "label": label, "images": images, "ids": ids, "bayes_p": p,
            "index": i, "manufacturer": scanner.manufacturer,
            "nodules": [asdict(n) for n in nodules], "acquisition": acq.row()}


def _type_nodules(task: dict, nodules: list, feats: list, anat: dict, lungs: tuple,
                  origin: np.ndarray) -> tuple[list[dict] | None, bool]:
    """Re-type the placed nodules in place (a typed mix) and turn the malignant one into a mass (with
    probability ``masses``), each from its own generator, so nothing else of the CT changes.

    Returns the drawn types (None for the classic model) and whether the CT has a mass.
    """
    seed, i = task["seed"], task["index"]
    types = None
    if task.get("nodule_types", "classic") != "classic":
        types = draw_types(np.random.default_rng([seed, i, 10]), task["nodule_types"], [f[3] for f in feats])
        for j, (n, t) in enumerate(zip(nodules, types)):
            calcified = ATTENUATIONS[int(feats[j][2])] == "calcified"
            att = ("calcified" if calcified else "solid") if t["type"] == "solid" else t["type"]
            nodules[j] = replace(n, attenuation=att, nodule_type=t["type"], gg_hu=t["gg_hu"], core_frac=t["core_frac"])
    has_mass = False
    if task.get("masses", 0.0) > 0 and any(f[3] for f in feats):
        mrng = np.random.default_rng([seed, i, 11])
        if mrng.random() < task["masses"]:
            j = next(k for k, f in enumerate(feats) if f[3])
            centre, d, contact = draw_mass(mrng, anat, lungs, task["spacing"], origin)
            nodules[j] = replace(nodules[j], center_lps=centre, diameter_mm=d, margin="lobulated", attenuation="solid",
                                 nodule_type="solid", gg_hu=None, core_frac=None, contact=contact)
            has_mass = True
    return types, has_mass


def _acquisition(task: dict, scanner: ScannerProfile) -> Acquisition:
    """CT ``index``'s acquisition: drawn from the mix (its own generator), else the pinned scanner's."""
    if task["mix"] is None:
        return pinned_acquisition(scanner, task["spacing"])
    return draw_acquisition(task["mix"], np.random.default_rng([task["seed"], task["index"], 9]), scanner.hu_offset)


def _write_annotations(path: Path, results: list[dict]) -> None:
    with atomic_write(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["seriesuid", "coordX", "coordY", "coordZ", "diameter_mm", "malignant", "margin", "attenuation",
                    "subject", "ct", "rasX", "rasY", "rasZ", "nodule_type", "core_frac", "gg_hu", "contact"])
        for r in results:
            for n in r["nodules"]:
                c = n["center_lps"]
                w.writerow([r["ids"]["SeriesInstanceUID"], f"{c[0]:.3f}", f"{c[1]:.3f}", f"{c[2]:.3f}",
                            f"{n['diameter_mm']:.3f}", int(n["malignant"]), n["margin"], n["attenuation"],
                            r["subject"], r["ct"], f"{-c[0]:.3f}", f"{-c[1]:.3f}", f"{c[2]:.3f}", *_type_columns(n)])


def _type_columns(n: dict) -> list[str]:
    """``nodule_type, core_frac, gg_hu, contact`` of an annotation row; a classic nodule's from its
    attenuation (a classic part-solid nodule: core 0.5 of the diameter in -480 HU ground glass)."""
    kind = n.get("nodule_type") or nodule_type_of(n["attenuation"])
    core, gg = n.get("core_frac"), n.get("gg_hu")
    if n.get("nodule_type") is None and kind == "part-solid":
        core, gg = 0.5, -480.0
    return [kind, "" if core is None else f"{core:.3f}", "" if gg is None else f"{gg:.1f}", n.get("contact") or ""]


def _write_truth(path: Path, results: list[dict]) -> None:
    with atomic_write(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["ct", "subject", "label", "bayes_p", "n_nodules"])
        for r in results:
            w.writerow([r["ct"], r["subject"], r["label"], f"{r['bayes_p']:.6f}", len(r["nodules"])])


def _auc_by_split(labels: Sequence[int], bayes_p: Sequence[float], splits: Sequence[str]) -> dict[str, float | None]:
    """Bayes-reader AUC overall (``"all"``) and per split, rounded to 4 digits; None where undefined."""
    y, p, s = np.asarray(labels, int), np.asarray(bayes_p, float), np.asarray(splits)
    out = {}
    for name in ("all", *SPLITS):
        sel = np.ones(len(y), bool) if name == "all" else s == name
        auc = auroc(p[sel], y[sel]) if sel.any() else math.nan
        out[name] = None if math.isnan(auc) else round(auc, 4)
    return out


def _same(a, b) -> bool:
    return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


#: the make_cohort arguments of the nodule model, named in a folder by :func:`_nodule_tag`
_NODULE_MODEL_KEYS = ("nodule_types", "masses")


def _nodule_tag(settings: dict) -> str:
    """``""`` for the classic nodule model (no type mix, no masses: every cohort made before the demo
    drew every type keeps its folder), else ``"_types-<mix>_masses-<p>"``."""
    types = resolve_type_mix(settings.get("nodule_types"))
    masses = float(settings.get("masses") or 0.0)
    if types == "classic" and masses == 0.0:
        return ""
    return f"_types-{types}_masses-{masses:g}"


def _folder_name(preset: str, defaults: dict, overrides: dict) -> str:
    """The folder of a preset cohort: the preset and its size, or the overrides of other settings, then
    the nodule model's tag, so that a change of the nodule model never reuses an older cohort."""
    tag = _nodule_tag({**defaults, **overrides})
    rest = {k: v for k, v in overrides.items() if k not in _NODULE_MODEL_KEYS}
    if not rest:
        return f"synthetic_{preset}_{defaults['n_subjects']}{tag}"
    prefix = "synthetic_" if preset == "demo" else f"synthetic_{preset}_"  # the demo keeps its pre-preset names
    return prefix + "_".join(
        f"{k}-{'x'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in sorted(rest.items())) + tag
