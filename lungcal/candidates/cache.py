"""On-disk bag cache and the parallel CT -> bag builder.

A cache entry is one ``<sha256>.npz`` file per (source, parameters) pair. The name is the hash
only: no patient identifier (DICOM/TCIA paths usually contain them) ever reaches a file name.
The key hashes

- the *source*: the bytes of an image file, or, for a DICOM series folder, the sorted relative
  file names and the bytes of every file (``source_mode="content"``, the default); with
  ``source_mode="stat"`` names, sizes and modification times are hashed instead (faster on
  large real data, but a copied folder is then a cache miss);
- the resolved parameters: preprocessing (spacing, HU window, margin, extra ``preprocess_ct``
  keywords), the detector (:func:`lungcal.candidates.detector_config.detector_key`: the built-in
  LoG detector by its class name and all its settings, as always; a plugged-in one by its
  ``config()``, class path included), K and P;
- :data:`CACHE_VERSION`, bumped whenever the code changes what an entry contains, and
  :func:`code_fingerprint`, a hash of the source of ``lungcal.ct.io``/``transforms`` and of the
  detector and extraction modules (so an edited preprocessing never serves stale bags).

Each entry holds ``bag (K, 1, P, P, P)`` float32, ``mask (K,)`` bool, the candidates' ``world``
(mm), ``voxel``, ``radius_mm`` and ``score`` (the first ``min(N, K)`` candidates, aligned with the
bag slots), the preprocessed volume's ``affine`` and ``spacing``, ``n_detected`` (all candidates
the detector returned) and ``meta`` (a JSON string of the version and parameters). Writes are
atomic: a temporary file in the cache folder, flushed, then ``os.replace``; a failure leaves no
entry behind. Each entry is built under its own inter-process lock (``filelock``), so two
processes building overlapping datalists into one cache (two study jobs, two users) build each
entry once; an entry that fails to load (truncated, corrupt) is rebuilt with a warning.

The module is a little over the house ~400 lines: the entry format, its key, its lock and the
builder that fills it change together (the builder is the only writer).

Default parameters fit the built-in synthetic cohort (about 2.5 mm voxels): ``P = 16`` voxels is
a 40 mm cube, enough context around nodules up to ~30 mm; ``K = 8`` candidates covers every
planted nodule with room for false positives, while keeping a bag at 128 KiB.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing as mp
import os
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from tqdm.auto import tqdm

from lungcal.candidates.bags import extract_bag
from lungcal.candidates.detector import Candidates, _as_volume
from lungcal.candidates.detector_config import detector_from_config, detector_key
from lungcal.ct.kernel import check_max_sigma, draw_kernel_sigma, soften
from lungcal.ct.masking import LungMasker
from lungcal.ct.transforms import DEFAULT_HU_WINDOW, preprocess_ct
from lungcal.ct.transforms import __file__ as _ct_transforms_file
from lungcal.errors import CacheError, ConfigError, DataError
from lungcal.paths import atomic_write

__all__ = ["CACHE_VERSION", "code_fingerprint", "BagParams", "BagCache", "hash_source", "compute_bag", "build_bags",
           "build_entry", "row_failure", "load_bag", "masker_config", "masker_from_config"]

logger = logging.getLogger(__name__)

CACHE_VERSION = "bags-v1"
_ENTRY_KEYS = ("bag", "mask", "world", "voxel", "radius_mm", "score", "affine", "spacing", "n_detected", "meta")


@dataclass(frozen=True)
class BagParams:
    """Everything that determines a bag, hence part of the cache key.

    Args:
        spacing: voxel size in mm after resampling (``preprocess_ct``).
        hu_window: (low, high) HU window mapped to [0, 1].
        margin_mm: margin kept around the lungs when cropping.
        k: bag size K (candidates per CT).
        patch_size: patch edge P in voxels.
        detector: the detector: keyword arguments of :class:`~lungcal.candidates.detector.LoGBlobDetector`
            (empty: its defaults), or a plugged-in detector's ``config()`` (``{"_target_": class path,
            **arguments}``, :mod:`lungcal.candidates.detector_config`), which rebuilds it.
        preprocess: extra keyword arguments passed through to ``preprocess_ct``; a ``masker`` is
            keyed by its settings (:func:`masker_config`), and only when it is not the default.
        kernel_aug_mm: training bags only: the largest extra Gaussian width (mm; one number or
            one per axis) of the scanner-kernel augmentation (:mod:`lungcal.ct.kernel`): the CT is
            softened by a width drawn once per CT (seeded by its cache key) before the detector
            runs. None or 0 (the default) leaves the CT as read; part of the key only when set.
        harmonize_mm: every bag (train, val, test, inference): the Gaussian width (mm; one number
            or one per axis) that smooths each resampled CT before the detector runs and the patches
            are cut, so that scans from sharp and soft reconstruction kernels meet the detector and
            the model at a closer resolution (:func:`lungcal.ct.kernel.soften`; widths add in
            quadrature, so a common extra blur shrinks the kernels' relative difference). The CT
            bundles' key ``harmonize_mm`` (shipped 0: off; measured in docs/results.md, "Resolution
            harmonization"). None or 0 (also the default here, so that bag parameters stored
            before it existed keep their meaning) leaves the CT as read; part of the key only when
            set.
    """

    spacing: tuple[float, float, float] = (2.5, 2.5, 2.5)
    hu_window: tuple[float, float] = DEFAULT_HU_WINDOW
    margin_mm: float = 10.0
    k: int = 8
    patch_size: int = 16
    detector: Mapping[str, Any] = field(default_factory=dict)
    preprocess: Mapping[str, Any] = field(default_factory=dict)
    kernel_aug_mm: Sequence[float] | float | None = None
    harmonize_mm: Sequence[float] | float | None = None

    @classmethod
    def from_any(cls, params: BagParams | Mapping[str, Any] | None) -> BagParams:
        """Accept a ``BagParams``, a mapping of its fields (e.g. from a bundle config) or None."""
        if params is None:
            return cls()
        if isinstance(params, BagParams):
            return params
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - names)
        if unknown:
            raise ConfigError(
                f"unknown bag parameter(s) {unknown}", field="bag_params",
                fix=f"use only {sorted(names)}")
        return cls(**dict(params))

    def make_detector(self) -> Any:
        """The detector of these parameters (:func:`~lungcal.candidates.detector_config.detector_from_config`)."""
        return detector_from_config(self.detector)

    def resolved(self) -> dict[str, Any]:
        """JSON-able dict with every default filled in (the part of the cache key)."""
        if self.k < 1 or self.patch_size < 1:
            raise ConfigError(f"k={self.k} and patch_size={self.patch_size} must be >= 1", field="bag_params",
                              fix="set positive k and patch_size")
        det = detector_key(self.detector)
        try:
            kernel = check_max_sigma(self.kernel_aug_mm)
        except ValueError as e:
            raise ConfigError(str(e), field="augment_kernel_mm",
                              fix="use 0 (off) or the largest extra blur in mm, e.g. [1.5, 1.5, 2.0]") from e
        out = {
            "spacing": [float(s) for s in self.spacing],
            "hu_window": [float(h) for h in self.hu_window],
            "margin_mm": float(self.margin_mm),
            "k": int(self.k),
            "patch_size": int(self.patch_size),
            "detector": det,
            "preprocess": {k: _jsonable(v) for k, v in sorted(dict(self.preprocess).items())},
        }
        try:
            harmonize = check_max_sigma(self.harmonize_mm)
        except ValueError as e:
            raise ConfigError(str(e).replace("max_sigma_mm", "harmonize_mm"), field="harmonize_mm",
                              fix="use 0 (off, the bundles' default) or the smoothing width in mm, e.g. 1.5") from e
        if kernel is not None:
            out["kernel_aug_mm"] = kernel
        if harmonize is not None:
            out["harmonize_mm"] = harmonize
        return out

    def preprocess_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``preprocess_ct``; a masker stored by its config becomes the masker again."""
        extra = dict(self.preprocess)
        if isinstance(extra.get("masker"), Mapping):
            extra["masker"] = masker_from_config(extra["masker"], strict=False)
        return {"spacing": tuple(self.spacing), "hu_window": tuple(self.hu_window),
                "margin_mm": self.margin_mm, **extra}


