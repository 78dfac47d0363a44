"""Benchmark: the default small MIL instance encoder vs MONAI's 3D ResNet-10, on the same bags.

Both encoders sit in the same gated-attention MIL model and train with the same recipe (AdamW,
cross-entropy, random flips, fixed epochs, same seed and batch order) on real bags: a synthetic
cohort from ``lungcal.data.synthetic.make_cohort`` -> ``preprocess_ct`` -> LoG detector -> K
patches of P^3 (via the bag cache, so a second run skips everything up to training). Reported:
training patches/s (valid patches through forward + backward + optimiser step, timed alone; the
median over steps, robust to load spikes, with the overall mean beside it), the
ratio small / resnet10 (goal >= 20x), and the AUC of each on the held-out CTs (val + test splits;
nothing is selected on them). Optionally (``--cpm``) the detector's LUNA16 CPM on the whole cohort
and the per-CT preprocessing / detection + extraction times.

    python scripts/bench_mil.py                 # ~160 CTs, a few minutes on 2 CPU cores
    python scripts/bench_mil.py --cpm --n-subjects 60 --epochs 10
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lungcal.calibration.metrics import auroc
from lungcal.candidates import BagParams, build_bags, compute_bag, load_bag
from lungcal.candidates.evaluate import evaluate_detector, read_annotations
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import make_cohort
from lungcal.mil import build_mil_model


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="working folder (default: <LUNGCAL_HOME or ./runs>/bench_mil)")
    ap.add_argument("--datalist", default=None, help="use this datalist instead of generating a cohort")
    ap.add_argument("--n-subjects", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--patch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpm", action="store_true", help="also report the detector CPM and per-CT timings")
    return ap.parse_args()


def _load(entries):

    bags, masks, labels = [], [], []
    for e in entries:
        z = load_bag(e["bag"])
        bags.append(z["bag"])
        masks.append(z["mask"])
        labels.append(int(e["label"]))
    return torch.from_numpy(np.stack(bags)), torch.from_numpy(np.stack(masks)), torch.tensor(labels)


def _train_eval(encoder, train, held, args):

    torch.manual_seed(args.seed)
    model = build_mil_model(encoder, "attention", embed_dim=64, patch_size=args.patch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    xb, mb, yb = train
    g = torch.Generator().manual_seed(args.seed)
    n = len(yb)
    step_s, step_p = [], []
    model.train()
    for _ in range(args.epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, args.batch_size):
            idx = order[i: i + args.batch_size]
            x, m, y = xb[idx], mb[idx], yb[idx]
            flips = [d for d, f in zip((3, 4, 5), torch.rand(3, generator=g) < 0.5) if f]
            if flips:
                x = x.flip(flips)
            t0 = time.perf_counter()
            logits, _ = model(x, m)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step_s.append(time.perf_counter() - t0)
            step_p.append(int(m.sum()))
    model.eval()
    with torch.no_grad():
        probs = torch.cat([torch.softmax(model(held[0][i: i + 32], held[1][i: i + 32])[0], 1)[:, 1]
                           for i in range(0, len(held[2]), 32)])
    n_params = sum(p.numel() for p in model.encoder.parameters())
    step_s, step_p = np.asarray(step_s[1:]), np.asarray(step_p[1:])  # the first step warms up oneDNN
    # median per-step throughput: robust to load spikes on a shared machine
    return {"patches_per_s": float(np.median(step_p / step_s)),
            "mean_patches_per_s": float(step_p.sum() / step_s.sum()),
            "train_s": float(step_s.sum()), "auc": float(auroc(probs.numpy(), held[2].numpy())),
            "encoder_params": n_params}


def main() -> None:
    args = _args()
    torch.set_num_threads(args.threads)

    out = Path(args.out or Path(os.environ.get("LUNGCAL_HOME") or Path.cwd() / "runs") / "bench_mil").absolute()
    if args.datalist:
        datalist = Path(args.datalist)
    else:
        datalist = out / f"cohort_{args.n_subjects}" / "datalist.json"
        if not datalist.is_file():
            t0 = time.perf_counter()
            make_cohort(datalist.parent, n_subjects=args.n_subjects, prevalence=0.4, seed=args.seed,
                        formats=("nifti",), num_workers=args.workers)
            print(f"cohort: {args.n_subjects} CTs generated in {time.perf_counter() - t0:.0f} s")
    rows = load_manifest(datalist)
    params = BagParams(k=args.k, patch_size=args.patch_size)

    t0 = time.perf_counter()
    entries = build_bags(rows, params, out / "cache", num_workers=args.workers)
    print(f"bags: {len(rows)} CTs ready in {time.perf_counter() - t0:.1f} s (K={args.k}, P={args.patch_size}, "
          f"{args.workers} workers; a warm cache skips preprocessing)")

    if args.cpm:
        ann = datalist.parent / "annotations.csv"
        if ann.is_file():
            res = evaluate_detector(rows, read_annotations(ann), params)
            sens = ", ".join(f"{k:g}:{v:.3f}" for k, v in res["sensitivities"].items())
            print(f"detector CPM on {res['n_scans']} CTs / {res['n_nodules']} nodules: {res['cpm']:.3f} "
                  f"(sensitivity at FP/scan {sens}; max {res['max_sensitivity']:.3f})")
            print(f"per CT (1 process): preprocess {res['seconds_per_ct_preprocess']:.2f} s, "
                  f"detection {res['seconds_per_ct_detect']:.2f} s")
        t0 = time.perf_counter()
        few = rows[:5]
        for r in few:
            compute_bag(r["image"], params)
        print(f"per CT (1 process): preprocess + detection + extraction {(time.perf_counter() - t0) / len(few):.2f} s")

    train = _load([e for e in entries if e["split"] == "train"])
    held = _load([e for e in entries if e["split"] in ("val", "test")])
    print(f"train {len(train[2])} CTs ({int(train[1].sum())} patches/epoch), held-out {len(held[2])} CTs; "
          f"{args.epochs} epochs, batch {args.batch_size}, {args.threads} threads")
    res = {}
    for enc in ("small", "resnet10"):
        res[enc] = r = _train_eval(enc, train, held, args)
        print(f"  {enc:9s} encoder params {r['encoder_params']:>9,d}  train {r['train_s']:7.1f} s  "
              f"{r['patches_per_s']:9.1f} patches/s (mean {r['mean_patches_per_s']:.1f})  AUC {r['auc']:.3f}")
    ratio = res["small"]["patches_per_s"] / res["resnet10"]["patches_per_s"]
    print(f"ratio small / resnet10 training patches/s: {ratio:.1f}x (goal >= 20x); "
          f"AUC small {res['small']['auc']:.3f} vs resnet10 {res['resnet10']['auc']:.3f} "
          f"({'equal or better' if res['small']['auc'] >= res['resnet10']['auc'] - 1e-9 else 'worse'})")


if __name__ == "__main__":
    main()
