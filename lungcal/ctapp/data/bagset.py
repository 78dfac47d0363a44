"""The in-memory bag dataset of one split, with its label-preserving training augmentation."""
from __future__ import annotations

import torch

__all__ = ["random_orientation", "random_noise", "BagSet"]


def random_orientation(bag: torch.Tensor, generator: torch.Generator, permute: bool = True) -> torch.Tensor:
    """One random element of the cube's symmetry group applied to every patch of a bag.

    ``bag (K, 1, P, P, P)``: each spatial axis is flipped with probability 1/2 and, with
    ``permute``, the axes are shuffled (valid only for isotropic voxels). A nodule has no preferred
    orientation, so this is label-preserving; with a few hundred training CTs it is what stops the
    instance encoder from memorising them (5-fold CV AUC 0.49 -> 0.65 on the demo cohort).
    """
    flips = [d + 2 for d in range(3) if torch.rand((), generator=generator) < 0.5]
    if permute:
        order = (torch.randperm(3, generator=generator) + 2).tolist()
        bag = bag.permute(0, 1, *order)
    return bag.flip(flips) if flips else bag


def random_noise(bag: torch.Tensor, generator: torch.Generator, max_std: float) -> torch.Tensor:
    """Additive Gaussian noise of a random strength ``U(0, max_std)`` (window units) on a bag, clipped to [0, 1].

    A scanner's noise level varies with dose, kernel and slice thickness. The strength is drawn per
    bag, so the network sees the whole range; the clip is the HU window's, as for a real noisier
    scan. Off in the shipped bundles (``augment_noise_hu: 0``): on the two-site test it did not
    stop the default model from calling almost every CT of the other scanner cancer (B's AUC 0.518
    with it, 0.557 without; docs/results.md, "Hospital: two synthetic sites"), so the cause there
    is not the noise, and its effect on the headline is unmeasured. What moved B's calibration is
    the scanner-kernel augmentation of the training CTs before detection (:mod:`lungcal.ct.kernel`,
    ``augment_kernel_mm``, also off: it costs in-domain AUC); this noise on top of it lowered B's
    AUC again (0.514).
    """
    std = float(torch.rand((), generator=generator)) * float(max_std)
    noise = torch.randn(bag.shape, generator=generator, dtype=bag.dtype)
    return (bag + std * noise).clamp_(0.0, 1.0)


class BagSet(torch.utils.data.Dataset):
    """In-memory bags of one split: ``{"bag" (K,1,P,P,P), "mask" (K,), "label", "index"}``.

    With ``augment``, each bag is randomly flipped (and its axes permuted when ``isotropic``), see
    :func:`random_orientation`, and, with ``noise_std > 0``, gets scanner-like noise
    (:func:`random_noise`; ``noise_std = 0`` draws nothing, so the sequence is as without it).
    ``seed`` seeds the dataset's own generator, so the sequence is reproducible and the global RNG
    is not touched.
    """

    def __init__(self, bags: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, augment: bool = False,
                 isotropic: bool = True, seed: int = 0, noise_std: float = 0.0) -> None:
        if not 0.0 <= float(noise_std) < 1.0:
            raise ValueError(f"noise_std must be in [0, 1) window units, got {noise_std}")
        self.bags, self.mask, self.labels = bags, mask, labels
        self.augment, self.isotropic = augment, isotropic
        self.noise_std = float(noise_std)
        self._gen = torch.Generator().manual_seed(int(seed))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        bag = self.bags[i]
        if self.augment:
            bag = random_orientation(bag, self._gen, permute=self.isotropic).contiguous()
            if self.noise_std > 0:
                bag = random_noise(bag, self._gen, self.noise_std)
        return {"bag": bag, "mask": self.mask[i], "label": self.labels[i], "index": torch.tensor(i)}
