"""Data-parallel training under ``torchrun``: the helpers behind ``bundles/multi_gpu.json``.

The override file (MONAI model-zoo style) wraps ``network`` in
:class:`torch.nn.parallel.DistributedDataParallel` and calls :func:`init_process_group` in
``initialize`` and :func:`destroy_process_group` in ``finalize``. The bundles' loaders take their
sampler from :func:`train_shard` / :func:`eval_shard`: ``None`` in a single process (the loader's
own order, as before), a ``DistributedSampler`` once the process group is up (train: shuffled by
seed and epoch and padded to equal shards, so every rank runs the same number of steps;
evaluation: MONAI's, not padded, so every case is scored exactly once). The samplers are chosen
here and not by keys of the override because MONAI merges an override file before it expands the
variants' ``%`` macros: ``train#dataloader#sampler`` cannot reach into ``"train":
"%bundles/ct_common.json#train"``. Everything here is a no-op in a single process, so the run
steps call it unconditionally:

- :func:`is_rank_zero`: only rank 0 opens the MLflow run, writes checkpoints and the resume
  state, evaluates the test split and prints the summary; the other ranks train and return;
- :func:`rank_zero_first`: rank 0 builds shared caches (bags, series checks) while the others wait,
  then they read them;
- :func:`unwrap` / :func:`plain_state_dict`: checkpoints hold the bare network's weights (no
  ``module.`` prefix), and a ``module.`` prefix in an older file is dropped when it is loaded;
- :func:`gather` / :func:`mean_over_ranks`: validation metrics over every rank's cases.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from monai.data import DistributedSampler as EvalSampler
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import DistributedSampler, Sampler

from lungcal.errors import ConfigError
from lungcal.runtime import exit_hook  # a ConfigError raised in ``initialize`` ends in one line
from lungcal.runtime.device import resolve_device

__all__ = ["LAUNCH", "ENV", "is_distributed", "world_size", "rank", "is_rank_zero", "local_device", "train_shard",
           "eval_shard", "init_process_group", "destroy_process_group", "barrier", "rank_zero_first",
           "broadcast_object", "gather", "mean_over_ranks", "unwrap", "plain_state_dict"]

#: how a bundle runs data-parallel (the error of a missing launcher names it)
LAUNCH = ("torchrun --nproc_per_node <GPUs> -m monai.bundle run --config_file "
          "\"['bundles/<bundle>.json','bundles/multi_gpu.json']\"")
#: what torchrun sets for every worker
ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def is_distributed() -> bool:
    """Whether a process group is up (under ``torchrun`` with ``bundles/multi_gpu.json``)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes training together (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def is_rank_zero() -> bool:
    """Whether this process logs, writes checkpoints and prints (always true in a single process)."""
    return rank() == 0


def local_device(device: str | torch.device | None = "auto") -> torch.device:
    """The device of this worker: ``cuda:<LOCAL_RANK>`` when ``device`` means CUDA, else ``device`` itself."""
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def train_shard(dataset: Any, seed: int = 0) -> Sampler | None:
    """The training sampler: ``None`` in one process; under torchrun this rank's shuffled shard.

    ``DistributedSampler(shuffle=True, seed=seed)``: a new permutation each epoch (the engine calls
    ``set_epoch``), padded with repeated cases so every rank has the same number of batches (DDP
    needs that). ``dataset`` only needs a length.
    """
    if not is_distributed():
        return None
    return DistributedSampler(dataset, shuffle=True, seed=int(seed))


def eval_shard(dataset: Any) -> Sampler | None:
    """The evaluation sampler: ``None`` in one process; under torchrun this rank's shard, in order, unpadded.

    MONAI's ``DistributedSampler(even_divisible=False)``: rank ``r`` scores cases ``r, r + W, ...``,
    so the gathered metrics (:class:`lungcal.calibration.handlers.CalibrationMetrics`) count every
    case exactly once.
    """
    if not is_distributed():
        return None
    return EvalSampler(dataset, even_divisible=False, shuffle=False)


def init_process_group(device: str | torch.device | None = "auto", timeout_min: float = 30.0) -> int:
    """Join the ``torchrun`` process group (``nccl`` on CUDA, ``gloo`` on CPU); returns the world size.

    On CUDA the worker's default device becomes ``cuda:<LOCAL_RANK>``, so ``device: auto`` in
    the rest of the bundle lands there. Ranks above 0 log errors only. Calling it again is a no-op.

    Raises:
        ConfigError: not started by ``torchrun`` (its variables are missing), naming the launch line.
    """
    if is_distributed():
        return world_size()
    missing = [v for v in ENV if v not in os.environ]
    if missing:
        raise ConfigError(f"bundles/multi_gpu.json runs one process per GPU under torchrun ({', '.join(missing)} "
                          "not set)", field="config_file", fix=f"launch it with {LAUNCH}, or drop multi_gpu.json")
    dev = local_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=float(timeout_min)))
    # torch's excepthook (rank-prefixed tracebacks) captures stderr while the previous hook runs, so the
    # lungcal one (one line, exit 2) goes on top again: its line reaches the console
    exit_hook.install()
    if rank() > 0:
        logging.disable(logging.WARNING)  # one console: rank 0's
    return world_size()


def destroy_process_group() -> None:
    """Leave the process group (bundle ``finalize``); a no-op when there is none."""
    if is_distributed():
        dist.destroy_process_group()
        logging.disable(logging.NOTSET)


def barrier() -> None:
    """Wait for every rank (a no-op in a single process)."""
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the block first (it builds the shared caches); the other ranks then run it (and read them)."""
    if not is_distributed():
        yield
        return
    if rank() > 0:
        dist.barrier()
    yield
    if rank() == 0:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable; ``obj`` itself in a single process)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order; shards may differ in length."""
    if not is_distributed():
        return tensor
    shards: list[Any] = [None] * world_size()  # filled in place with every rank's tensor
    dist.all_gather_object(shards, tensor.detach().cpu())
    return torch.cat(shards).to(tensor.device)


def mean_over_ranks(value: float) -> float:
    """The mean of ``value`` over the ranks (``value`` in a single process)."""
    if not is_distributed():
        return float(value)
    values: list[Any] = [None] * world_size()  # filled in place with every rank's float
    dist.all_gather_object(values, float(value))
    return float(sum(values) / len(values))


def unwrap(network: nn.Module) -> nn.Module:
    """The network inside a ``DistributedDataParallel`` / ``DataParallel`` wrapper (else ``network``)."""
    while isinstance(network, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        network = network.module
    return network


def plain_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict:
    """A copy of ``state_dict`` without the ``module.`` prefix a wrapped network's keys carry."""
    out = OrderedDict(state_dict)
    consume_prefix_in_state_dict_if_present(out, "module.")
    return out
