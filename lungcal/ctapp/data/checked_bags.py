"""One read and one lung mask per CT on the way to its bag: the series checks inside the bag pass.

A training run used to read and mask every CT twice: once for the series checks
(:mod:`lungcal.ctapp.data.series_qc`), once for its bag (:func:`lungcal.candidates.cache.build_entry`).
:func:`check_and_bag` is one CT's task that does both on one read: it loads the CT, runs the checks
with the lung masker (keeping the mask it computes), caches the report where ``lungcal qc``,
training's skip list and inference read it, and, when no check failed, hands the loaded volume and
its mask to the rest of the preprocessing chain (:class:`~lungcal.ct.transforms.LungMaskd` reuses the
mask) and builds the bag. The report and the bag are the ones the two passes would give, bit for bit
(``tests/ctapp/test_checked_bags.py``), under the same cache keys.

A CT whose report or bag is already cached is not read twice either: a cached report and a missing
bag build the bag as before; a cached bag and a missing report run the checks alone. The one-read
path is taken only where it is exactly the two passes' result: the chain starts with the CT loader,
the row names no DICOM series (the bag reader ignores one), and the CT reads without a gap; any other
CT goes the two-pass way.

:func:`check_and_bag_rows` runs the task over rows on a :class:`~lungcal.ctapp.data.runners.Runner`
with one progress bar, and returns each row's report, bag and error.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from lungcal.candidates.cache import BagCache, BagParams, build_entry, compute_bag, masker_config
from lungcal.ct.io import load_ct
from lungcal.ct.masking import Masker, mask_like
from lungcal.ct.qc import QCConfig, QCReport, check_series
from lungcal.ct.transforms import CTCompose, LoadCTd, LungMaskd, build_preprocess
from lungcal.ctapp.data.runners import LocalRunner, Runner
from lungcal.ctapp.data.series_qc import read_report, report_path, screen_one, store_report
from lungcal.errors import ConfigError

__all__ = ["Checked", "check_and_bag", "check_and_bag_rows"]


@dataclass
class Checked:
    """One CT's outcome: its series-check ``report`` (None: unreadable), its bag cache entry ``bag``
    (None: a check failed, so it has none), whether the bag was ``built`` now, and whether the
    checks and the bag came from ``one_read``."""

    report: QCReport | None
    bag: str | None
    built: bool = False
    one_read: bool = False


class _RecordingMasker:
    """The lung masker, keeping the last mask it returned (the checks' mask, reused for the bag)."""

    def __init__(self, masker: Masker) -> None:
        self.masker = masker
        self.mask: np.ndarray | None = None

    def __call__(self, hu: np.ndarray, spacing: Any) -> np.ndarray:
        self.mask = np.asarray(self.masker(hu, spacing))
        return self.mask


class _Given:
    """A ``preprocess`` for :func:`compute_bag` that returns a chain's output already computed."""

    def __init__(self, out: Mapping[str, Any]) -> None:
        self.out = {"image": out["image"], "lung_mask": out["lung_mask"]}

    def __call__(self, *_: Any, **__: Any) -> dict[str, Any]:
        return self.out


def _chain_of(preprocess: Any, params: BagParams) -> CTCompose | None:
    """The preprocessing chain a bag of ``params`` is made with, when it starts with the CT loader."""
    chain = build_preprocess(**params.preprocess_kwargs()) if preprocess is None else getattr(preprocess, "chain", None)
    transforms = getattr(chain, "transforms", ())
    if not isinstance(chain, CTCompose) or not transforms or type(transforms[0]) is not LoadCTd:
        return None
    return chain


def _same_masker(chain: CTCompose, masker: Masker) -> bool:
    """Whether the chain's lung mask is the one ``masker`` computes (so the checks' mask may stand in)."""
    for t in chain.transforms:
        if isinstance(t, LungMaskd):
            return t.masker is masker or masker_config(t.masker) == masker_config(masker)
    return False


def _one_read(source: str, cfg: QCConfig, masker: Masker, chain: CTCompose, path: Any
              ) -> tuple[QCReport, dict[str, Any] | None] | None:
    """Read ``source`` once: its report (cached at ``path``) and, when no check failed, the chain's
    output on the same volume and mask. None when the CT does not read cleanly (the two passes then
    report it as they always have)."""
    try:
        image = load_ct(source)
    except Exception:  # noqa: BLE001 - unreadable, a gap, ...: the two-pass path names it
        return None
    recorder = _RecordingMasker(masker)
    report = check_series(image, config=cfg, masker=recorder)
    store_report(path, report)
    if report.failed:
        return report, None
    data: dict[str, Any] = {"image": image}
    if recorder.mask is not None and _same_masker(chain, masker):
        data["lung_mask"] = mask_like(recorder.mask.astype(bool, copy=False), image)
    out = CTCompose(list(chain.transforms[1:]))(data)
    return report, out


def check_and_bag(source: str, series_uid: str | None, cfg: QCConfig, masker: Masker, qc_root: str,
                  params: BagParams, bag_root: str, preprocess: Any = None) -> Checked:
    """One CT's series checks and bag, on one read where neither is cached (module docstring).

    The report is cached under ``qc_root`` (as :func:`~lungcal.ctapp.data.series_qc.screen_one`
    caches it), the bag under ``bag_root`` (as :func:`~lungcal.candidates.cache.build_entry`). A CT
    that fails a check gets no bag. Raises what the bag builder raises for a CT that cannot be bagged
    (its report is cached first).
    """
    params = BagParams.from_any(params)
    path = report_path(source, series_uid, cfg, masker, qc_root)
    report = None if path is None else read_report(path)
    cache = BagCache(bag_root, "content")
    if report is None and path is not None and series_uid is None:
        key = cache.key(source, params)
        chain = _chain_of(preprocess, params)
        if key not in cache and chain is not None:
            one = _one_read(source, cfg, masker, chain, path)
            if one is not None:
                report, out = one
                if out is None:
                    return Checked(report, None, one_read=True)
                built: list[bool] = []

                def build() -> dict[str, np.ndarray]:
                    built.append(True)
                    return compute_bag(source, params, _Given(out), seed=int(key[:15], 16))

                return Checked(report, str(cache.get_or_build(key, build)), bool(built), one_read=True)
    if report is None:
        report = screen_one(source, series_uid, cfg, masker, qc_root)
    if report is not None and report.failed:
        return Checked(report, None)
    bag, built_now = build_entry(source, params, bag_root, "content", preprocess)
    return Checked(report, bag, built_now)


def check_and_bag_rows(rows: Sequence[Mapping[str, Any]], params: Sequence[BagParams],
                       cfg: QCConfig | Mapping[str, Any], masker: Masker, qc_root: str, bag_root: str,
                       preprocess: Any = None, runner: Runner | None = None, progress: bool = True,
                       stop_on_error: bool = False) -> tuple[list[Checked | None], dict[int, BaseException]]:
    """:func:`check_and_bag` for every row (``params[i]``: row ``i``'s bag parameters), on ``runner``
    (default: in-process), one bar. Returns each row's :class:`Checked` (None where it raised) and the
    exceptions by row; a :class:`~lungcal.errors.ConfigError` (the same for every row) is raised at once,
    and with ``stop_on_error`` the first row error ends the pass."""
    cfg = QCConfig.from_any(cfg)
    runner = runner if runner is not None else LocalRunner(0)
    tasks = [(str(r["image"]), r.get("series_uid") or None, cfg, masker, str(qc_root), p, str(bag_root), preprocess)
             for r, p in zip(rows, params)]
    results: list[Checked | None] = [None] * len(rows)
    errors: dict[int, BaseException] = {}
    with tqdm(total=len(tasks), desc="series checks + bags", unit="CT", disable=not progress or not tasks) as bar:
        for i, value, exc in runner.run(check_and_bag, tasks):
            if exc is not None:
                if isinstance(exc, ConfigError):
                    raise exc
                errors[i] = exc
                if stop_on_error:
                    break
            results[i] = value
            bar.update(1)
    return results, errors
