"""The train split streamed from the bag cache: no bags held, the in-memory set's items, loader workers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lungcal.candidates.bagfile import member_layout, read_member
from lungcal.candidates.cache import CACHE_VERSION, BagCache
from lungcal.ctapp.data.bagset import BagSet, random_orientation
from lungcal.ctapp.data.bagstream import StreamedBags, seed_worker, stream_split
from lungcal.ctapp.data.cohort import load_split
from lungcal.errors import CacheError

K, P, N = 4, 6, 10


def _entry(rng, n_valid):
    mask = np.arange(K) < n_valid
    bag = rng.random((K, 1, P, P, P), dtype=np.float32) * mask[:, None, None, None, None]
    return {"bag": bag, "mask": mask, "world": rng.random((n_valid, 3)), "voxel": np.zeros((n_valid, 3), np.int64),
            "radius_mm": np.ones(n_valid), "score": rng.random(n_valid), "affine": np.eye(4), "spacing": np.ones(3),
            "n_detected": np.int64(n_valid), "meta": np.asarray(json.dumps({"version": CACHE_VERSION}))}


@pytest.fixture()
def entries(tmp_path):
    """N cache entries written by BagCache.save (the real writer), as build_bags returns them."""
    rng = np.random.default_rng(0)
    cache = BagCache(tmp_path / "bags")
    return [{"bag": str(cache.save(f"{i:064x}", _entry(rng, 1 + i % K))), "label": i % 2, "subject": f"S{i:02d}",
             "split": "train"} for i in range(N)]


def test_a_member_is_read_at_its_offset_without_loading_the_entry(entries):
    lay = member_layout(entries[3]["bag"], ("bag", "mask"))
    with np.load(entries[3]["bag"]) as z:
        assert np.array_equal(read_member(entries[3]["bag"], lay["bag"]), z["bag"])
        assert np.array_equal(read_member(entries[3]["bag"], lay["mask"]), z["mask"])
    assert lay["bag"].shape == (K, 1, P, P, P) and lay["bag"].dtype == "<f4"


def test_the_streamed_split_holds_paths_and_offsets_not_bags(entries):
    split = stream_split(entries)
    bags = split["bags"]
    assert isinstance(bags, StreamedBags) and len(bags) == N
    held = {k: v for k, v in vars(bags).items() if isinstance(v, np.ndarray)}
    assert set(held) == {"paths", "offsets"}
    assert held["paths"].dtype.kind == "S" and held["offsets"].dtype == np.int64
    bag_bytes = N * K * P**3 * 4
    assert sum(v.nbytes for v in held.values()) < bag_bytes / 20
    assert not any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vars(bags).values())
    assert "bags" not in vars(bags) and not any(isinstance(v, list) for v in vars(bags).values())


@pytest.mark.parametrize("augment", [False, True])
def test_items_equal_the_in_memory_bagsets_with_the_same_augmentation(entries, augment):
    mem, stream = load_split(entries), stream_split(entries)
    assert torch.equal(mem["mask"], stream["mask"]) and torch.equal(mem["labels"], stream["labels"])
    assert mem["subjects"] == stream["subjects"]
    loaders = [torch.utils.data.DataLoader(BagSet(s["bags"], s["mask"], s["labels"], augment=augment, seed=5),
                                           batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1))
               for s in (mem, stream)]
    for _epoch in range(2):
        for a, b in zip(*loaders, strict=True):
            for key in ("bag", "mask", "label", "index"):
                assert torch.equal(a[key], b[key]), key


def test_workers_pinned_memory_and_a_distributed_sampler_cover_the_split_once(entries):
    mem, stream = load_split(entries), stream_split(entries)
    ds = BagSet(stream["bags"], stream["mask"], stream["labels"])
    seen = []
    for rank in range(2):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(1)
        loader = torch.utils.data.DataLoader(ds, batch_size=2, sampler=sampler, num_workers=2,
                                             pin_memory=torch.cuda.is_available())
        for batch in loader:
            assert batch["bag"].is_pinned() == torch.cuda.is_available()
            for i, bag, mask, label in zip(batch["index"].tolist(), batch["bag"], batch["mask"], batch["label"]):
                seen.append(i)
                assert torch.equal(bag, mem["bags"][i]) and torch.equal(mask, mem["mask"][i])
                assert int(label) == entries[i]["label"]
    assert sorted(seen) == list(range(N))


def test_seed_worker_gives_each_worker_and_epoch_its_own_reproducible_augmentation(entries):
    stream = stream_split(entries)
    raw = load_split(entries)["bags"]

    def loader(init):
        ds = BagSet(stream["bags"], stream["mask"], stream["labels"], augment=True, seed=0)
        return torch.utils.data.DataLoader(ds, batch_size=1, num_workers=2, worker_init_fn=init,
                                           generator=torch.Generator().manual_seed(3))

    def epoch(dl):
        return [batch["bag"][0] for batch in dl]

    # without it, each worker's copy of the generator starts at seed 0: worker w's k-th item (2k + w)
    # gets draw k of that stream, in both workers and again every epoch
    plain = loader(None)
    first, again = epoch(plain), epoch(plain)
    g = torch.Generator().manual_seed(0)
    for k in range(N // 2):
        state = g.get_state()
        for w in range(2):
            g_w = torch.Generator()
            g_w.set_state(state)
            assert torch.equal(first[2 * k + w], random_orientation(raw[2 * k + w], g_w).contiguous())
        random_orientation(raw[0], g)  # the next draw
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # with it: reproducible for the same loader seed, different from one epoch to the next
    seeded, twin = loader(seed_worker), loader(seed_worker)
    one, other = epoch(seeded), epoch(twin)
    assert all(torch.equal(a, b) for a, b in zip(one, other))
    two = epoch(seeded)
    assert any(not torch.equal(a, b) for a, b in zip(one, two))
    assert any(not torch.equal(a, b) for a, b in zip(one, first))


def test_a_missing_entry_at_training_time_names_build_bags(entries, tmp_path):
    split = stream_split(entries)
    (tmp_path / "bags" / entries[4]["bag"].rsplit("/", 1)[1]).unlink()
    with pytest.raises(CacheError, match="lungcal build-bags"):
        split["bags"][4]
    assert torch.equal(split["bags"][5], load_split(entries[5:6])["bags"][0])


def test_compressed_and_truncated_entries_are_refused(entries, tmp_path):
    rng = np.random.default_rng(1)
    packed = tmp_path / "packed.npz"
    np.savez_compressed(packed, **_entry(rng, 2))
    with pytest.raises(CacheError, match="compressed"):
        member_layout(packed, ("bag",))
    path = entries[0]["bag"]
    lay = member_layout(path, ("bag",))["bag"]
    data = open(path, "rb").read()
    short = tmp_path / "short.npz"
    short.write_bytes(data[: lay.offset + 100])
    with pytest.raises(CacheError):
        read_member(short, lay)
    with pytest.raises(CacheError):
        stream_split([{"bag": str(short), "label": 0}])
