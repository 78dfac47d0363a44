"""Benchmark: the train split streamed from the bag cache vs stacked in memory (issue 17, item 2).

Run: python scripts/bench_bags.py [--sizes 1000 10000] [--k 8] [--patch 16] [--train-ct 600] [--repeat 3]

Writes ``max(sizes)`` synthetic cache entries (the real entry format, random bags) to a temporary
folder, then, each in a fresh process so RSS is its own:

1. **read**: one bag by a positioned read (what the streamed set does) vs ``np.memmap`` of the same
   bytes vs ``np.load`` of the whole entry; median microseconds per bag, ratios to the read.
2. **RSS and loader throughput** per size: the split built in memory (``load_split``, as training
   did) or streamed (``stream_split``), then one shuffled, augmented epoch through a DataLoader
   (batch 16, main process): RSS growth over the process's baseline after building and after the
   epoch, peak RSS growth, bags/s; ratio stream / memory.
3. **training epoch**: ``--train-ct`` bags (the demo's 600 train CTs) through the CT bundles'
   network (LogSumExpMIL + SmallCNNEncoder, AdamW, focal loss): one model takes its batches from
   the in-memory and the streamed loader in turn, so a busy machine slows both alike; the seconds
   spent on each loader's batches (load + step) per epoch, median of ``--repeat``; ratio stream / memory.

The files are read back from the page cache (just written): on a cold cache or a network
filesystem a streamed read costs a disk read. Numbers go to docs/results.md with this command.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lungcal.calibration.losses import FocalLoss
from lungcal.candidates.bagfile import member_layout, read_member
from lungcal.candidates.cache import CACHE_VERSION
from lungcal.ctapp.data.bagset import BagSet
from lungcal.ctapp.data.bagstream import stream_split
from lungcal.ctapp.data.cohort import load_split
from lungcal.mil import LogSumExpMIL, SmallCNNEncoder


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_entries(root: Path, n: int, k: int, p: int) -> list[dict]:
    """``n`` entries in the cache's format (np.savez, every key), random bags, alternating labels."""
    rng = np.random.default_rng(0)
    meta = np.asarray(json.dumps({"version": CACHE_VERSION, "params": {"k": k, "patch_size": p}}))
    rows = []
    for i in range(n):
        n_valid = int(rng.integers(1, k + 1))
        mask = np.arange(k) < n_valid
        bag = rng.random((k, 1, p, p, p), dtype=np.float32) * mask[:, None, None, None, None]
        path = root / f"{i:06d}.npz"
        np.savez(path, bag=bag, mask=mask, world=np.zeros((n_valid, 3)), voxel=np.zeros((n_valid, 3), np.int64),
                 radius_mm=np.zeros(n_valid), score=np.zeros(n_valid), affine=np.eye(4), spacing=np.ones(3),
                 n_detected=np.int64(n_valid), meta=meta)
        rows.append({"bag": str(path), "label": i % 2, "subject": f"S{i:06d}", "split": "train"})
    return rows


def child_read(root: Path, repeat: int) -> dict:
    path = sorted(root.glob("*.npz"))[0]
    lay = member_layout(path, ("bag",))["bag"]

    def mm():
        return np.array(np.memmap(path, dtype=np.dtype(lay.dtype), mode="r", offset=lay.offset, shape=lay.shape))

    def full():
        with np.load(path) as z:
            return z["bag"]

    fns = {"read": lambda: read_member(path, lay), "memmap": mm, "np.load": full}
    assert all(np.array_equal(f(), fns["read"]()) for f in fns.values())
    times = {k: [] for k in fns}
    for _ in range(repeat):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(500):
                f()
            times[k].append((time.perf_counter() - t) / 500 * 1e6)
    return {k: float(np.median(v)) for k, v in times.items()}


