"""The bag builder's tasks on a ``dask.distributed`` cluster (``lungcal build-bags --scheduler``).

Needs the optional extra ``[cluster]`` (``dask[distributed]``); only ``lungcal build-bags`` imports
this module, when ``--scheduler`` is given.

- ``--scheduler local:N`` starts a ``LocalCluster`` of N worker processes, one thread each,
  forked from this process where the platform can fork (as the local pool's: a spawned worker
  re-imports torch and MONAI, 30 s and more on a busy 2-core machine).
- ``--scheduler tcp://HOST:8786`` connects to a running scheduler (``dask scheduler`` plus
  ``dask worker``s, or dask-jobqueue's ``SLURMCluster``, README); nothing answering within the
  timeout is one :class:`~lungcal.errors.ConfigError` naming the address.

Every worker must see the cache folder at the same path (a shared filesystem) and run the same
lungcal code: the cache key holds the code's fingerprint, so each task checks that the
worker's equals this process's and refuses otherwise (entries under another key would never be
found by training). Each worker's torch uses one thread (a plugin), as the local pool's.
Tasks go out with ``Client.map`` and come back through ``as_completed``, in any order.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import dask
import torch
from distributed import Client, LocalCluster, as_completed
from distributed.diagnostics.plugin import WorkerPlugin

from lungcal.candidates.cache import code_fingerprint
from lungcal.errors import ConfigError

__all__ = ["DaskRunner", "parse_scheduler", "checked_task"]


def parse_scheduler(scheduler: str) -> tuple[str, int | str]:
    """``("local", N)`` for ``local:N``, ``("address", ADDRESS)`` for a scheduler address."""
    text = str(scheduler).strip()
    if text.startswith("local"):
        n = text.partition(":")[2]
        if not n.isdigit() or int(n) < 1:
            raise ConfigError(f"bad --scheduler {text!r}", field="--scheduler",
                              fix="use local:N with N >= 1 worker processes, or tcp://HOST:8786")
        return "local", int(n)
    if "://" not in text and ":" not in text:
        raise ConfigError(f"bad --scheduler {text!r}", field="--scheduler",
                          fix="use tcp://HOST:8786 (a running Dask scheduler) or local:N")
    return "address", text


class _OneTorchThread(WorkerPlugin):
    """Each worker's torch runs one thread: the cluster's parallelism is its task slots."""

    name = "lungcal-one-torch-thread"

    def setup(self, worker: Any) -> None:
        torch.set_num_threads(1)


def checked_task(fn: Callable, fingerprint: str, *args: Any) -> Any:
    """Run ``fn(*args)`` on a worker whose lungcal code is the client's (same :func:`code_fingerprint`)."""
    if code_fingerprint() != fingerprint:
        raise ConfigError("a Dask worker runs other lungcal code than this process (the bag cache key holds "
                          "the code's fingerprint, so its entries would never be found)", field="--scheduler",
                          fix="install the same lungcal on every worker, then rerun")
    return fn(*args)


class DaskRunner:
    """A ``dask.distributed`` client (and its ``LocalCluster`` for ``local:N``) as a bag-task runner.

    Args:
        scheduler: ``local:N`` or a scheduler address (``tcp://HOST:8786``).
        timeout: seconds to wait for a scheduler to answer.
    """

    def __init__(self, scheduler: str, timeout: float = 10.0) -> None:
        self.kind, self.target = parse_scheduler(scheduler)
        self.timeout = float(timeout)
        self.client: Client | None = None
        self.cluster: LocalCluster | None = None

    def __enter__(self) -> DaskRunner:
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # Dask's INFO lines only with lungcal -v
            logging.getLogger("distributed").setLevel(logging.WARNING)
        if self.kind == "local":
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            with dask.config.set({"distributed.worker.multiprocessing-method": method}):
                self.cluster = LocalCluster(n_workers=int(self.target), threads_per_worker=1, processes=True,
                                            dashboard_address=None, scheduler_kwargs={"dashboard": False})
            self.client = Client(self.cluster)
        else:
            try:
                self.client = Client(str(self.target), timeout=self.timeout)
            except (OSError, TimeoutError):
                raise ConfigError(f"no Dask scheduler answers at {self.target} within {self.timeout:g} s",
                                  field="--scheduler", fix="start one (`dask scheduler` and `dask worker "
                                  f"{self.target}`), check the address, or use --scheduler local:N") from None
        self.client.register_plugin(_OneTorchThread())
        return self

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def describe(self) -> str:
        n = len(self.client.scheduler_info().get("workers", {})) if self.client is not None else 0
        where = "a local Dask cluster" if self.kind == "local" else f"the Dask scheduler at {self.target}"
        return f"{where}, {n} worker(s)"

    def run(self, fn: Callable, tasks: Sequence[tuple]) -> Iterator[tuple[int, Any, BaseException | None]]:
        """Map ``fn`` over ``tasks``; yield ``(index, result, exception)`` as each finishes."""
        if not tasks:
            return
        client = self.client
        if client is None:
            raise RuntimeError("DaskRunner.run needs the runner open: use it in a with block")
        n = len(tasks)
        columns = []
        for col in zip(*tasks):
            first = col[0]
            if all(c is first for c in col) and not isinstance(first, (str, int, float, bool, type(None))):
                # one object shared by every task (the preprocessing chain: ~7 KB pickled): sent to each
                # worker once, not once a task through the scheduler
                first = client.scatter(first, broadcast=True, hash=False)
                columns.append([first] * n)
            else:
                columns.append(list(col))
        futures = client.map(checked_task, [fn] * n, [code_fingerprint()] * n, *columns, pure=False)
        index = {f.key: i for i, f in enumerate(futures)}
        try:
            for fut in as_completed(futures):
                i = index[fut.key]
                if fut.status == "error":
                    yield i, None, fut.exception()
                else:
                    yield i, fut.result(), None
        finally:
            client.cancel([f for f in futures if not f.done()])
