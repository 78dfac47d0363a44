"""Datalist -> cached bags -> per-split tensors: the bag-extraction step of the CT bundles.

:class:`CTCohort` (bundle id ``cohort``) takes the bundle's ``preprocessing`` chain and
``detector`` objects and builds (or reuses) one cached bag per CT with
:func:`lungcal.candidates.cache.build_bags`. The cache key is unchanged from the name-based
bundles: it hashes the bag parameters (spacing, HU window, K, P), the detector's settings and the
code of ``lungcal.ct``, so entries written before the move are reused; a lung masker other than the
default :class:`~lungcal.ct.masking.LungMasker` adds its settings to the key. The detector is any
:class:`~lungcal.candidates.detector_config.KeyedDetector` (``detect()`` and ``config()``); one other
than the default :class:`~lungcal.candidates.detector.LoGBlobDetector` goes into ``bag_params`` (and
so into the key and a checkpoint) as its config, from which inference rebuilds it.

With ``qc`` (the bundle's ``qc`` section) every CT goes through the series checks first
(:mod:`lungcal.ctapp.data.series_qc`, cached per CT): a CT that fails a check is skipped, the count
and a reason table are printed, and :meth:`CTCohort.log_qc` logs ``qc.csv`` to the run. The checks
also measure each CT's acquisition (slices, pixels, air, noise, edge width; :mod:`lungcal.ct.acquisition`):
:meth:`CTCohort.log_acquisition` logs the training split's summary, without identifiers, as
``data/acquisition.json`` (:data:`lungcal.tracking.ACQUISITION_ARTIFACT`), what a site check compares
a new site's CTs with (:func:`lungcal.tracking.lookup.run_acquisition_summary` reads it back).

With ``stream_bags`` (bundle key of the same name) the train split is not stacked in memory: its
bags are read from the cache one per item (:mod:`lungcal.ctapp.data.bagstream`); validation and test
stay in memory. :meth:`CTCohort.rows` are the rows a run builds, which ``lungcal build-bags``
builds ahead of training (:mod:`lungcal.ctapp.data.bagbuild`).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lungcal.candidates.cache import BagParams, build_bags, load_bag, masker_config, row_failure
from lungcal.candidates.detector_config import detector_bag_params
from lungcal.ct.acquisition import AcquisitionStats, summarize_acquisitions
from lungcal.ct.masking import LungMasker
from lungcal.ct.qc import QCConfig
from lungcal.ct.transforms import LungMaskd
from lungcal.ctapp.data.bagset import BagSet
from lungcal.ctapp.data.bagstream import stream_split
from lungcal.ctapp.data.checked_bags import check_and_bag_rows
from lungcal.ctapp.data.runners import LocalRunner
from lungcal.ctapp.data.series_qc import acquisitions, keep_passing, qc_csv_rows, screen, write_qc_csv
from lungcal.data.manifest import load_manifest, manifest_source, rows_for_split
from lungcal.data.synthetic import ensure_demo_cohort
from lungcal.data.synthetic.scanners import resolve_mix
from lungcal.errors import ConfigError, DataError
from lungcal.paths import default_output_dir
from lungcal.runtime.distributed import is_rank_zero, rank_zero_first
from lungcal.tracking import ACQUISITION_ARTIFACT, file_digest
from lungcal.workflow.stages import stage

__all__ = ["SPLITS", "resolve_output_dir", "load_split", "ChainPreprocess", "CTCohort", "chain_masker"]

SPLITS = ("train", "val", "test")


def resolve_output_dir(output_dir: str | os.PathLike | None) -> Path:
    """``output_dir`` (absolute, created), or the project default (``runs/`` or ``$LUNGCAL_HOME``)."""
    out = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    out.mkdir(parents=True, exist_ok=True)
    return out


def load_split(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack the cached bags of ``entries`` (rows returned by ``build_bags``)."""
    loaded = [load_bag(e["bag"]) for e in entries]
    if not loaded:
        return {"bags": torch.empty(0), "mask": torch.empty(0, dtype=torch.bool),
                "labels": torch.empty(0, dtype=torch.long), "subjects": [], "candidates": [], "images": []}
    return {
        "bags": torch.from_numpy(np.stack([d["bag"] for d in loaded]).astype(np.float32)),
        "mask": torch.from_numpy(np.stack([d["mask"] for d in loaded]).astype(bool)),
        "labels": torch.tensor([int(e.get("label", -1)) for e in entries], dtype=torch.long),
        "subjects": [str(e.get("subject", f"ct{i:04d}")) for i, e in enumerate(entries)],
        "candidates": [{"world": d["world"], "score": d["score"], "radius_mm": d["radius_mm"]} for d in loaded],
        # the source of each bag (image path, DICOM series), for pictures of the split's CTs; local only
        "images": [{"image": e.get("image"), "series_uid": e.get("series_uid")} for e in entries],
    }


