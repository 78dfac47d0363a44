"""BagSet / random_orientation: label-preserving, reproducible training augmentation."""
import itertools

import pytest
import torch

from lungcal.ctapp.data.bagset import BagSet, random_noise, random_orientation


def _bag(k=3, p=6):
    return torch.arange(k * p**3, dtype=torch.float32).reshape(k, 1, p, p, p)


def test_random_orientation_is_a_cube_symmetry():
    bag = _bag()
    g = torch.Generator().manual_seed(0)
    group = set()
    for flips in itertools.chain.from_iterable(itertools.combinations((2, 3, 4), n) for n in range(4)):
        for perm in itertools.permutations((2, 3, 4)):
            x = bag.permute(0, 1, *perm)
            group.add((x.flip(flips) if flips else x).numpy().tobytes())
    seen = set()
    for _ in range(400):
        out = random_orientation(bag, g)
        assert out.shape == bag.shape
        # the same voxels, only moved; each patch keeps its own content
        assert torch.equal(out.flatten(1).sort(dim=1).values, bag.flatten(1).sort(dim=1).values)
        seen.add(out.numpy().tobytes())
    assert seen <= group and len(seen) == 48  # all 48 symmetries of the cube, nothing else


def test_no_permutation_for_anisotropic_bags_only_flips():
    bag = _bag()
    g = torch.Generator().manual_seed(1)
    outs = {random_orientation(bag, g, permute=False).numpy().tobytes() for _ in range(200)}
    flips_only = set()
    for flips in itertools.chain.from_iterable(itertools.combinations((2, 3, 4), n) for n in range(4)):
        flips_only.add((bag.flip(flips) if flips else bag).numpy().tobytes())
    assert outs == flips_only


def test_bagset_augments_reproducibly_and_leaves_labels_and_masks():
    bags, mask, labels = _bag(4).unsqueeze(0).repeat(5, 1, 1, 1, 1, 1), torch.ones(5, 4, dtype=torch.bool), \
        torch.tensor([0, 1, 0, 1, 1])
    plain = BagSet(bags, mask, labels)
    assert torch.equal(plain[2]["bag"], bags[2])
    a, b = BagSet(bags, mask, labels, augment=True, seed=7), BagSet(bags, mask, labels, augment=True, seed=7)
    items_a = [a[i] for i in range(5)]
    items_b = [b[i] for i in range(5)]
    assert all(torch.equal(x["bag"], y["bag"]) for x, y in zip(items_a, items_b))
    assert any(not torch.equal(x["bag"], bags[i]) for i, x in enumerate(items_a))
    assert [int(x["label"]) for x in items_a] == labels.tolist()
    assert all(torch.equal(x["mask"], mask[i]) for i, x in enumerate(items_a))


def test_random_noise_strength_is_uniform_up_to_its_bound_and_clipped_to_the_window():
    g = torch.Generator().manual_seed(3)
    bag = torch.full((8, 1, 16, 16, 16), 0.5)
    stds = torch.tensor([float((random_noise(bag, g, 0.05) - bag).std()) for _ in range(400)])
    assert float(stds.max()) <= 0.05 * 1.05 and float(stds.min()) < 0.005
    assert abs(float(stds.mean()) - 0.025) < 0.003  # U(0, 0.05) has mean 0.025
    edge = random_noise(torch.zeros(2, 1, 8, 8, 8), torch.Generator().manual_seed(0), 0.5)
    assert float(edge.min()) == 0.0 and float(edge.max()) <= 1.0


def test_noise_off_draws_nothing_so_the_augmented_sequence_is_unchanged():
    bags = _bag(4).unsqueeze(0).repeat(3, 1, 1, 1, 1, 1)
    mask, labels = torch.ones(3, 4, dtype=torch.bool), torch.tensor([0, 1, 0])
    off, zero = BagSet(bags, mask, labels, augment=True, seed=5), BagSet(bags, mask, labels, augment=True, seed=5,
                                                                         noise_std=0.0)
    assert all(torch.equal(off[i]["bag"], zero[i]["bag"]) for i in range(3))
    noisy = BagSet(bags, mask, labels, augment=True, seed=5, noise_std=0.02)
    assert not torch.equal(noisy[0]["bag"], BagSet(bags, mask, labels, augment=True, seed=5)[0]["bag"])
    assert torch.equal(BagSet(bags, mask, labels, noise_std=0.02)[1]["bag"], bags[1])  # no augment, no noise
    with pytest.raises(ValueError, match="noise_std"):
        BagSet(bags, mask, labels, noise_std=1.5)