def masker_config(masker: Any) -> dict[str, Any] | None:
    """What a lung masker contributes to the cache key: ``None`` for the default
    :class:`~lungcal.ct.masking.LungMasker` (so the key of the default pipeline never changes),
    else its ``config()`` (a plugged-in masker without one is keyed by its class and its plain
    attributes: numbers, strings, lists; give it a ``config()`` when more than those shapes its masks)."""
    if masker is None:
        return None
    cfg = masker.config() if callable(getattr(masker, "config", None)) else {
        "class": f"{type(masker).__module__}.{type(masker).__qualname__}",
        **{k: v for k, v in sorted(vars(masker).items())
           if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None), list, tuple))}}
    cfg = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else _jsonable(v)
           for k, v in dict(cfg).items()}
    return None if cfg == LungMasker().config() else cfg


def masker_from_config(cfg: Mapping[str, Any], strict: bool = True):
    """The masker a :func:`masker_config` describes. Only the built-in ``LungMasker`` can be rebuilt
    from its settings; another one raises :class:`ConfigError` (``strict``) or comes back as a
    stand-in that keeps its key and raises that error when it is called (a bag builder given its
    own preprocessing never calls it)."""
    fields = {k: v for k, v in cfg.items() if k != "class"}
    if cfg.get("class") != "LungMasker":
        error = ConfigError(f"the bags were built with the lung masker {cfg.get('class')!r}, which the cache cannot "
                          "rebuild from its settings", field="bag_params.preprocess.masker",
                          fix="pass the same preprocessing (its masker object) to the step that builds the bags")
        if strict:
            raise error
        return _UnbuiltMasker(dict(cfg), error)
    return LungMasker(**fields)


