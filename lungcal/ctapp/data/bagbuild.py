"""``lungcal build-bags``: fill the bag cache ahead of training, on local processes or a Dask cluster.

:func:`cohort_from_params` makes the :class:`~lungcal.ctapp.data.cohort.CTCohort` a bundle would make
(its ``preprocessing`` chain, lung masker, ``detector``, ``spacing``, ``hu_window``, ``k``,
``patch_size``, ``qc`` and ``output_dir``, with any override files merged as
``monai.bundle`` merges them), or one from a plain JSON of bag parameters (the
:class:`~lungcal.candidates.cache.BagParams` fields, as a stage-1 checkpoint stores them).
:func:`build_cohort` runs one task per row on a runner: with the bundle's ``qc``, the series checks
and the bag on one read (:func:`~lungcal.ctapp.data.checked_bags.check_and_bag`, the reports cached
as a training run's), else :func:`~lungcal.candidates.cache.build_entry`. The runner is
:class:`~lungcal.ctapp.data.runners.LocalRunner` (in-process or a process pool, as training builds) or
``lungcal.ctapp.data.dask_bags.DaskRunner`` (a ``dask.distributed`` cluster; optional extra
``[cluster]``). The tasks, hence the cache keys and entries, are the ones training would
compute, so a training run afterwards builds nothing. Entries already present are verified and
kept (``cached``); a failing row does not stop the others: every failure is reported with its
row index and pseudonym (never the path), and the command then exits 2.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from monai.bundle import ConfigParser
from tqdm.auto import tqdm

from lungcal.candidates.cache import BagParams, build_entry, row_failure
from lungcal.ct.masking import LungMasker
from lungcal.ct.qc import QCReport
from lungcal.ctapp.data.checked_bags import check_and_bag_rows
from lungcal.ctapp.data.cohort import SPLITS, CTCohort
from lungcal.ctapp.data.runners import LocalRunner, Runner
from lungcal.ctapp.data.series_qc import keep_passing, screen_one
from lungcal.data.manifest import load_manifest, rows_for_split
from lungcal.errors import ConfigError, DataError
from lungcal.runtime.exit_hook import find_lungcal_error

__all__ = ["BuildReport", "LocalRunner", "bag_tasks", "build_cohort", "check_series_on", "cohort_from_params"]

def cohort_from_params(params: str | os.PathLike | Sequence[str | os.PathLike], datalist: str | None,
                       output_dir: str | None = None, num_workers: int | None = None) -> CTCohort:
    """The cohort whose bags a bundle (or a bag-parameter JSON) would build for ``datalist``.

    ``params``: a CT bundle (``bundles/nlst_focal.json``), optionally followed by override files
    merged over it; or one JSON of :class:`BagParams` fields. A bundle's ``%`` macros resolve
    from the working directory (the project root), as under ``monai.bundle run``.
    """
    files = [str(params)] if isinstance(params, (str, os.PathLike)) else [str(p) for p in params]
    for f in files:
        if not Path(f).is_file():
            raise ConfigError("parameter file not found", file=f, field="--params",
                              fix="pass a CT bundle (bundles/nlst_focal.json) or a JSON of bag parameters")
    try:
        parser = ConfigParser()
        parser.read_config(files)
        is_bundle = "cohort" in parser.get()
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the parameter file(s) ({e})", field="--params",
                          fix="pass valid JSON: a CT bundle or a JSON of bag parameters") from e
    if not is_bundle:
        if len(files) > 1:
            raise ConfigError("several --params files but none is a CT bundle (no 'cohort' section)",
                              field="--params", fix="pass one bag-parameter JSON, or a CT bundle and its overrides")
        bag_params = json.loads(Path(files[0]).read_text())
        BagParams.from_any(bag_params).resolved()  # unknown or bad keys: ConfigError naming them
        kw = {} if num_workers is None else {"num_workers": int(num_workers)}
        return CTCohort.with_bag_params(datalist, bag_params, output_dir=output_dir, **kw)
    parser["datalist"] = datalist
    if output_dir is not None:
        parser["output_dir"] = str(output_dir)
    if num_workers is not None:
        parser["num_workers"] = int(num_workers)
    try:
        cohort = parser.get_parsed_content("cohort")
    except Exception as e:  # MONAI wraps what the objects raise
        found = find_lungcal_error(e)
        if found is not None:
            raise found from e
        raise ConfigError(f"the bundle's cohort could not be made ({type(e).__name__}: {str(e).splitlines()[0]})",
                          field="--params", fix="run from the project root (a bundle's % macros resolve from the "
                                                "working directory) with a CT bundle such as bundles/nlst_focal.json"
                          ) from e
    if not isinstance(cohort, CTCohort):
        raise ConfigError(f"the bundle's cohort is a {type(cohort).__name__}, not a CTCohort", field="cohort",
                          fix="use a CT bundle (bundles/nlst_*.json)")
    return cohort


@dataclass
class BuildReport:
    """What :func:`build_cohort` did: counts and one :class:`DataError` per failed row."""

    total: int = 0
    built: int = 0
    cached: int = 0
    failures: list[DataError] = field(default_factory=list)
    where: str = ""

    def summary(self) -> str:
        line = (f"bags: {self.total} CT(s): {self.built} built, {self.cached} already cached, "
                f"{len(self.failures)} failed ({self.where})")
        return "\n".join([line] + [f"  failed: {e}" for e in self.failures])

    def raise_for_failures(self) -> None:
        """A :class:`DataError` naming how many rows failed and the first (row, pseudonym, reason)."""
        if self.failures:
            first = self.failures[0]
            raise DataError(f"{len(self.failures)} of {self.total} CT(s) failed; the first: {first.message}",
                            row=first.row, field="image",
                            fix="check those rows' images (the others are cached; a rerun builds only the failed)")


def bag_tasks(cohort: CTCohort, rows: Sequence[dict]) -> list[tuple]:
    """The :func:`build_entry` arguments of each row: exactly what ``cohort.load()`` would build."""
    params = BagParams.from_any(cohort.bag_params)
    params.resolved()  # validate before anything is sent anywhere
    train = BagParams.from_any(cohort.train_bag_params)  # the train split's (kernel augmentation)
    root = str(cohort.cache_dir)
    for i, r in enumerate(rows):
        if "image" not in r:
            raise DataError("datalist row has no image", row=i, field="image", fix="add the image path")
    return [(str(r["image"]), train if r.get("split") == "train" else params, root, "content", cohort.preprocess)
            for r in rows]


def check_series_on(runner: Runner, cohort: CTCohort, splits: Sequence[str] = SPLITS,
                    progress: bool = True) -> tuple[list[dict], list[QCReport | None] | None]:
    """The rows of ``splits`` and, when the cohort has ``qc``, their series-check reports, computed as
    ``runner`` tasks (:func:`~lungcal.ctapp.data.series_qc.screen_one`: each stores its report in the
    cohort's QC cache, where a training run reads it back). Nothing is read here but the datalist:
    on a cluster no CT is hashed or loaded on the client. A check that cannot run gives ``None``,
    as an unreadable image does: the bag builder then reports that row."""
    rows = [r for s in splits for r in rows_for_split(load_manifest(cohort.datalist_path()), s)]
    if cohort.qc is None:
        return rows, None
    root = cohort.output_dir / "cache" / "qc"
    root.mkdir(parents=True, exist_ok=True)
    masker = cohort.masker or LungMasker()  # what CTCohort._screen keys the reports by
    tasks = [(str(r["image"]), r.get("series_uid") or None, cohort.qc, masker, str(root)) for r in rows]
    reports: list[QCReport | None] = [None] * len(rows)
    with tqdm(total=len(tasks), desc="series checks", unit="CT", disable=not progress or not tasks) as bar:
        for i, value, exc in runner.run(screen_one, tasks):
            if isinstance(exc, ConfigError):  # the same for every row (e.g. a worker's code differs)
                raise exc
            reports[i] = value
            bar.update(1)
    return rows, reports


def build_cohort(cohort: CTCohort, splits: Sequence[str] = SPLITS, runner: Runner | None = None,
                 progress: bool = True) -> BuildReport:
    """Build (or verify) the cache entry of every row of ``splits`` that passes the series checks, on
    ``runner`` (default: the cohort's ``num_workers`` local processes). With the cohort's ``qc`` the
    checks and the bag of a CT are one task on one read
    (:func:`~lungcal.ctapp.data.checked_bags.check_and_bag`), as training does them; the rows a
    training run would skip are skipped (count and reasons printed, as there). Returns a
    :class:`BuildReport` (no raise on failures)."""
    runner = runner if runner is not None else LocalRunner(cohort.num_workers)
    Path(cohort.cache_dir).mkdir(parents=True, exist_ok=True)
    rows = [r for s in splits for r in rows_for_split(load_manifest(cohort.datalist_path()), s)]
    if cohort.qc is None:
        return _build_bags_on(runner, cohort, rows, progress)
    train = BagParams.from_any(cohort.train_bag_params)
    params = BagParams.from_any(cohort.bag_params)
    params.resolved()  # validate before anything is sent anywhere
    results, errors = check_and_bag_rows(
        rows, [train if r.get("split") == "train" else params for r in rows], cohort.qc,
        cohort.masker or LungMasker(), str(cohort.output_dir / "cache" / "qc"), str(cohort.cache_dir),
        cohort.preprocess, runner=runner, progress=progress)
    reports = [None if c is None else c.report for c in results]
    kept, _ = keep_passing(rows, reports)
    passing = {id(r) for r in kept}
    report = BuildReport(total=len(kept), where=runner.describe())
    index = 0
    for i, (row, c) in enumerate(zip(rows, results)):
        if id(row) not in passing:
            continue
        if i in errors:
            report.failures.append(row_failure(row, index, errors[i]))
        elif c is not None and c.built:
            report.built += 1
        else:
            report.cached += 1
        index += 1
    return report


def _build_bags_on(runner: Runner, cohort: CTCohort, rows: list[dict], progress: bool) -> BuildReport:
    """The bags of ``rows`` (no series checks) as ``runner`` tasks."""
    tasks = bag_tasks(cohort, rows)
    report = BuildReport(total=len(rows), where=runner.describe())
    with tqdm(total=len(rows), desc="bags", unit="CT", disable=not progress or not rows) as bar:
        for i, value, exc in runner.run(build_entry, tasks):
            if exc is not None:
                if isinstance(exc, ConfigError):  # the same for every row (e.g. a worker's code differs)
                    raise exc
                report.failures.append(row_failure(rows[i], i, exc))
            elif value[1]:
                report.built += 1
            else:
                report.cached += 1
            bar.update(1)
    report.failures.sort(key=lambda e: -1 if e.row is None else e.row)  # row_failure sets every row
    return report
