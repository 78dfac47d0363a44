#!/usr/bin/env python
"""Training throughput of the cifar_baselines loop vs a plain per-sample DataLoader loop.

Both train the same ResNet-32 (SGD, batch 128, CE) on the same uint8 CIFAR images for the same
number of steps on this CPU (or GPU with --device cuda):

- ours: :class:`cifar_baselines.data.BatchIterator` (one gather + batch crop/flip/normalise on the
  resident uint8 tensor), the model in channels_last and AMP as :func:`train_stage1` runs it (bf16
  autocast on a CPU with native bf16, see :func:`cifar_baselines.train.cpu_has_native_bf16`); also
  timed in float32 (``--no-amp`` equivalent) so each part's share is visible;
- plain: a ``torch.utils.data.Dataset`` returning one augmented image at a time (pad, random
  crop, flip, normalise per sample), a ``DataLoader`` collating them, the model in the default
  memory format.

    python scripts/bench_cifar.py [--data runs/data/cifar10] [--steps 8] [--threads 1]

Without --data (or when it is missing) random uint8 images are used: the timing does not depend
on pixel values. Prints img/s of both and the ratio.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cifar_baselines.data import CIFAR_MEAN, CIFAR_STD, BatchIterator
from cifar_baselines.resnet import resnet32
from cifar_baselines.train import _autocast


class PerSampleCifar(torch.utils.data.Dataset):
    """The usual torchvision-style dataset: one augmented, normalised image per ``__getitem__``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        img = F.pad(self.x[i], (4, 4, 4, 4))
        a, b = torch.randint(0, 9, (2,)).tolist()
        img = img[:, a:a + 32, b:b + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return (img.float() / 255 - self.mean) / self.std, self.y[i]


def _train(model, batches, steps, device, amp=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    model.train()
    n, t0, it = 0, None, iter(batches)
    for k in range(steps + 1):  # the first step is a warm-up, not timed
        if k == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        xb, yb = next(it)
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        with _autocast(device, amp, training=True)[0]:
            logits = model(xb)
        loss = F.cross_entropy(logits.float(), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        n += len(yb) if k else 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="folder with cifar-10-batches-py (default: random images)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n = args.batch_size * (args.steps + 2)
    x = y = None
    if args.data:
        try:
            from cifar_baselines.data import load_cifar10
            xs, ys = load_cifar10(args.data, "train")
            x, y = torch.from_numpy(xs[:n]), torch.from_numpy(ys[:n])
        except Exception as exc:  # noqa: BLE001
            print(f"(no CIFAR at {args.data}: {exc}; using random images)")
    if x is None:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
    amp_dtype = _autocast(device, True, training=True)[1]
    ours_all, fp32_all, plain_all = [], [], []
    for _ in range(args.repeats):  # interleave to share any drift in machine load
        for amp, store in ((True, ours_all), (False, fp32_all)):
            if not amp and amp_dtype == torch.float32:
                continue  # no AMP on this device: "ours" is already float32
            torch.manual_seed(0)
            m = resnet32().to(device).to(memory_format=torch.channels_last)
            store.append(_train(m, BatchIterator(x.to(device), y.to(device), args.batch_size, channels_last=True),
                                args.steps, device, amp=amp))
        torch.manual_seed(0)
        m = resnet32().to(device)
        dl = torch.utils.data.DataLoader(PerSampleCifar(x, y), batch_size=args.batch_size, shuffle=True, num_workers=0)
        plain_all.append(_train(m, dl, args.steps, device))
    ours, plain = max(ours_all), max(plain_all)
    print(f"device={device} threads={args.threads} batch={args.batch_size} steps={args.steps} (best of {args.repeats})")
    amp_name = str(amp_dtype).split(".")[-1]
    print(f"{'ours  (batch aug, resident uint8, channels_last, AMP ' + amp_name + ')':<58}: {ours:8.1f} img/s")
    if fp32_all:
        print(f"{'ours  float32 (the same, AMP off)':<58}: {max(fp32_all):8.1f} img/s")
    print(f"{'plain (per-sample Dataset + DataLoader, float32)':<58}: {plain:8.1f} img/s")
    print(f"ratio ours/plain: {ours / plain:.2f}x" + (f"  (float32 only: {max(fp32_all) / plain:.2f}x)" if fp32_all else ""))


if __name__ == "__main__":
    main()