class _UnbuiltMasker:
    def __init__(self, cfg: dict, error: ConfigError) -> None:
        self.cfg, self.error = cfg, error

    def config(self) -> dict:
        return dict(self.cfg)

    def __call__(self, hu, spacing):
        raise self.error


def _jsonable(v):
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if callable(getattr(v, "config", None)) and not isinstance(v, type):  # a masker object: keyed by its settings
        return _jsonable(v.config())
    if isinstance(v, (tuple, list, np.ndarray)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


def hash_source(path: str | os.PathLike, mode: str = "content") -> str:
    """sha256 hex digest of an image file or a DICOM series folder.

    ``mode="content"`` hashes bytes (and, for a folder, the sorted relative names); ``"stat"``
    hashes names, sizes and mtimes only.
    """
    if mode not in ("content", "stat"):
        raise ConfigError(f"unknown source hash mode {mode!r}", field="source_mode", fix="use 'content' or 'stat'")
    p = Path(path)
    h = hashlib.sha256()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
        h.update(b"dir\0")
        for f in files:
            h.update(str(f.relative_to(p)).encode() + b"\0")
            _hash_file(h, f, mode)
    elif p.is_file():
        h.update(b"file\0")
        _hash_file(h, p, mode)
    else:
        raise FileNotFoundError("image not found")
    return h.hexdigest()


def _hash_file(h, f: Path, mode: str) -> None:
    if mode == "stat":
        st = f.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}\0".encode())
        return
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    h.update(b"\0")


#: modules of lungcal.ct / lungcal.candidates that do not shape a bag (left out of the fingerprint);
#: detector_config.py maps a detector's config to the detector, and that config is in the key itself;
#: acquisition.py measures a CT for the series-check report and qc_checks.py judges it; neither changes a voxel;
#: sensitivity.py scores a bag against lesions
_NOT_SHAPING = {"__init__.py", "commands.py", "qc.py", "qc_checks.py", "cache.py", "bagfile.py", "evaluate.py",
                "froc.py", "detector_config.py", "acquisition.py", "sensitivity.py"}
