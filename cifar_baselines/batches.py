"""Whole-batch sampling, augmentation and normalisation of resident ``uint8`` CIFAR tensors.

No per-sample PIL, no DataLoader workers: :class:`BatchIterator` gathers a batch with one index
from tensors that stay on the model's device, and :func:`augment_batch` crops and flips the whole
batch with one gather.

Sampling contract (the same on every device): every random draw (the epoch order, the crop
offsets and flips, and, in :class:`cifar_baselines.steps.TrainStep`, mixup's λ and partner) is
made by a ``torch.Generator`` on the **CPU** and only the small index tensors are moved to the
data's device. A seed therefore gives the same batches on CPU and CUDA, and no CUDA generator is
ever handed to a CPU-side sampler (PyTorch refuses that).
"""
from __future__ import annotations

import torch
from torch.utils.data import Sampler

from cifar_baselines.data import CIFAR_MEAN, CIFAR_STD

__all__ = ["SAMPLERS", "normalize", "augment_batch", "BatchIterator"]

SAMPLERS = ("shuffle", "balanced", "sequential")


def normalize(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``uint8`` images -> float, scaled to [0, 1] and standardised with the CIFAR mean/std."""
    mean = torch.tensor(CIFAR_MEAN, device=x.device, dtype=dtype).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD, device=x.device, dtype=dtype).view(1, 3, 1, 1)
    return (x.to(dtype) / 255.0 - mean) / std


def augment_batch(x: torch.Tensor, padding: int = 4, flip: bool = True,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop with zero padding and horizontal flip of a whole batch, in one gather.

    Args:
        x: ``(B, C, H, W)`` images of any dtype (``uint8`` is cheapest), on any device.
        padding: pixels of zero padding on each side before the random ``H x W`` crop.
        flip: mirror each image left-right with probability 1/2.
        generator: a CPU ``torch.Generator`` (the offsets are drawn on the CPU, then moved to
            ``x.device``; see the module's sampling contract).

    Returns:
        A tensor of the same shape, dtype and device.
    """
    b, c, h, w = x.shape
    dev = x.device
    xp = torch.nn.functional.pad(x, (padding,) * 4) if padding else x
    oy = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    ox = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    rows = oy[:, None] + torch.arange(h)  # (B, H)
    cols = ox[:, None] + torch.arange(w)  # (B, W)
    if flip:
        mirror = torch.rand(b, generator=generator) < 0.5
        cols = torch.where(mirror[:, None], cols.flip(1), cols)
    rows, cols = rows.to(dev, non_blocking=True), cols.to(dev, non_blocking=True)
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return xp[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]


class BatchIterator:
    """``(uint8 images, labels)`` batches gathered from resident tensors, one epoch per ``iter``.

    Augmentation and normalisation are the training step's job
    (:class:`cifar_baselines.steps.TrainStep` / :class:`~cifar_baselines.steps.EvalStep`).

    Args:
        x, y: ``uint8 (N, 3, 32, 32)`` images and ``int64 (N,)`` labels, on any one device.
        batch_size: images per batch; the last, smaller batch is kept unless ``drop_last``.
        sampler: ``"shuffle"`` (a seeded permutation per epoch), ``"balanced"`` (``N`` draws with
            class-balanced probabilities, with replacement: the LAS stage) or ``"sequential"``.
        seed: seeds the CPU generator of the order.
        drop_last: drop the last incomplete batch.
        index_sampler: a ``torch.utils.data.Sampler`` over ``range(N)`` whose indices replace
            ``sampler``'s order: the ``DistributedSampler`` of ``bundles/multi_gpu.json``, so each
            ``torchrun`` rank iterates its own shard (``None``, the default: ``sampler`` decides).
            A sampler with ``set_epoch`` is given the trainer's epoch by the step or the bundle.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, sampler: str = "shuffle",
                 seed: int = 0, drop_last: bool = False, index_sampler: Sampler | None = None) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}, use one of {SAMPLERS}")
        self.x, self.y, self.batch_size = x, y, int(batch_size)
        self.sampler, self.drop_last = sampler, drop_last
        self.index_sampler = index_sampler
        self.generator = torch.Generator().manual_seed(int(seed))  # CPU, whatever x.device is
        self._class_weights: torch.Tensor | None = None

    def __len__(self) -> int:
        n = len(self.x) if self.index_sampler is None else len(self.index_sampler)  # type: ignore[arg-type]  # the samplers used here are sized
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self) -> torch.Tensor:
        """The next epoch's indices, drawn on the CPU (advances the generator, or asks ``index_sampler``)."""
        if self.index_sampler is not None:
            return torch.as_tensor(list(self.index_sampler), dtype=torch.long)
        n = len(self.x)
        if self.sampler == "sequential":
            return torch.arange(n)
        if self.sampler == "balanced":
            if self._class_weights is None:
                y = self.y.cpu()
                counts = torch.bincount(y).to(torch.float64)
                self._class_weights = (1.0 / counts.clamp_min(1))[y]
            return torch.multinomial(self._class_weights, n, replacement=True, generator=self.generator)
        return torch.randperm(n, generator=self.generator)

    def __iter__(self):
        order = self.order().to(self.x.device)
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[idx], self.y[idx]