class ChainPreprocess:
    """``preprocess(path, **ignored)`` for :func:`build_bags` from a preprocessing chain on ``{"image": path}``."""

    def __init__(self, chain: Callable[[dict], Mapping[str, Any]]) -> None:
        self.chain = chain

    def __call__(self, path, **_: Any) -> dict[str, Any]:
        out = self.chain({"image": str(path)})
        return {"image": out["image"], "lung_mask": out["lung_mask"]}


class CTCohort:
    """The CTs of a datalist (or the built-in synthetic cohort) as cached bags, per split.

    Args:
        datalist: datalist JSON; ``None`` uses the built-in synthetic cohort (generated once).
        preprocessing: the CT chain, ``{"image": path} -> {"image", "lung_mask"}``
            (``lungcal.ct.transforms.build_preprocess``); built with ``spacing`` and ``hu_window``.
        detector: the nodule-candidate detector: ``LoGBlobDetector`` (``None``: its defaults) or any
            object with ``detect(image, lung_mask, spacing, affine) -> Candidates`` and ``config()``
            (:mod:`lungcal.candidates.detector_config`); its settings go into the cache key and
            ``bag_params``.
        spacing, hu_window, k, patch_size: bag parameters (part of the cache key).
        output_dir: data and caches go under it (``data/``, ``cache/bags``).
        num_workers: bag-building processes (0 = in-process).
        demo_subjects: size of the synthetic cohort when it is generated (``None``: its default).
        demo_scanner_mix: the synthetic cohort from a scanner mix (a name in
            :data:`lungcal.data.synthetic.SCANNER_MIXES`, e.g. ``"four_vendors"``, the CT bundles'
            ``demo_scanner_mix`` since issue 43); ``None``: one pinned scanner.
            Ignored with a datalist.
        qc: series-check thresholds (:class:`~lungcal.ct.qc.QCConfig` or a mapping of its
            fields): failing CTs are skipped; ``None`` checks nothing.
        stream_bags: read the train split's bags from the cache per item instead of stacking
            them in memory (:func:`lungcal.ctapp.data.bagstream.stream_split`).
        kernel_augment_mm: the scanner-kernel augmentation of the *train* split's bags
            (:mod:`lungcal.ct.kernel`): the largest extra Gaussian width in mm (one number or one
            per axis); None or 0 turns it off. Val and test bags, and ``bag_params`` (what a
            checkpoint stores for inference), never include it.
        harmonize_mm: the resolution harmonization of *every* bag (``BagParams.harmonize_mm``): each
            resampled CT is smoothed by this Gaussian width (mm) before detection and patches, so
            sharp- and soft-kernel scans look alike; it goes into ``bag_params``, so inference and
            recalibration rebuild a checkpoint's bags the same way. None or 0 turns it off.
    """

    def __init__(self, datalist: str | None, preprocessing: Callable | None = None, detector: Any = None,
                 spacing: Sequence[float] = (2.5, 2.5, 2.5), hu_window: Sequence[float] = (-1000, 400), k: int = 8,
                 patch_size: int = 16, output_dir: str | os.PathLike | None = None, num_workers: int = 2,
                 demo_subjects: int | None = None, qc: QCConfig | Mapping[str, Any] | None = None,
                 demo_scanner_mix: str | None = None,
                 stream_bags: bool = False, kernel_augment_mm: Sequence[float] | float | None = None,
                 harmonize_mm: Sequence[float] | float | None = None) -> None:
        self.datalist = datalist
        self.output_dir = resolve_output_dir(output_dir)
        detector_params = detector_bag_params(detector)  # ConfigError naming 'detector' unless keyable
        self.bag_params: dict[str, Any] = {
            "spacing": [float(s) for s in spacing], "hu_window": [float(h) for h in hu_window],
            "k": int(k), "patch_size": int(patch_size)}
        if detector_params is not None:
            self.bag_params["detector"] = detector_params
        harmonize = BagParams(harmonize_mm=harmonize_mm).resolved().get("harmonize_mm")  # ConfigError naming it
        if harmonize is not None:
            self.bag_params["harmonize_mm"] = harmonize
        self.masker = chain_masker(preprocessing)
        key = masker_config(self.masker)
        if key is not None:
            self.bag_params["preprocess"] = {"masker": key}
        self.preprocess = ChainPreprocess(preprocessing) if preprocessing is not None else None
        self.qc = None if qc is None else QCConfig.from_any(qc)
        self.qc_rows: list[dict[str, str]] = []
        #: (image, series_uid) -> (row, acquisition statistics or None) of every row a run uses
        self.acquired: dict[tuple[str, str], tuple[dict, AcquisitionStats | None]] = {}
        self.skipped: list[str] = []
        self.num_workers = int(num_workers)
        self.demo_subjects = demo_subjects
        self.demo_scanner_mix = str(demo_scanner_mix) if demo_scanner_mix else None
        if self.demo_scanner_mix is not None:
            resolve_mix(self.demo_scanner_mix)  # ConfigError naming scanner_mix now, not after a datalist check
        if not isinstance(stream_bags, bool):
            raise ConfigError(f"stream_bags must be true or false, got {stream_bags!r}", field="stream_bags",
                              fix="set stream_bags to true (train bags read from disk) or false (in memory)")
        self.stream_bags = stream_bags
        self.kernel_augment_mm = kernel_augment_mm
        _ = self.train_bag_params  # validate now (ConfigError naming augment_kernel_mm), not after the series checks
        self.splits: dict[str, dict[str, Any]] = {}
        self.source, self.digest, self.site = "synthetic", "", "synthetic"

    @classmethod
    def with_bag_params(cls, datalist: str | None, bag_params: Mapping[str, Any], **kwargs: Any) -> CTCohort:
        """A cohort whose bags use stored ``bag_params`` (a stage-1 checkpoint's), i.e. the same cache entries."""
        cohort = cls(datalist, **kwargs)
        cohort.bag_params = dict(bag_params)
        return cohort

    @property
    def train_bag_params(self) -> dict[str, Any]:
        """The train split's bag parameters: ``bag_params`` plus the kernel augmentation when on."""
        if self.kernel_augment_mm is None:
            return dict(self.bag_params)
        params = {**self.bag_params, "kernel_aug_mm": self.kernel_augment_mm}
        resolved = BagParams.from_any(params).resolved()
        if "kernel_aug_mm" not in resolved:  # 0: off
            return dict(self.bag_params)
        return {**self.bag_params, "kernel_aug_mm": resolved["kernel_aug_mm"]}

    @property
    def isotropic(self) -> bool:
        spacing = np.asarray(self.bag_params["spacing"], float)
        return bool(np.allclose(spacing, spacing[0]))

    def datalist_path(self) -> Path:
        if self.datalist in (None, "", "synthetic"):
            overrides: dict[str, Any] = {}
            if self.demo_subjects is not None:
                overrides["n_subjects"] = int(self.demo_subjects)
            if self.demo_scanner_mix is not None:
                overrides["scanner_mix"] = self.demo_scanner_mix
            with stage("synthetic demo cohort", "made on first use, read back afterwards"):
                return Path(ensure_demo_cohort(self.output_dir / "data", **overrides))
        path = Path(str(self.datalist)).expanduser()
        if not path.is_file():
            raise DataError("datalist not found", file=path, field="datalist",
                            fix="pass a datalist JSON made by `lungcal import-nlst`/`import-site`/`synth`, "
                                "or omit --datalist for the built-in synthetic cohort")
        return path

    @property
    def cache_dir(self) -> Path:
        """The bag cache folder (``<output_dir>/cache/bags``)."""
        return self.output_dir / "cache" / "bags"

    def rows(self, splits: Sequence[str] = SPLITS) -> list[dict]:
        """The datalist rows of ``splits`` whose bags a run builds (the series checks' failures left out)."""
        wanted = self._wanted(splits)
        if self.qc is not None:
            return self._screen(wanted)
        self.acquired.update({_row_key(r): (r, None) for r in wanted})  # not measured: no series checks
        return wanted

    def _wanted(self, splits: Sequence[str]) -> list[dict]:
        """The datalist rows of ``splits`` (nothing checked yet); notes the source, digest and site."""
        path = self.datalist_path()
        rows = load_manifest(path)
        self.source = manifest_source(path) if self.datalist not in (None, "", "synthetic") else "synthetic"
        self.digest = file_digest(path)
        sites = sorted({str(r.get("site", "")) for r in rows if r.get("site")})
        self.site = ",".join(sites) if sites else "unknown"
        return [r for s in splits for r in rows_for_split(rows, s)]

    def load(self, splits: Sequence[str] = SPLITS) -> CTCohort:
        """Build (or reuse) the bags of ``splits`` once; later calls return at once. With ``qc`` the
        series checks run inside the bag pass, one read and one lung mask per CT
        (:mod:`lungcal.ctapp.data.checked_bags`)."""
        if all(s in self.splits for s in splits):
            return self
        with rank_zero_first():  # under torchrun rank 0 makes the cohort and the caches, then the others read them
            if self.qc is not None:
                built = self._checked_bags(self._wanted(splits))
            else:
                rows = self.rows(splits)
                train = self.train_bag_params  # the train split's own entries when the kernel augmentation is on
                soft = [train != self.bag_params and r.get("split") == "train" for r in rows]
                groups = [(self.bag_params, [r for r, t in zip(rows, soft) if not t]),
                          (train, [r for r, t in zip(rows, soft) if t])]
                with stage("bags", f"{len(rows)} CTs (cached ones are read back)"):
                    built = [e for params, group in groups if group
                             for e in build_bags(group, params, self.cache_dir, num_workers=self.num_workers,
                                                 preprocess=self.preprocess, progress=is_rank_zero())]
        for s in splits:
            entries = [e for e in built if e.get("split") == s]
            self.splits[s] = stream_split(entries) if self.stream_bags and s == "train" else load_split(entries)
        return self

    def _params_of(self, row: Mapping[str, Any]) -> BagParams:
        """A row's bag parameters: the train split's (kernel augmentation) or everyone's."""
        return BagParams.from_any(self.train_bag_params if row.get("split") == "train" else self.bag_params)

    def _checked_bags(self, rows: list[dict]) -> list[dict]:
        """The series checks and the bags of ``rows`` in one pass (one read per CT): the rows that
        failed no check, each with its ``bag``; the failures' table printed, as :meth:`_screen` does.
        A CT that cannot be bagged raises the :class:`DataError` naming its row and pseudonym."""
        masker = self.masker or LungMasker()  # what the QC cache is keyed by, as in _screen
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with stage("series checks and bags", f"{len(rows)} CTs, one read each (cached ones are read back)"):
            results, errors = check_and_bag_rows(
                rows, [self._params_of(r) for r in rows], self.qc or QCConfig(), masker,
                str(self.output_dir / "cache" / "qc"), str(self.cache_dir), self.preprocess,
                runner=LocalRunner(self.num_workers), progress=is_rank_zero(), stop_on_error=True)
        if errors:
            i = min(errors)
            raise row_failure(rows[i], i, errors[i]) from errors[i]
        reports = [None if c is None else c.report for c in results]
        self.qc_rows = qc_csv_rows(rows, reports)
        kept, self.skipped = keep_passing(rows, reports, show=is_rank_zero())
        self.acquired.update({_row_key(r): (r, a) for r, rep, a in zip(rows, reports, acquisitions(reports))
                              if rep is None or not rep.failed})
        return [{**r, "bag": c.bag} for r, c in zip(rows, results) if c is not None and c.bag is not None]

    def _screen(self, rows: list[dict]) -> list[dict]:
        """Run (or read back) the series checks; keep the rows that failed none."""
        with stage("series checks", f"{len(rows)} CTs (cached ones are read back)"):
            reports = screen(rows, self.qc, self.output_dir / "cache" / "qc", masker=self.masker or LungMasker(),
                             num_workers=self.num_workers, progress=is_rank_zero())
        self.qc_rows = qc_csv_rows(rows, reports)
        kept, self.skipped = keep_passing(rows, reports, show=is_rank_zero())
        self.acquired.update({_row_key(r): (r, a) for r, rep, a in zip(rows, reports, acquisitions(reports))
                              if rep is None or not rep.failed})
        return kept

    def acquisition_summary(self, split: str = "train") -> dict[str, Any]:
        """The acquisition summary of the CTs of ``split`` this cohort uses (the series checks' measurements and
        the rows' scanner-profile and kernel names; :func:`lungcal.ct.acquisition.summarize_acquisitions`),
        plus ``split`` and ``measured`` (false when the series checks are off: only the names are counted)."""
        pairs = [(r, a) for r, a in self.acquired.values() if r.get("split") == split]
        rows_acq: list[Mapping[str, Any]] = [r["acquisition"] if isinstance(r.get("acquisition"), Mapping) else {}
                                             for r, _ in pairs]
        summary = summarize_acquisitions([a for _, a in pairs], [ra.get("profile") for ra in rows_acq],
                                         [ra.get("kernel") for ra in rows_acq])
        return {"split": split, "measured": self.qc is not None, **summary}

    def log_acquisition(self, tracker: Any, split: str = "train") -> None:
        """Log :meth:`acquisition_summary` of ``split`` as ``data/acquisition.json`` to ``tracker``'s run."""
        tracker.log_dict(self.acquisition_summary(split), ACQUISITION_ARTIFACT)

    def log_qc(self, tracker: Any) -> None:
        """Log ``qc.csv`` (pseudonym, check, verdict, value) to ``tracker``'s run, when the CTs were checked."""
        if not self.qc_rows:
            return
        with tempfile.TemporaryDirectory() as tmp:
            tracker.log_artifact(write_qc_csv(Path(tmp) / "qc.csv", self.qc_rows))

    def split(self, name: str) -> dict[str, Any]:
        """The tensors of split ``name`` (``DataError`` when the datalist has none)."""
        data = self.load().splits[name]
        if len(data["subjects"]) == 0:
            raise DataError(f"the datalist has no '{name}' rows", file=self.datalist_path(), field="split",
                            fix="give the datalist train, val and test rows (lungcal check-data shows the counts)")
        return data

    def dataset(self, name: str, augment: bool = False, seed: int = 0, noise_hu: float = 0.0) -> BagSet:
        """A :class:`BagSet` of split ``name`` (bundle ids ``train#dataset`` / ``validate#dataset``).

        ``noise_hu``: with ``augment``, the largest standard deviation (HU) of the scanner-noise
        augmentation (:func:`lungcal.ctapp.data.bagset.random_noise`); 0 turns it off.
        """
        data = self.split(name)
        lo, hi = self.bag_params["hu_window"]
        if not 0.0 <= float(noise_hu) < float(hi) - float(lo):
            raise ConfigError(f"augment_noise_hu must be in [0, {hi - lo:g}) HU, got {noise_hu}",
                              field="augment_noise_hu", fix="use 0 (off) or a noise level in HU, e.g. 30")
        return BagSet(data["bags"], data["mask"], data["labels"], augment=augment, isotropic=self.isotropic, seed=seed,
                      noise_std=float(noise_hu) / (float(hi) - float(lo)))

    def loader(self, name: str, batch_size: int, shuffle: bool = False, seed: int = 0,
               augment: bool = False) -> torch.utils.data.DataLoader:
        """A single-process loader of split ``name``; shuffling uses its own generator seeded by ``seed``."""
        return make_loader(self.dataset(name, augment, seed), batch_size, shuffle, seed)


def _row_key(row: Mapping[str, Any]) -> tuple[str, str]:
    return str(row.get("image", "")), str(row.get("series_uid") or "")


def chain_masker(chain: Any) -> Any:
    """The lung masker of a preprocessing chain (its :class:`~lungcal.ct.transforms.LungMaskd`'s), else None."""
    for t in getattr(chain, "transforms", ()):
        if isinstance(t, LungMaskd):
            return t.masker
    return None


def make_loader(dataset: torch.utils.data.Dataset, batch_size: int, shuffle: bool = False,
                seed: int = 0) -> torch.utils.data.DataLoader:
    """``DataLoader`` in the main process with its own generator (the global RNG is not consumed by shuffling)."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.utils.data.DataLoader(dataset, batch_size=int(batch_size), shuffle=bool(shuffle), generator=generator,
                                       num_workers=0)
