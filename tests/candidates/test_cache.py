"""BagCache keys, atomic writes, privacy of names; build_bags with a stand-in preprocessing."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from scipy import ndimage

from lungcal.candidates.cache import CACHE_VERSION, BagCache, BagParams, build_bags, compute_bag, load_bag
from lungcal.errors import CacheError, ConfigError, DataError

PATIENT_ID = "LIDC-IDRI-0042"  # identifier-like path parts must never reach a cache file name


def fake_preprocess(path, spacing, hu_window, margin_mm, **kw):
    """Stand-in for lungcal.ct.transforms.preprocess_ct: a phantom whose blob comes from the file."""
    seed = int.from_bytes(open(path, "rb").read()[:4].ljust(4, b"\0"), "little")
    if b"BROKEN" in open(path, "rb").read():
        raise RuntimeError(f"cannot decode {path}")
    rng = np.random.default_rng(seed)
    shape = (40, 40, 30)
    vol = np.full(shape, 0.15, np.float32) + rng.normal(0, 0.01, shape).astype(np.float32)
    g = np.indices(shape)
    c = np.array([20, 18, 15])
    d = np.sqrt((((g - c[:, None, None, None]) * np.asarray(spacing)[:, None, None, None]) ** 2).sum(0))
    vol[d < 6] = 0.7
    affine = torch.tensor(np.diag([*spacing, 1.0]))
    mask = np.zeros(shape, np.float32)
    mask[3:37, 3:37, 3:27] = 1
    return {"image": MetaTensor(torch.from_numpy(vol)[None], affine=affine),
            "lung_mask": MetaTensor(torch.from_numpy(mask)[None], affine=affine)}


@pytest.fixture()
def sources(tmp_path):
    d = tmp_path / PATIENT_ID
    d.mkdir()
    a = d / f"{PATIENT_ID}_a.nii.gz"
    a.write_bytes(b"\x01\x02\x03\x04 image a")
    b = d / f"{PATIENT_ID}_b.nii.gz"
    b.write_bytes(b"\x05\x06\x07\x08 image b")
    series = d / "series"
    series.mkdir()
    for i in range(3):
        (series / f"{i:03d}.dcm").write_bytes(bytes([i]) * 10)
    return a, b, series


def test_key_depends_on_source_content_params_and_version(sources, tmp_path, monkeypatch):
    a, b, series = sources
    cache = BagCache(tmp_path / "cache")
    k = cache.key(a, BagParams())
    assert k == cache.key(a, {}) == cache.key(a, None)
    assert len(k) == 64 and all(ch in "0123456789abcdef" for ch in k)
    assert cache.key(b) != k
    assert cache.key(a, BagParams(k=4)) != k
    assert cache.key(a, BagParams(patch_size=12)) != k
    assert cache.key(a, BagParams(spacing=(2.0, 2.0, 2.0))) != k
    assert cache.key(a, BagParams(hu_window=(-1000, 400))) != k
    assert cache.key(a, {"detector": {"threshold": 0.2}}) != k
    # explicit defaults hash like implicit ones
    assert cache.key(a, {"detector": {"top_k": 32}}) == k
    # a copy of the same bytes elsewhere is the same source; a changed byte is not
    c = tmp_path / "copy.nii.gz"
    c.write_bytes(a.read_bytes())
    assert cache.key(c) == k
    c.write_bytes(a.read_bytes() + b"!")
    assert cache.key(c) != k
    # DICOM folders: content and names count
    ks = cache.key(series)
    (series / "001.dcm").write_bytes(b"changed!!!")
    assert cache.key(series) != ks
    ks2 = cache.key(series)
    (series / "001.dcm").rename(series / "009.dcm")
    assert cache.key(series) != ks2
    monkeypatch.setattr("lungcal.candidates.cache.CACHE_VERSION", CACHE_VERSION + "x")
    assert cache.key(a) != k
    monkeypatch.undo()
    assert cache.key(a) == k
    monkeypatch.setattr("lungcal.candidates.cache.code_fingerprint", lambda: "edited preprocessing")
    assert cache.key(a) != k


def test_stat_mode_and_bad_params(sources, tmp_path):
    a, _, series = sources
    cache = BagCache(tmp_path, source_mode="stat")
    k = cache.key(series)
    os.utime(series / "000.dcm", ns=(1, 1))
    assert cache.key(series) != k
    with pytest.raises(ConfigError):
        BagCache(tmp_path, source_mode="nope").key(a)
    with pytest.raises(ConfigError):
        cache.key(a, {"patchsize": 3})
    with pytest.raises(ConfigError):
        cache.key(a, {"detector": {"nope": 1}})


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch, sources):
    cache = BagCache(tmp_path / "c")
    entry = compute_bag(str(sources[0]), BagParams(), preprocess=fake_preprocess)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError):
        cache.save("k" * 64, entry)
    assert list((tmp_path / "c").iterdir()) == []
    monkeypatch.undo()
    path = cache.save("k" * 64, entry)
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["k" * 64 + ".npz"]
    got = load_bag(path)
    for key in ("bag", "mask", "world", "voxel", "radius_mm", "score", "affine"):
        np.testing.assert_array_equal(got[key], entry[key])
    path.write_bytes(b"garbage")
    with pytest.raises(CacheError):
        load_bag(path)


def test_build_bags_parallel_cached_and_private(tmp_path, sources):
    a, b, _ = sources
    rows = [{"image": str(a), "label": 1, "subject": "s-aaa", "site": "x", "split": "train"},
            {"image": str(b), "label": 0, "subject": "s-bbb", "site": "x", "split": "test"},
            {"image": str(a), "label": 1, "subject": "s-ccc", "site": "x", "split": "val"}]
    params = {"k": 4, "patch_size": 8}
    out = build_bags(rows, params, tmp_path / "cache", num_workers=2, progress=False, preprocess=fake_preprocess)
    assert [o["subject"] for o in out] == ["s-aaa", "s-bbb", "s-ccc"]
    assert [o["label"] for o in out] == [1, 0, 1] and out[1]["split"] == "test"
    assert out[0]["bag"] == out[2]["bag"] != out[1]["bag"]
    names = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name != ".locks")
    assert len(names) == 2 and all(PATIENT_ID not in n and "aaa" not in n for n in names)
    locks = sorted(p.name for p in (tmp_path / "cache" / ".locks").iterdir())  # per-entry locks: hashes only
    assert [n.replace(".lock", ".npz") for n in locks] == names
    e = load_bag(out[0]["bag"])
    assert e["bag"].shape == (4, 1, 8, 8, 8) and e["mask"].dtype == bool and e["mask"][0]
    np.testing.assert_allclose(e["world"][0], e["voxel"][0] * 2.5)
    assert np.linalg.norm((e["voxel"][0] - [20, 18, 15]) * 2.5) <= 2.6
    # warm: nothing recomputed (mtime unchanged), in-process path gives the same answer
    mtime = os.stat(out[0]["bag"]).st_mtime_ns
    again = build_bags(rows, params, tmp_path / "cache", num_workers=0, progress=False, preprocess=fake_preprocess)
    assert [o["bag"] for o in again] == [o["bag"] for o in out]
    assert os.stat(out[0]["bag"]).st_mtime_ns == mtime


@pytest.mark.parametrize("workers", [0, 2])
def test_failed_row_names_the_row_not_the_path(tmp_path, sources, workers):
    a, _, _ = sources
    bad = a.parent / f"{PATIENT_ID}_bad.nii.gz"
    bad.write_bytes(b"\x00\x00\x00\x00BROKEN")
    rows = [{"image": str(a), "label": 1, "subject": "s-ok", "split": "train"},
            {"image": str(bad), "label": 0, "subject": "s-bad", "split": "train"}]
    with pytest.raises(DataError) as ei:
        build_bags(rows, {"k": 2, "patch_size": 8}, tmp_path / "cache", num_workers=workers, progress=False,
                   preprocess=fake_preprocess)
    msg = str(ei.value)
    assert "row 1" in msg and "s-bad" in msg and PATIENT_ID not in msg
    assert all(not p.name.startswith(".tmp") for p in (tmp_path / "cache").iterdir())
    missing = [{"image": str(tmp_path / "nope.nii.gz"), "label": 0, "subject": "s-x", "split": "train"}]
    with pytest.raises(DataError):
        build_bags(missing, {}, tmp_path / "cache", num_workers=0, progress=False, preprocess=fake_preprocess)


def counting_preprocess(path, **kw):
    """fake_preprocess that appends the source to $BUILD_LOG, so a test can count the builds."""
    with open(os.environ["BUILD_LOG"], "a") as f:
        f.write(f"{os.path.basename(path)}\n")
    return fake_preprocess(path, **kw)


def _build_in_child(rows, cache_dir):
    build_bags(rows, {"k": 2, "patch_size": 8}, cache_dir, num_workers=2, progress=False,
               preprocess=counting_preprocess)


def test_two_processes_building_overlapping_datalists_build_each_entry_once(tmp_path, sources, monkeypatch):
    monkeypatch.setenv("BUILD_LOG", str(tmp_path / "builds.log"))
    many = []
    for i in range(6):
        p = tmp_path / f"ct{i}.nii.gz"
        p.write_bytes(bytes([i + 1, 7, 9, 11]) + b" image")
        many.append({"image": str(p), "label": i % 2, "subject": f"S{i}"})
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_build_in_child, args=(rows, tmp_path / "shared")) for rows in (many[:5], many[1:])]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    built = (tmp_path / "builds.log").read_text().split()
    assert sorted(built) == sorted(f"ct{i}.nii.gz" for i in range(6))  # each entry once, under its lock
    ref = build_bags(many, {"k": 2, "patch_size": 8}, tmp_path / "single", num_workers=0, progress=False,
                     preprocess=fake_preprocess)
    got = build_bags(many, {"k": 2, "patch_size": 8}, tmp_path / "shared", num_workers=0, progress=False,
                     preprocess=fake_preprocess)
    for a, b in zip(ref, got):
        ea, eb = load_bag(a["bag"]), load_bag(b["bag"])
        for key in ("bag", "mask", "world", "score"):
            np.testing.assert_array_equal(ea[key], eb[key])
    assert not [p for p in (tmp_path / "shared").iterdir() if p.name.startswith(".") and p.name != ".locks"]


def test_a_truncated_entry_is_rebuilt_with_a_warning(tmp_path, sources, caplog):
    rows = [{"image": str(sources[0]), "label": 1, "subject": "S1"}]
    first = build_bags(rows, {"k": 2, "patch_size": 8}, tmp_path / "c", num_workers=0, progress=False,
                       preprocess=fake_preprocess)
    path = first[0]["bag"]
    want = load_bag(path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CacheError):
        load_bag(path)
    stale = Path(path).with_name(f".{Path(path).name}.abc123.tmp")  # what a writer killed mid-write leaves
    stale.write_bytes(b"half a bag")
    again = build_bags(rows, {"k": 2, "patch_size": 8}, tmp_path / "c", num_workers=0, progress=False,
                       preprocess=fake_preprocess)
    assert again[0]["bag"] == path and not stale.exists()
    np.testing.assert_array_equal(load_bag(path)["bag"], want["bag"])
    assert "rebuilding a corrupt bag cache entry" in caplog.text


# --- resolution harmonization: every bag, keyed only when set -------------------------------------------------------
def test_harmonization_smooths_the_ct_before_detection_and_patches_and_is_keyed_only_when_set(sources, tmp_path):
    a, *_ = sources
    cache = BagCache(tmp_path / "cache")
    assert cache.key(a, {"harmonize_mm": 0}) == cache.key(a, {}) == cache.key(a, {"harmonize_mm": None})
    assert cache.key(a, {"harmonize_mm": 1.5}) != cache.key(a, {})
    assert cache.key(a, {"harmonize_mm": 1.5}) == cache.key(a, {"harmonize_mm": [1.5, 1.5, 1.5]})
    assert BagParams(harmonize_mm=1.5).resolved()["harmonize_mm"] == [1.5, 1.5, 1.5]
    with pytest.raises(ConfigError, match="harmonize_mm"):
        BagParams(harmonize_mm=-1.0).resolved()

    spacing = (2.5, 2.5, 2.5)
    plain = compute_bag(a, {"spacing": spacing, "k": 1, "patch_size": 8}, preprocess=fake_preprocess)
    smooth = compute_bag(a, {"spacing": spacing, "k": 1, "patch_size": 8, "harmonize_mm": 2.5},
                         preprocess=fake_preprocess)
    # the oracle: scipy's Gaussian of 1 voxel (2.5 mm at 2.5 mm voxels) on the preprocessed volume, then the same patch
    vol = fake_preprocess(a, spacing, None, None)["image"][0].numpy()
    ref = ndimage.gaussian_filter(vol, 1.0, mode="nearest", truncate=3.0)
    c = smooth["voxel"][0]
    lo = c - 4
    assert np.allclose(smooth["bag"][0, 0], ref[lo[0]:lo[0] + 8, lo[1]:lo[1] + 8, lo[2]:lo[2] + 8], atol=1e-6)
    assert np.linalg.norm(smooth["world"][0] - plain["world"][0]) <= 2.5 * np.sqrt(3)  # the same blob
    assert smooth["bag"][0, 0].max() < plain["bag"][0, 0].max()  # its edge is softer
    assert json.loads(str(smooth["meta"]))["params"]["harmonize_mm"] == [2.5, 2.5, 2.5]