#: opt-in detectors of lungcal.candidates: not in the fingerprint of every bag (the default pipeline's
#: bags do not depend on them), but in the key of each bag one of them makes (:func:`detector_code`)
OPT_IN_DETECTORS = {"subsolid.py", "lesions.py"}


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 of the source of the code that shapes a bag (every module of ``lungcal.ct`` and
    ``lungcal.candidates`` but the commands, series checks, cache and evaluation), so that editing
    it invalidates cached bags even without a CACHE_VERSION bump."""
    h = hashlib.sha256()
    for pkg in (Path(_ct_transforms_file).parent, Path(__file__).parent):
        for src in sorted(pkg.glob("*.py")):
            if src.name not in _NOT_SHAPING | OPT_IN_DETECTORS:
                h.update(f"{pkg.name}/{src.name}".encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def detector_code(resolved_detector: Mapping[str, Any]) -> str | None:
    """sha256 of the source of the opt-in detector module (:data:`OPT_IN_DETECTORS`) a resolved
    detector key names by its ``_target_``, else None (the key then needs nothing more)."""
    target = str(resolved_detector.get("_target_", ""))
    module = target.rpartition(".")[0]
    if module.rpartition(".")[0] != __name__.rpartition(".")[0]:
        return None
    src = Path(__file__).parent / (module.rpartition(".")[2] + ".py")
    if src.name not in OPT_IN_DETECTORS or not src.is_file():
        return None
    return hashlib.sha256(src.read_bytes()).hexdigest()


def load_bag(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load a cache entry (``.npz``, no pickles) into a dict of numpy arrays."""
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # truncated or corrupt
        raise CacheError(f"unreadable bag cache entry ({e})", file=path,
                         fix="delete the file; it is rebuilt on the next run") from e
    missing = [k for k in _ENTRY_KEYS if k not in out]
    if missing:
        raise CacheError(f"bag cache entry lacks {missing}", file=path, fix="delete the file; it is rebuilt")
    meta = json.loads(str(out["meta"]))
    if meta.get("version") != CACHE_VERSION:
        raise CacheError(f"bag cache entry has version {meta.get('version')!r}, expected {CACHE_VERSION!r}",
                         file=path, fix="delete the cache folder; it is rebuilt")
    return out


class BagCache:
    """A folder of bag entries named ``<sha256>.npz``.

    Args:
        root: the cache folder (created when needed).
        source_mode: how sources are hashed (see :func:`hash_source`).
    """

    suffix = ".npz"

    def __init__(self, root: str | os.PathLike, source_mode: str = "content") -> None:
        self.root = Path(root)
        self.source_mode = source_mode

    def key(self, source: str | os.PathLike, params: BagParams | Mapping[str, Any] | None = None) -> str:
        """Cache key of ``source`` (a file or DICOM folder) under ``params``."""
        resolved = BagParams.from_any(params).resolved()
        payload = {
            "version": CACHE_VERSION,
            "code": code_fingerprint(),
            "source": hash_source(source, self.source_mode),
            "params": resolved,
        }
        extra = detector_code(resolved["detector"])
        if extra is not None:  # an opt-in detector's own source (the default key is as it was)
            payload["detector_code"] = extra
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / f"{key}{self.suffix}"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def load(self, key: str) -> dict[str, np.ndarray]:
        return load_bag(self.path(key))

    def lock(self, key: str) -> FileLock:
        """An inter-process lock for one entry (``<root>/.locks/<key>.lock``): one builder per entry."""
        (self.root / ".locks").mkdir(parents=True, exist_ok=True)
        return FileLock(self.root / ".locks" / f"{key}.lock")

    def save(self, key: str, entry: Mapping[str, np.ndarray]) -> Path:
        """Write ``entry`` atomically (:func:`lungcal.paths.atomic_write`: temp file, fsync, rename)."""
        missing = [k for k in _ENTRY_KEYS if k not in entry]
        if missing:
            raise ValueError(f"cache entry lacks {missing}")
        final = self.path(key)
        with atomic_write(final) as fh:
            # no pickles: every reader loads with allow_pickle=False
            np.savez(fh, allow_pickle=False, **{k: np.asarray(entry[k]) for k in _ENTRY_KEYS})
        return final

    def get_or_build(self, key: str, build: Callable[[], Mapping[str, np.ndarray]]) -> Path:
        """The entry ``key``, built under its lock when missing; a corrupt entry is rebuilt with a warning.

        Two processes asking for the same entry never both build it, and neither ever reads a
        half-written file (entries appear by atomic rename).
        """
        final = self.path(key)
        with self.lock(key):
            # under the entry's lock nobody else writes it: a temporary file of it is a killed writer's
            for stale in self.root.glob(f".{final.name}.*.tmp"):
                stale.unlink(missing_ok=True)
            if final.is_file():
                try:
                    load_bag(final)
                    return final
                except CacheError as e:
                    logger.warning("rebuilding a corrupt bag cache entry %s (%s)", final.name, e.message)
                    final.unlink(missing_ok=True)
            return self.save(key, build())


