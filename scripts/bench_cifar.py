#!/usr/bin/env python
"""Training throughput of the CIFAR bundles' MONAI trainer vs a hand-written loop and a plain DataLoader loop.

All train the same ResNet-32 (SGD, batch 128) on the same uint8 images for the same number of steps,
on this CPU (or a GPU with --device cuda):

- trainer: the bundle's ``train#trainer`` (``monai.engines.SupervisedTrainer`` with
  :class:`cifar_baselines.steps.TrainStep`: batch crop/flip on the resident uint8 tensor,
  channels_last, mixup for ``--method mixup``, AMP as the bundle runs it, i.e. bf16 autocast on a
  CPU with native bf16), its per-iteration LR scheduler handler and training metrics; epoch-level
  handlers (validation, MLflow, checkpoint) are left out, they do not run per image;
- loop: the same work as one hand-written ``for`` loop (what ``train_stage1`` did before the bundles
  built a ``SupervisedTrainer``): the engine's overhead is trainer / loop;
- plain: a ``torch.utils.data.Dataset`` returning one augmented image at a time (pad, random crop,
  flip, normalise per sample), a ``DataLoader`` collating them, float32, the default memory format.

    python scripts/bench_cifar.py [--data runs/data/cifar10] [--steps 8] [--threads 2] [--method ce]

Without --data random uint8 images are used (the timing does not depend on pixel values). Prints
img/s (best of --repeats interleaved runs) and the ratios.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from ignite.engine import Events

from cifar_baselines.batches import BatchIterator, augment_batch
from cifar_baselines.bundle import load_bundle, recipe_files
from cifar_baselines.data import CIFAR_MEAN, CIFAR_STD, CifarSplits, load_cifar10
from cifar_baselines.resnet import resnet32
from cifar_baselines.schedule import lr_at
from cifar_baselines.steps import autocast_for, prepare_images
from lungcal.calibration.mixup import mixup

ROOT = Path(__file__).resolve().parents[1]


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


def bench_trainer(x, y, steps: int, device: torch.device, method: str, amp: bool = True) -> float:
    """img/s of the bundle's ``train#trainer`` over ``steps`` iterations after one warm-up iteration."""
    os.chdir(ROOT)  # the bundle paths resolve from the project root
    p = load_bundle(recipe_files(f"cifar10_{method}"), {"device": str(device), "epochs": 1, "amp": amp})
    p["data"] = CifarSplits(x.to(device), y.to(device), x[:1], y[:1], x[:1], y[:1], class_counts=[1] * 10)
    for key, ref in p["settings"].items():  # the recorded settings read the data section's config (@data#subset),
        if isinstance(ref, str) and ref.startswith(("@data#", "@data::")):  # which an object in its place no longer has
            p[f"settings#{key}"] = None
    p["train#handlers"] = p["train#handlers"][:1]  # the per-iteration LrScheduleHandler
    trainer = p.get_parsed_content("train#trainer")
    start: list[float] = []

    def mark(engine):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start.append(time.perf_counter())

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=1), mark)
    trainer.run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(y) * steps / (steps + 1) / (time.perf_counter() - start[0])


def bench_loop(x, y, steps: int, device: torch.device, method: str, amp: bool = True,
               channels_last: bool = True) -> float:
    """The same training work as one hand-written loop (the pre-bundle ``train_stage1``)."""
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = resnet32().to(device, memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    ctx, _ = autocast_for(device, amp, training=True)
    gen = torch.Generator().manual_seed(1)
    tot_loss, tot_hit, t0 = torch.zeros((), device=device), torch.zeros((), device=device), 0.0
    for k, (xb, yb) in enumerate(BatchIterator(x.to(device), y.to(device), 128)):
        if k == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.param_groups[0]["lr"] = lr_at(k / steps, 0.1)
        xb = prepare_images(augment_batch(xb, generator=gen), channels_last=channels_last)
        target = yb
        if method == "mixup":
            xb, target, _ = mixup(xb, yb, 1.0, 10, generator=gen)
        with ctx:
            logits = model(xb)
        loss = F.cross_entropy(logits.float(), target)
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tot_loss += loss.detach() * len(yb)
        tot_hit += (logits.detach().argmax(1) == yb).sum()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(y) * steps / (steps + 1) / (time.perf_counter() - t0)


def bench_plain(x, y, steps: int, device: torch.device) -> float:
    """A per-sample ``Dataset`` + ``DataLoader`` loop, float32, default memory format."""
    torch.manual_seed(0)
    model = resnet32().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    dl = torch.utils.data.DataLoader(PerSampleCifar(x, y), batch_size=128, shuffle=True, num_workers=0)
    t0 = 0.0
    for k, (xb, yb) in enumerate(dl):
        if k == 1:
            t0 = time.perf_counter()
        loss = F.cross_entropy(model(xb.to(device)), yb.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(y) * steps / (steps + 1) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="folder with cifar-10-batches-py (default: random images)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps of batch 128 (one more warms up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--method", default="ce", choices=("ce", "mixup"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-plain", action="store_true", help="time only the trainer and the loop")
    ap.add_argument("--amp", choices=("on", "off"), default="on", help="autocast (bf16 on CPU/GPU) in trainer and loop")
    ap.add_argument("--channels-last", choices=("on", "off"), default="on", help="memory format of the loop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n = 128 * (args.steps + 1)
    if args.data:
        xs, ys = load_cifar10(args.data, "train")
        x, y = torch.from_numpy(xs[:n]), torch.from_numpy(ys[:n])
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
    rows: dict[str, list[float]] = {"trainer": [], "loop": [], "plain": []}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's load hits each alike
        amp, cl = args.amp == "on", args.channels_last == "on"
        rows["trainer"].append(bench_trainer(x, y, args.steps, device, args.method, amp))
        rows["loop"].append(bench_loop(x, y, args.steps, device, args.method, amp, cl))
        if not args.no_plain:
            rows["plain"].append(bench_plain(x, y, args.steps, device))
    best = {k: max(v) if v else float("nan") for k, v in rows.items()}
    amp = str(autocast_for(device, args.amp == "on", training=True)[1]).split(".")[-1]
    print(f"device={device} threads={args.threads} method={args.method} batch=128 steps={args.steps} "
          f"AMP={amp} channels_last={args.channels_last} (best of {args.repeats})")
    print(f"{'trainer (bundle train#trainer: SupervisedTrainer + TrainStep)':<64}: {best['trainer']:8.1f} img/s")
    print(f"{'loop    (the same work, hand-written loop)':<64}: {best['loop']:8.1f} img/s")
    print(f"{'plain   (per-sample Dataset + DataLoader, float32)':<64}: {best['plain']:8.1f} img/s")
    print(f"trainer/loop {best['trainer'] / best['loop']:.3f}   trainer/plain {best['trainer'] / best['plain']:.2f}x")
    print("all runs (img/s): " + "; ".join(f"{k} " + " ".join(f"{v:.1f}" for v in vs) for k, vs in rows.items()))


if __name__ == "__main__":
    main()
