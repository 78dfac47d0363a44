"""The training split's bags streamed from the cache: one bag read from disk per item.

:func:`stream_split` is :func:`lungcal.ctapp.data.cohort.load_split` without the stack: it returns the
same ``{"bags", "mask", "labels", "subjects"}`` with ``bags`` a :class:`StreamedBags`, a lazy
sequence that holds only each entry's path and the byte offset of its bag
(:func:`lungcal.candidates.bagfile.member_layout`, numpy arrays, so forked DataLoader workers do
not copy them page by page as Python objects' reference counts change). Indexing one reads that
bag (:func:`lungcal.candidates.bagfile.read_member`). The validity masks (K bools a CT) and labels
stay in memory, as the paths do: one file read per item. The split then goes into the same
:class:`~lungcal.ctapp.data.bagset.BagSet` as an in-memory one, so the augmentation is the same code,
drawing from the same generator in the same order: with ``num_workers = 0`` the items, hence
the training, are bit-identical to the in-memory set's. The per-CT ``candidates`` are not
streamed (only the validation and test splits, kept in memory, report them).

With DataLoader workers, give the loader ``worker_init_fn=seed_worker``: each worker process
holds a copy of the dataset's generator, which would otherwise draw the same augmentation in
every worker and every epoch; :func:`seed_worker` reseeds it from the worker's seed (the loader's
generator, so still reproducible). The order of the draws then differs from the single-process
one (documented in docs/architecture.md).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lungcal.candidates.bagfile import MemberLayout, entry_meta, member_layout, read_member
from lungcal.candidates.cache import CACHE_VERSION
from lungcal.errors import CacheError

__all__ = ["StreamedBags", "stream_split", "seed_worker"]


class StreamedBags(Sequence):
    """One array (``"bag"`` or ``"mask"``) of N cache entries, read from disk on indexing.

    Holds the entries' paths (one fixed-width bytes array) and offsets (an int64 array); every entry
    has the same dtype and shape, checked when indexed. ``bags[i]`` is a new tensor.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], layouts: Sequence[MemberLayout]) -> None:
        if len(paths) != len(layouts):
            raise ValueError("one layout per path")
        kinds = {(lay.dtype, lay.shape) for lay in layouts}
        if len(kinds) > 1:
            raise CacheError(f"the split's cache entries differ in shape or dtype {sorted(kinds)}",
                             fix="build every bag of a split with the same k and patch_size")
        self.dtype, self.shape = kinds.pop() if kinds else ("<f4", ())
        self.paths = np.array([os.fsencode(p) for p in paths], dtype=bytes) if len(paths) else np.empty(0, "S1")
        self.offsets = np.array([lay.offset for lay in layouts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def layout(self, i: int) -> MemberLayout:
        return MemberLayout(int(self.offsets[i]), self.dtype, self.shape)

    def path(self, i: int) -> str:
        return os.fsdecode(self.paths[i])

    def __getitem__(self, i):  # noqa: D105  (Sequence protocol)
        if isinstance(i, torch.Tensor):
            i = int(i)
        if not isinstance(i, (int, np.integer)):
            raise TypeError("StreamedBags takes one integer index")
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        arr = read_member(self.path(int(i)), self.layout(int(i)))
        return torch.from_numpy(arr)


def stream_split(entries: Sequence[Mapping[str, Any]], progress: bool = False) -> dict[str, Any]:
    """The split of ``entries`` (rows returned by ``build_bags``) as streamed bags.

    Each entry is checked as :func:`~lungcal.candidates.cache.load_bag` would (readable, every
    array, the cache version), reading its headers and ``meta`` only.
    """
    paths = [str(e["bag"]) for e in entries]
    bags, masks = [], []
    k = None
    for p in tqdm(paths, desc="bag index", unit="CT", disable=not progress or not paths):
        meta = entry_meta(p)
        if meta.get("version") != CACHE_VERSION:
            raise CacheError(f"bag cache entry has version {meta.get('version')!r}, expected {CACHE_VERSION!r}",
                             file=p, fix="delete the cache folder; it is rebuilt")
        lay = member_layout(p, ("bag", "mask"))
        bags.append(lay["bag"])
        masks.append(read_member(p, lay["mask"]).astype(bool))
        if k is not None and masks[-1].shape != (k,):
            raise CacheError(f"the split's cache entries differ in K ({k} and {masks[-1].shape})", file=p,
                             fix="build every bag of a split with the same k")
        k = masks[-1].shape[0]
    return {
        "bags": StreamedBags(paths, bags),
        "mask": torch.from_numpy(np.stack(masks)) if masks else torch.empty(0, dtype=torch.bool),
        "labels": torch.tensor([int(e.get("label", -1)) for e in entries], dtype=torch.long),
        "subjects": [str(e.get("subject", f"ct{i:04d}")) for i, e in enumerate(entries)],
    }


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn`` of a loader with workers: reseed the dataset's own generator (``_gen``) from
    the worker's seed, which the loader derives from its generator per epoch and per worker."""
    info = torch.utils.data.get_worker_info()
    if info is None:  # not in a worker
        return
    gen = getattr(info.dataset, "_gen", None)
    if isinstance(gen, torch.Generator):
        gen.manual_seed(int(info.seed) % (2**63))
