"""How far a bf16 training step's gradient is from the float32 one, against the noise SGD already has.

On a CPU with native bf16, the CIFAR bundles train under ``torch.autocast("cpu", bfloat16)``
(convolutions and the linear head in bf16; weights, loss and optimiser in float32). Whether that
costs accuracy is settled only by a float32 rerun (``--amp false``, about 1.8x the time). This
script measures the mechanism instead, in seconds: for ``--batches`` training batches of 128 images,
built exactly as a training step builds them (the seeded crop and flip, and Mixup where the run
used it; the run's own loss), it computes the gradient of every parameter

- in float32, ``g``;
- under bf16 autocast, on the same batch: the **bf16 error** ``|g_bf16 - g| / |g|`` and the cosine;
- in float32 on another crop/flip (and Mixup) draw of the same images: the **augmentation noise**
  ``|g' - g| / |g|``;
- in float32 on the next batch of other images: the **batch noise** ``|g_next - g| / |g|``;

at the run's trained weights and at a fresh initialisation (the start of training), and prints each
as a mean over batches with a 95% normal interval. A bf16 error far below the noise of another
augmentation draw is a perturbation that SGD already absorbs every step; one of the same size is not.
Noise averages out over steps and a bias does not, so it also prints how the bf16 errors ``e_i``
add up over the K batches, ``|sum e_i| / sqrt(sum |e_i|^2)``: about 1 when they are independent
(they cancel like noise), up to sqrt(K) when every step makes the same error.

    python experiments/precision_check.py --run-id <stage-1 run id> --tracking-uri sqlite:///runs/mlflow.db

The check runs on the CPU (bf16 autocast works on CPUs without native bf16 too, only slower). The
weights and the logged run are not changed.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys

import numpy as np
import torch

from cifar_baselines.batches import BatchIterator
from cifar_baselines.data import CifarSplits
from cifar_baselines.resnet import resnet32
from cifar_baselines.stages import load_stage1
from cifar_baselines.steps import TrainStep, training_precision
from lungcal.calibration.losses import FocalLoss

MEASURES = ("bf16 error", "bf16 cosine", "augmentation noise", "batch noise")
ACCUMULATION = "bf16 accumulation"  # |sum of the K errors| / sqrt(sum of their squared norms)


def run_loss(settings: dict) -> torch.nn.Module:
    """The stage-1 run's training loss: focal (its γ and α) for ``focal*`` methods, else cross-entropy."""
    if str(settings.get("method", "ce")).startswith("focal"):
        return FocalLoss(gamma=float(settings.get("focal_gamma", 3.0)), alpha=settings.get("focal_alpha"))
    return torch.nn.CrossEntropyLoss()


def flat_gradient(network: torch.nn.Module, loss_fn: torch.nn.Module, x: torch.Tensor, target: torch.Tensor,
                  bf16: bool = False) -> torch.Tensor:
    """The float32 gradient of every parameter, flattened, of one training-mode step on ``(x, target)``.

    ``bf16``: the forward pass runs under CPU bf16 autocast, as a :class:`~cifar_baselines.steps.TrainStep`
    does on a CPU with native bf16; the loss is taken on float32 logits either way.
    """
    network.train()
    network.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with ctx:
        logits = network(x)
    loss_fn(logits.float(), target).backward()
    return torch.cat([p.grad.reshape(-1) for p in network.parameters()])