def compute_bag(source, params: BagParams | Mapping[str, Any] | None = None,
                preprocess: Callable[..., Mapping[str, Any]] | None = None,
                seed: int | None = None) -> dict[str, np.ndarray]:
    """Preprocess one CT, detect candidates and extract its bag (no caching).

    ``seed``: the scanner-kernel augmentation's draw for this CT (``params.kernel_aug_mm``; default:
    from the hash of the source). Returns a cache entry (see the module docstring).
    """
    params = BagParams.from_any(params)
    resolved = params.resolved()
    out = (preprocess or preprocess_ct)(source, **params.preprocess_kwargs())
    image, lung = out["image"], out["lung_mask"]
    del out
    lung = lung > 0  # the detector's mask as bool: the float32 one (a whole volume at 1 mm) is freed here
    affine = np.asarray(image.affine.detach().cpu().numpy() if hasattr(image.affine, "detach") else image.affine,
                        np.float64) if hasattr(image, "affine") else np.eye(4)
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    if "harmonize_mm" in resolved:
        image = soften(_as_volume(image), resolved["harmonize_mm"], spacing)
    if "kernel_aug_mm" in resolved:
        if seed is None:
            seed = int(hash_source(source)[:15], 16)
        sigma = draw_kernel_sigma(resolved["kernel_aug_mm"], seed)
        image = soften(_as_volume(image), sigma, spacing)
        resolved = {**resolved, "kernel_sigma_mm": [round(float(v), 6) for v in sigma]}
    detector = params.make_detector()
    cands = detector.detect(image, lung, spacing, affine)
    if not isinstance(cands, Candidates):
        raise ConfigError(f"the detector {type(detector).__name__} returned a {type(cands).__name__}, not Candidates",
                          field="bag_params.detector",
                          fix="return lungcal.candidates.detector.Candidates, best score first, from detect()")
    top = cands.top(params.k)
    bag, mask = extract_bag(image, top.voxel, params.k, params.patch_size)
    return {
        "bag": bag, "mask": mask, "world": top.world, "voxel": top.voxel, "radius_mm": top.radius_mm,
        "score": top.score, "affine": affine, "spacing": spacing, "n_detected": np.int64(len(cands)),
        "meta": np.asarray(json.dumps({"version": CACHE_VERSION, "params": resolved}, sort_keys=True)),
    }


def build_entry(source: str, params: BagParams, root: str, source_mode: str = "content",
                preprocess=None) -> tuple[str, bool]:
    """The cache entry of one CT, built unless present: ``(path, built)``; one task of any bag builder."""
    cache = BagCache(root, source_mode)
    key = cache.key(source, params)
    built = []

    def build():
        built.append(True)
        return compute_bag(source, params, preprocess, seed=int(key[:15], 16))

    return str(cache.get_or_build(key, build)), bool(built)


