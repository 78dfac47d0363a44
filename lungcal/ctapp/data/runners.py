"""Where the per-CT tasks (series checks, bags) run: :class:`LocalRunner` on this machine, or any
:class:`Runner` (``lungcal.ctapp.data.dask_bags.DaskRunner`` on a ``dask.distributed`` cluster).

A runner yields one :data:`Outcome` per task, as the tasks finish: ``(task index, result or None,
exception or None)``. One task's exception never stops the others; the caller decides.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

__all__ = ["Outcome", "Runner", "LocalRunner"]

#: one task's outcome: (task index, result or None, exception or None)
Outcome = tuple[int, Any, "BaseException | None"]


def _init_worker() -> None:  # one BLAS/torch thread per worker process, as the training builder
    torch.set_num_threads(1)


class Runner(Protocol):
    """What runs the bag tasks: :class:`LocalRunner` or :class:`~lungcal.ctapp.data.dask_bags.DaskRunner`."""

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc: Any) -> None: ...

    def describe(self) -> str: ...

    def run(self, fn: Callable, tasks: Sequence[tuple]) -> Iterator[Outcome]: ...


class LocalRunner:
    """Tasks on this machine: in-process (``num_workers = 0``) or a pool of worker processes."""

    def __init__(self, num_workers: int = 0) -> None:
        self.num_workers = int(num_workers)

    def __enter__(self) -> LocalRunner:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def describe(self) -> str:
        return "in-process" if self.num_workers <= 0 else f"{self.num_workers} local processes"

    def run(self, fn: Callable, tasks: Sequence[tuple]) -> Iterator[Outcome]:
        if self.num_workers <= 0 or len(tasks) <= 1:
            for i, args in enumerate(tasks):
                try:
                    yield i, fn(*args), None
                except Exception as e:
                    yield i, None, e
            return
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
        with cf.ProcessPoolExecutor(max_workers=self.num_workers, mp_context=ctx, initializer=_init_worker) as ex:
            futs = {ex.submit(fn, *args): i for i, args in enumerate(tasks)}
            try:
                for fut in cf.as_completed(futs):
                    exc = fut.exception()
                    yield futs[fut], None if exc else fut.result(), exc
            finally:
                for f in futs:
                    f.cancel()