def child_rss(rows: list[dict], mode: str) -> dict:
    torch.set_num_threads(1)
    base = rss_mib()
    base_peak = peak_mib()
    t = time.perf_counter()
    split = stream_split(rows) if mode == "stream" else load_split(rows)
    t_build = time.perf_counter() - t
    after_build = rss_mib() - base
    ds = BagSet(split["bags"], split["mask"], split["labels"], augment=True, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    n = 0
    for batch in loader:
        n += batch["bag"].shape[0]
    t_epoch = time.perf_counter() - t
    return {"build_s": t_build, "rss_build_mib": after_build, "rss_epoch_mib": rss_mib() - base,
            "peak_growth_mib": peak_mib() - base_peak, "bags_per_s": n / t_epoch}


def child_train(rows: list[dict], repeat: int) -> dict:
    """Training steps fed by the in-memory and the streamed loader in turn (batch by batch, one model),
    so load on a shared machine hits both alike; seconds per epoch of each, per repeat."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    splits = {"memory": load_split(rows), "stream": stream_split(rows)}
    torch.manual_seed(0)
    net = LogSumExpMIL(SmallCNNEncoder(embed_dim=64), attn_dim=64, dropout=0.1, tta_flips=True)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    loss_fn = FocalLoss(gamma=2.0)
    net.train()
    times = {k: [] for k in splits}
    for _ in range(repeat):
        iters = {mode: iter(torch.utils.data.DataLoader(
            BagSet(split["bags"], split["mask"], split["labels"], augment=True, seed=0), batch_size=16, shuffle=True,
            generator=torch.Generator().manual_seed(0))) for mode, split in splits.items()}
        spent = dict.fromkeys(splits, 0.0)
        done = False
        while not done:
            for mode, it in iters.items():
                t = time.perf_counter()
                batch = next(it, None)
                if batch is None:
                    done = True
                    break
                logits, _ = net(batch["bag"], batch["mask"])
                loss = loss_fn(logits, batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                spent[mode] += time.perf_counter() - t
        for mode in splits:
            times[mode].append(spent[mode])
    return {k: float(np.median(v)) for k, v in times.items()}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--train-ct", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-rss", action="store_true", help="only sections 1 and 3")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, rows_file = args.child[0], Path(args.child[1])
        if what == "read":
            res = child_read(rows_file, int(args.child[2]))
        else:
            rows = json.loads(rows_file.read_text())[: int(args.child[2])]
            res = child_rss(rows, args.child[3]) if what == "rss" else child_train(rows, int(args.child[3]))
        print(json.dumps(res))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench_bags_"))
    try:
        n_max = max(max(args.sizes), args.train_ct)
        t = time.perf_counter()
        rows = write_entries(tmp, n_max, args.k, args.patch)
        (tmp / "rows.json").write_text(json.dumps(rows))
        mib = args.k * args.patch**3 * 4 / 2**20
        print(f"{n_max} entries of K={args.k}, P={args.patch} ({mib * 1024:.0f} KiB a bag) written in "
              f"{time.perf_counter() - t:.1f} s\n")

        r = run_child("read", str(tmp), str(args.repeat))
        print("1. one bag read (median us; ratio to the positioned read)")
        for k, v in r.items():
            print(f"   {k:<8} {v:8.1f} us  x{v / r['read']:.2f}")

        print("\n2. RSS growth (MiB) and loader throughput, one shuffled augmented epoch, batch 16, main process")
        print(f"   {'N':>6} {'mode':<7} {'build s':>8} {'RSS built':>10} {'RSS epoch':>10} {'peak':>8} {'bags/s':>8}")
        for n in [] if args.skip_rss else args.sizes:
            res = {m: run_child("rss", str(tmp / "rows.json"), str(n), m) for m in ("memory", "stream")}
            for m, v in res.items():
                print(f"   {n:>6} {m:<7} {v['build_s']:8.2f} {v['rss_build_mib']:10.1f} {v['rss_epoch_mib']:10.1f} "
                      f"{v['peak_growth_mib']:8.1f} {v['bags_per_s']:8.0f}")
            print(f"   {n:>6} ratio stream/memory: build {res['stream']['build_s'] / res['memory']['build_s']:.2f}, "
                  f"bags/s {res['stream']['bags_per_s'] / res['memory']['bags_per_s']:.2f}, peak RSS growth "
                  f"{res['stream']['peak_growth_mib'] / max(res['memory']['peak_growth_mib'], 1e-9):.3f} "
                  f"(the bags alone: {n * mib:.0f} MiB)")

        tr = run_child("train", str(tmp / "rows.json"), str(args.train_ct), str(args.repeat))
        print(f"\n3. one training epoch of {args.train_ct} bags (LogSumExpMIL + SmallCNNEncoder, batch 16, "
              f"batches of both loaders in turn; median of {args.repeat})")
        print(f"   memory {tr['memory']:.2f} s   stream {tr['stream']:.2f} s   ratio stream/memory "
              f"{tr['stream'] / tr['memory']:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
