"""How much a CIFAR model's test accuracy and ECE rest on its BatchNorm statistics.

A trained ResNet-32 evaluates with BatchNorm running statistics that are an exponential average
(momentum 0.1) over roughly its last ten training batches: augmented, mixed under Mixup,
long-tailed on CIFAR-10-LT, and computed in bf16 where training ran under CPU autocast. This
script re-estimates them in float32, as the average of the batch statistics of one whole pass in
batches of 128 (``torch.optim.swa_utils.update_bn``: "precise BatchNorm"), over

- ``train``: every training image once, as the training set holds them (long-tailed on LT), with
  the training augmentation (random crop with zero padding, flip; seeded): the statistics the
  weights were trained against, without the moving average's noise, bf16 and mixing;
- ``train, clean``: the same images without augmentation (what the test images look like);
- ``balanced``: as many class-balanced draws from the training images, with replacement and the
  augmentation: the BatchNorm half of LAS's "shift learning on BN", without retraining the head;

and scores the test split in float32 for each: ACC and ECE (15 bins) with 95% bootstrap CIs, and
the paired differences against the weights as trained (same test images, resampled jointly).

    python experiments/bn_recalibration.py --run-id <stage-1 run id> --tracking-uri sqlite:///runs/mlflow.db

The weights and the logged run are not changed.
"""
from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterator

import torch
from torch.optim.swa_utils import update_bn

from cifar_baselines.batches import BatchIterator, augment_batch
from cifar_baselines.data import CifarSplits
from cifar_baselines.resnet import resnet32
from cifar_baselines.stages import load_stage1
from cifar_baselines.steps import predict, prepare_images
from lungcal.calibration.metrics import calibration_report, paired_bootstrap_diff

SOURCES = ("train", "balanced")


def bn_batches(data: CifarSplits, source: str, batch_size: int = 128, seed: int = 0,
               augment: bool = True) -> Iterator[torch.Tensor]:
    """Normalised float32 batches of training images for one BatchNorm pass.

    ``train``: each training image once, in order; ``balanced``: ``len(train)`` draws with
    class-balanced probabilities (the LAS stage's sampler). ``augment``: the training crop and
    flip (:func:`cifar_baselines.batches.augment_batch`, a CPU generator seeded with ``seed``).
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}, use one of {SOURCES}")
    sampler = "sequential" if source == "train" else "balanced"
    gen = torch.Generator().manual_seed(int(seed) + 1)
    for x, _ in BatchIterator(data.train_x, data.train_y, batch_size, sampler=sampler, seed=seed):
        yield prepare_images(augment_batch(x, generator=gen) if augment else x)


def recalibrate_bn(network: torch.nn.Module, batches) -> torch.nn.Module:
    """A copy of ``network`` whose BatchNorm statistics average those of ``batches`` (each batch alike)."""
    net = copy.deepcopy(network)
    update_bn(batches, net)
    return net.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-id", required=True, help="a CIFAR stage-1 MLflow run")
    ap.add_argument("--tracking-uri", default=None, help="default: the project's runs/mlflow.db")
    ap.add_argument("--data-dir", default=None, help="the CIFAR-10 folder (default: the runs' data folder)")
    ap.add_argument("--output-dir", default=None, help="the runs folder (default: $LUNGCAL_HOME or ./runs)")
    ap.add_argument("--n-bootstrap", type=int, default=1000)
    ap.add_argument("--n-bins", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    stage1 = load_stage1(args.run_id, tracking_uri=args.tracking_uri, output_dir=args.output_dir)
    data = stage1.load_splits(data_dir=args.data_dir, output_dir=args.output_dir)
    base = stage1.load_into(resnet32(10)).to(memory_format=torch.channels_last).eval()
    models = {"as trained": base}
    for name, source, augment in (("BN from train", "train", True), ("BN from train, clean", "train", False),
                                  ("BN from balanced", "balanced", True)):
        models[name] = recalibrate_bn(base, bn_batches(data, source, seed=args.seed, augment=augment))
    probs = {k: torch.softmax(predict(m, data.test_x), 1).numpy() for k, m in models.items()}
    y = data.test_y.cpu().numpy()

    print(f"stage-1 run {args.run_id} ({stage1.method}, {stage1.settings.get('dataset')}): "
          f"test split, {len(y)} images, ECE with {args.n_bins} bins, 95% bootstrap CIs, %\n")
    print("| BatchNorm statistics | ACC | ECE | mean conf. | ΔACC vs as trained | ΔECE vs as trained |")
    print("|---|---|---|---|---|---|")
    for name, p in probs.items():
        r = calibration_report(p, y, n_bins=args.n_bins, n_bootstrap=args.n_bootstrap, seed=args.seed)
        cells = [f"{100 * r[k]:.2f} [{100 * r[f'{k}_ci_low']:.2f}, {100 * r[f'{k}_ci_high']:.2f}]"
                 for k in ("acc", "ece")]
        cells.append(f"{100 * r['mean_confidence']:.2f}")
        for metric in ("acc", "ece"):
            if name == "as trained":
                cells.append("")
                continue
            d = paired_bootstrap_diff(metric, p, probs["as trained"], y, n_bootstrap=args.n_bootstrap,
                                      seed=args.seed, n_bins=args.n_bins)
            cells.append(f"{100 * d['diff']:+.2f} [{100 * d['ci_low']:+.2f}, {100 * d['ci_high']:+.2f}]"
                         + ("" if d["significant"] else " n.s."))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