def gradient_noise(network: torch.nn.Module, loss_fn: torch.nn.Module, data: CifarSplits, n_batches: int = 20,
                   batch_size: int = 128, mixup_alpha: float = 0.0, seed: int = 0) -> dict[str, np.ndarray]:
    """Per batch: the bf16 error and cosine, and the augmentation and batch noise (see the module doc);
    under :data:`ACCUMULATION`, one value: how the K bf16 errors add up.

    ``network`` is copied (training-mode passes update BatchNorm running statistics); batches come
    from the training split in the run's seeded shuffle, ``n_batches + 1`` of them.
    """
    net = copy.deepcopy(network).to(memory_format=torch.channels_last)
    step = TrainStep(num_classes=10, mixup_alpha=mixup_alpha, seed=seed)  # its generator: seed + 1, as training
    batches = []
    for x, y in BatchIterator(data.train_x, data.train_y, batch_size, seed=seed, drop_last=True):
        batches.append((x, y))
        if len(batches) > n_batches:
            break
    if len(batches) < 2:
        raise ValueError(f"the training split holds {len(data.train_y)} images: fewer than two batches of "
                         f"{batch_size}; lower --batch-size")
    out = {k: [] for k in MEASURES}
    err_sum, err_sq = None, 0.0
    for (x, y), (x_next, y_next) in zip(batches[:-1], batches[1:]):
        xb, target = step.batch(x, y)
        g = flat_gradient(net, loss_fn, xb, target)
        g16 = flat_gradient(net, loss_fn, xb, target, bf16=True)
        g_aug = flat_gradient(net, loss_fn, *step.batch(x, y))
        g_next = flat_gradient(net, loss_fn, *step.batch(x_next, y_next))
        norm, err = g.norm(), g16 - g
        err_sum = err if err_sum is None else err_sum + err
        err_sq += float(err.square().sum())
        out["bf16 error"].append(float(err.norm() / norm))
        out["bf16 cosine"].append(float(torch.nn.functional.cosine_similarity(g16, g, dim=0)))
        out["augmentation noise"].append(float((g_aug - g).norm() / norm))
        out["batch noise"].append(float((g_next - g).norm() / norm))
    res = {k: np.asarray(v) for k, v in out.items()}
    res[ACCUMULATION] = np.asarray([float(err_sum.norm()) / np.sqrt(err_sq)])
    return res


def summarise(values: np.ndarray) -> str:
    """``mean [low, high]``: the mean over batches with a 95% normal interval."""
    half = 1.96 * values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
    m = values.mean()
    return f"{m:.4f} [{m - half:.4f}, {m + half:.4f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-id", required=True, help="a CIFAR stage-1 MLflow run")
    ap.add_argument("--tracking-uri", default=None, help="default: the project's runs/mlflow.db")
    ap.add_argument("--data-dir", default=None, help="the CIFAR-10 folder (default: the runs' data folder)")
    ap.add_argument("--output-dir", default=None, help="the runs folder (default: $LUNGCAL_HOME or ./runs)")
    ap.add_argument("--batches", type=int, default=20, help="training batches measured (default 20)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    stage1 = load_stage1(args.run_id, tracking_uri=args.tracking_uri, output_dir=args.output_dir)
    data = stage1.load_splits(data_dir=args.data_dir, output_dir=args.output_dir)
    loss_fn = run_loss(stage1.settings)
    alpha = float(stage1.settings.get("mixup_alpha") or 0.0)
    torch.manual_seed(args.seed)
    weights = {"trained": stage1.load_into(resnet32(10)), "initial": resnet32(10)}

    print(f"stage-1 run {args.run_id} ({stage1.method}, {stage1.settings.get('dataset')}; loss "
          f"{type(loss_fn).__name__}, mixup α {alpha:g}); {args.batches} training batches of {args.batch_size}; "
          f"relative to |g| (float32), mean [95% interval]. This CPU trains in "
          f"{training_precision('cpu', True)} with amp on.\n")
    print("| weights | " + " | ".join(MEASURES) + " | bf16 error / augmentation noise | "
          f"bf16 accumulation over {args.batches} (1: cancels, {np.sqrt(args.batches):.1f}: a bias) |")
    print("|---|" + "---|" * (len(MEASURES) + 2))
    for name, net in weights.items():
        r = gradient_noise(net, loss_fn, data, args.batches, args.batch_size, alpha, args.seed)
        ratio = r["bf16 error"].mean() / r["augmentation noise"].mean()
        cells = [summarise(r[k]) for k in MEASURES] + [f"{ratio:.3f}", f"{r[ACCUMULATION][0]:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