def _build_one(source: str, params: BagParams, root: str, source_mode: str, preprocess) -> str:
    return build_entry(source, params, root, source_mode, preprocess)[0]


def _init_worker() -> None:  # one BLAS/torch thread per worker process
    torch.set_num_threads(1)


def _describe_failure(e: BaseException, source: str) -> str:
    """The exception text with the image path (and its folder names) masked out.

    DICOM/TCIA paths carry patient IDs, so neither the path nor its last two components may
    reach an error message (which ends up in logs).
    """
    text = f"{type(e).__name__}: {e}"
    p = Path(source)
    parts = {source, str(p.resolve()), str(p.parent), str(p.resolve().parent), p.name, p.parent.name}
    for s in sorted((s for s in parts if len(s) >= 4), key=len, reverse=True):
        text = text.replace(s, "<image>")
    return text


def row_failure(row: Mapping[str, Any], i: int, e: BaseException) -> DataError:
    """The error of datalist row ``i`` whose bag failed: its index and pseudonym, the reason with the path masked."""
    why = _describe_failure(e, str(row["image"]))
    return DataError(f"could not build the bag of subject {row.get('subject', '?')} ({why})",
                     row=i, field="image", fix="check that the image of this datalist row reads as a CT")


def build_bags(rows: Sequence[Mapping[str, Any]], params: BagParams | Mapping[str, Any] | None,
               cache_dir: str | os.PathLike, num_workers: int | None = None, progress: bool = True,
               source_mode: str = "content",
               preprocess: Callable[..., Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Build (or reuse) the cached bag of every datalist row, in parallel.

    Args:
        rows: datalist rows ``{"image", "label", "subject", "site", "split", ...}``.
        params: :class:`BagParams` or a mapping of its fields.
        cache_dir: cache folder.
        num_workers: worker processes (default ``min(4, cpu count)``; 0 runs in-process).
        progress: show a tqdm bar.
        source_mode: ``"content"`` or ``"stat"`` source hashing (see :func:`hash_source`).
        preprocess: replacement for ``lungcal.ct.transforms.preprocess_ct`` (picklable; tests).

    Returns:
        One dict per row, in order: the row's fields plus ``"bag"``, the cache entry path (load it
        with :func:`load_bag`).

    Raises:
        DataError: naming the row index and subject pseudonym (never the path) when a row fails;
            entries already written stay valid, and no partial entry is left.
    """
    params = BagParams.from_any(params)
    params.resolved()  # validate before spawning anything
    root = str(Path(cache_dir))
    Path(root).mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(rows):
        if "image" not in r:
            raise DataError("datalist row has no image", row=i, field="image", fix="add the image path")
    if num_workers is None:
        num_workers = min(4, os.cpu_count() or 1)
    bar = None
    if progress:
        bar = tqdm(total=len(rows), desc="bags", unit="CT")
    paths: list[str | None] = [None] * len(rows)

    def fail(i: int, e: BaseException):
        return row_failure(rows[i], i, e)

    try:
        if num_workers <= 0 or len(rows) <= 1:
            for i, r in enumerate(rows):
                try:
                    paths[i] = _build_one(str(r["image"]), params, root, source_mode, preprocess)
                except Exception as e:
                    raise fail(i, e) from e
                if bar is not None:
                    bar.update(1)
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
            with cf.ProcessPoolExecutor(max_workers=num_workers, mp_context=ctx, initializer=_init_worker) as ex:
                futs = {ex.submit(_build_one, str(r["image"]), params, root, source_mode, preprocess): i
                        for i, r in enumerate(rows)}
                try:
                    for fut in cf.as_completed(futs):
                        i = futs[fut]
                        try:
                            paths[i] = fut.result()
                        except Exception as e:
                            raise fail(i, e) from e
                        if bar is not None:
                            bar.update(1)
                except BaseException:
                    for f in futs:
                        f.cancel()
                    raise
    finally:
        if bar is not None:
            bar.close()
    return [{**dict(r), "bag": p} for r, p in zip(rows, paths)]
