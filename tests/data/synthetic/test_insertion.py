"""Lesions inserted into a real CT (lungcal.data.synthetic.insertion) on LIDC-IDRI-0001 (2.5 mm, from
../shared/data/ct; skipped where it is absent): each kind reads its density, the lift stays local, the scan's
noise and vessels stay, each place is where it says, and the truth file round-trips."""
from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import ndimage

from lungcal.ct.io import load_ct
from lungcal.ct.masking import fill_holes_2d
from lungcal.data.synthetic.insertion import (
    KINDS,
    MASS_MM,
    NODULE_MM,
    Background,
    InsertedLesion,
    choose_centre,
    draw_lesion,
    insert_lesions,
    lesion_delta,
    plan_lesions,
    read_truth,
    write_lesion_bed,
)


def _vox(bg: Background, ras) -> np.ndarray:
    return np.linalg.solve(bg.affine[:3, :3], np.asarray(ras, float) - bg.affine[:3, 3])


def _box(bg: Background, centre, half_mm: float) -> tuple[slice, ...]:
    c = _vox(bg, centre)
    half = half_mm / bg.spacing
    lo = np.maximum(np.floor(c - half).astype(int), 0)
    hi = np.minimum(np.ceil(c + half).astype(int) + 1, bg.hu.shape)
    return tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))


def _dist(bg: Background, box: tuple[slice, ...], centre) -> np.ndarray:
    """Distance (mm) of each voxel of ``box`` from ``centre``."""
    g = np.stack(np.meshgrid(*[np.arange(s.start, s.stop) for s in box], indexing="ij"), -1)
    return np.linalg.norm((g - _vox(bg, centre)) * bg.spacing, axis=-1)


def _lesion(bg: Background, kind: str, place: str, diameter: float, seed: int, **kw) -> InsertedLesion:
    rng = np.random.default_rng(seed)
    got = choose_centre(bg, place, diameter, rng)
    assert got is not None, (place, diameter)
    spec = {**draw_lesion(kind, rng, diameter_mm=diameter), **kw}
    return InsertedLesion(place=place, centre_ras=tuple(float(v) for v in got[0]), posterior=got[1], seed=seed, **spec)


def _inserted(bg: Background, lesion: InsertedLesion, half_mm: float):
    """(box, background HU, inserted HU, distance from the centre) around ``lesion``."""
    box = _box(bg, lesion.centre_ras, half_mm)
    after = insert_lesions(bg, [lesion])[box]
    return box, bg.hu[box].astype(np.float64), after.astype(np.float64), _dist(bg, box, lesion.centre_ras)


def test_a_solid_nodule_reads_soft_tissue_at_its_centre(lidc_background):
    bg = lidc_background
    les = _lesion(bg, "solid", "free", 14.0, seed=1)
    box, before, after, d = _inserted(bg, les, 20)
    inner = d <= 0.4 * les.radius_mm
    assert np.median(before[inner]) < -600  # it went into aerated lung
    assert abs(np.median(after[inner]) - 40.0) < 20  # solid_hu 40 within the noise (17 HU on this scan)
    assert np.median(after[(d > les.radius_mm + 4) & (d < les.radius_mm + 8)]) < -600  # and ends at its edge


@pytest.mark.parametrize("kind, gg_hu", [("ground-glass", -600.0), ("ground-glass", -750.0), ("part-solid", -650.0)])
def test_ground_glass_reads_its_density_over_the_lung(lidc_background, kind, gg_hu):
    bg = lidc_background
    kw = {"gg_hu": gg_hu} | ({"core_frac": 0.4} if kind == "part-solid" else {})
    les = _lesion(bg, kind, "free", 22.0, seed=2, **kw)
    box, before, after, d = _inserted(bg, les, 25)
    r = les.radius_mm
    parenchyma = before < gg_hu - 100  # where the lung was lighter than the ground glass (not a vessel)
    halo = parenchyma & (d <= 0.8 * r) & (d >= (les.core_frac * r + 3 if les.core_frac else 0))
    assert halo.sum() > 100
    assert abs(np.median(after[halo]) - gg_hu) < 40, np.median(after[halo])
    if kind == "part-solid":  # the solid core (0.4 x 22 mm = 8.8 mm across) reads soft tissue
        core = d <= 0.3 * les.core_frac * r
        assert abs(np.median(after[core]) - 40.0) < 40, np.median(after[core])


def test_the_lift_is_zero_far_from_the_lesion(lidc_background):
    bg = lidc_background
    les = _lesion(bg, "mass", "pleura", 36.0, seed=3)
    box, delta = lesion_delta(bg, les)
    d = _dist(bg, box, les.centre_ras)
    reach = les.radius_mm * (1 + les.lobulation) + 0.5 * np.linalg.norm(bg.spacing) + 4 * bg.psf_sigma_mm.max() \
        + bg.spacing.max()
    assert np.abs(delta[d <= les.radius_mm * 0.5]).min() > 100  # it does lift the lung it fills
    assert not np.any(delta[d > reach])  # exactly zero beyond the lesion, its partial volume and its blur
    out = insert_lesions(bg, [les])
    changed = np.argwhere(out != bg.hu)
    assert len(changed) and np.all((changed >= [s.start for s in box]) & (changed < [s.stop for s in box]))


def test_the_scans_noise_stays_inside_a_large_ground_glass_lesion(lidc_background):
    """Inside a 26 mm ground-glass lesion the fine-scale residual (HU minus its 1.5 mm Gaussian mean) of the
    aerated lung it covers keeps the spread of the lung beside it: the scan's noise is not smoothed away."""
    bg = lidc_background
    les = _lesion(bg, "ground-glass", "free", 26.0, seed=4, gg_hu=-600.0)
    box, before, after, d = _inserted(bg, les, 40)
    sigma = 1.5 / bg.spacing

    def residual(x):
        return x - ndimage.gaussian_filter(x, sigma)

    r = les.radius_mm
    lung = np.asarray(bg.lung[box])
    inside = (before < -700) & (d <= 0.6 * r)
    beside = (before < -700) & lung & (d >= 1.3 * r) & (d <= 2.0 * r)
    local_noise = residual(before)[beside].std()
    kept = residual(after)[inside].std()
    assert 0.7 < kept / local_noise < 1.4, (kept, local_noise)
    # the check has teeth: a lesion smoothed to its mean would fail it
    smoothed = np.where(d <= r, ndimage.gaussian_filter(after, sigma), after)
    assert residual(smoothed)[inside].std() / local_noise < 0.5


def test_a_vessel_inside_ground_glass_keeps_its_hu(lidc_background):
    bg = lidc_background
    for seed in range(5, 15):  # a lesion touching a vessel of 3 mm or more, until the vessel runs through it
        les = _lesion(bg, "ground-glass", "vessel", 24.0, seed=seed, gg_hu=-650.0)
        box, before, after, d = _inserted(bg, les, 20)
        vessel = (before > -50) & (d <= 0.85 * les.radius_mm)
        if vessel.sum() >= 10:
            break
    else:
        pytest.fail("no vessel ran through 10 lesions placed against a vessel")
    lift = after - before
    parenchyma = (before < -800) & (d <= 0.7 * les.radius_mm)
    assert np.median(lift[parenchyma]) > 120  # the lung is lifted towards -650 HU
    assert abs(np.median(lift[vessel])) < 30, np.median(lift[vessel])  # the vessel is left as it was


def _robust_std(x: np.ndarray) -> float:
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


def test_a_solid_nodule_replaces_the_vessel_it_covers_and_carries_the_scans_noise(lidc_background):
    """Against a vessel of 3 mm or more, a solid nodule reads soft tissue where the vessel ran (no brighter
    ghost of it), and its inside is as noisy as the scan's soft tissue (acquisition noise_hu), not smoother
    and not the lung's texture."""
    bg = lidc_background
    for seed in range(20, 30):
        les = _lesion(bg, "solid", "vessel", 24.0, seed=seed)
        box, before, after, d = _inserted(bg, les, 20)
        vessel = (before > -50) & (d <= 0.8 * les.radius_mm)
        if vessel.sum() >= 10:
            break
    else:
        pytest.fail("no vessel ran through 10 nodules placed against a vessel")
    inner = d <= 0.8 * les.radius_mm
    assert abs(np.median(after[vessel]) - 40.0) < 2 * bg.noise_hu  # the vessel is gone under it
    assert np.percentile(after[inner], 99) < 40.0 + 4 * bg.noise_hu  # no bright vessel ghost inside
    assert 0.7 < _robust_std(after[d <= 0.5 * les.radius_mm]) / bg.noise_hu < 1.3


def _surface(bg: Background, centre, half_mm: float, patch_mm: float = 2.0):
    """Distance (mm) from ``centre`` to the nearest voxel outside the aerated lung (the lung mask where the
    CT smoothed by 1 mm reads below -400 HU, vessels filled slice by slice), on the scan's full grid (whole
    slices, so that a vessel is a hole in every one), and the mean direction (RAS unit vector) of the
    outside voxels within ``patch_mm`` of that distance: where the lesion meets the wall."""
    c = _vox(bg, centre)
    z0, z1 = max(int(c[2] - half_mm / bg.spacing[2]), 0), min(int(c[2] + half_mm / bg.spacing[2]) + 2, bg.hu.shape[2])
    hu = ndimage.gaussian_filter(bg.hu[:, :, z0:z1].astype(np.float32), 1.0 / bg.spacing)
    aerated = fill_holes_2d(bg.lung[:, :, z0:z1] & (hu < -400))
    out = np.argwhere(~aerated) + [0, 0, z0]
    mm = (out - c) * bg.spacing
    dist = np.linalg.norm(mm, axis=1)
    near = dist <= dist.min() + patch_mm
    n = ((mm[near] / dist[near, None]) @ (bg.affine[:3, :3] / bg.spacing).T).mean(axis=0)
    return float(dist.min()), n / np.linalg.norm(n)


def _midline_x(bg: Background) -> float:
    """RAS x of the lung's median voxel along x (between the lungs)."""
    counts = bg.lung.sum(axis=(1, 2))
    i = int(np.searchsorted(np.cumsum(counts), counts.sum() / 2))
    return float((bg.affine @ [i, 0, 0, 1])[0])


@pytest.mark.parametrize("place", ["pleura", "mediastinum", "free"])
def test_each_place_is_where_it_says(lidc_background, place):
    """pleura: the centre ~0.7 r inside the aerated lung's surface, where it meets the chest wall (costal:
    facing neither the midline nor down to the diaphragm or up to the apex); mediastinum: the same against
    the medial surface; free: deep in the lung. (The places are chosen on a ~2 mm grid; this measures at
    the scan's voxels.)"""
    bg = lidc_background
    mid = _midline_x(bg)
    rng = np.random.default_rng(7)
    depths = []
    for diameter in (16.0, 24.0, 32.0, 40.0):
        got = choose_centre(bg, place, diameter, rng)
        assert got is not None
        centre, _ = got
        r = diameter / 2
        depth, n = _surface(bg, centre, r + 12)
        towards_mid = np.sign(mid - centre[0]) * n[0]
        if place == "free":
            assert depth >= r + 3, (diameter, depth)
            continue
        depths.append(depth / r)
        assert 0.35 * r <= depth <= 1.05 * r, (diameter, depth)  # touching the wall, its centre in the lung
        if place == "pleura":
            assert towards_mid < 0.5 and abs(n[2]) < 0.8, (diameter, n)
        else:
            assert towards_mid > 0.0, (diameter, n)
    if depths:
        assert 0.5 <= float(np.median(depths)) <= 0.85, depths


def test_a_posterior_pleura_lesion_lies_on_the_back_wall(lidc_background):
    bg = lidc_background
    rng = np.random.default_rng(8)
    for diameter in (20.0, 30.0):
        centre, posterior = choose_centre(bg, "pleura", diameter, rng, posterior=True)
        assert posterior
        _, n = _surface(bg, centre, diameter / 2 + 12)
        assert n[1] < -0.3, n  # RAS y runs to the front: the nearest wall is behind


def _crop(bg: Background, centre, half_mm: float) -> Background:
    box = _box(bg, centre, half_mm)
    affine = bg.affine.copy()
    affine[:3, 3] = bg.affine[:3, :3] @ [s.start for s in box] + bg.affine[:3, 3]
    return Background("crop", bg.hu[box].copy(), affine, bg.lung[box].copy(), bg.psf_sigma_mm.copy(),
                      noise_hu=bg.noise_hu)


def test_truth_round_trips_through_write_lesion_bed_and_read_truth(lidc_background, tmp_path):
    solid = _lesion(lidc_background, "solid", "free", 12.0, seed=9)
    bg = _crop(lidc_background, solid.centre_ras, 40)  # a small scan: quick to write
    c = np.asarray(solid.centre_ras)
    glass = InsertedLesion("ground-glass", "free", 9.5, tuple(c + [20.0, 0.0, 0.0]), 0.0, -620.5, seed=11)
    part = InsertedLesion("part-solid", "pleura", 14.25, tuple(c + [-18.0, 5.0, 2.5]), 0.35, -700.0,
                          posterior=True, seed=12)
    scans = [("bed-000", [solid, glass]), ("bed-001", [part])]
    truth = write_lesion_bed(bg, scans, tmp_path)
    back = read_truth(truth)
    assert list(back) == ["bed-000", "bed-001"]
    for (_, lesions), got in zip(scans, back.values()):
        assert len(got) == len(lesions)
        for a, b in zip(lesions, got):
            np.testing.assert_allclose(b.centre_ras, a.centre_ras, atol=5e-4)
            assert (b.kind, b.place, b.diameter_mm, b.core_frac, b.gg_hu, b.solid_hu, b.lobulation, b.posterior,
                    b.seed) == (a.kind, a.place, a.diameter_mm, a.core_frac, a.gg_hu, a.solid_hu, a.lobulation,
                                a.posterior, a.seed)
    items = json.loads((tmp_path / "datalist.json").read_text())["data"]
    assert [i["image"] for i in items] == ["bed-000.nii.gz", "bed-001.nii.gz"]
    img = load_ct(tmp_path / "bed-000.nii.gz")  # read back as the pipeline reads it
    np.testing.assert_allclose(np.asarray(img.affine, float), bg.affine, atol=1e-4)
    hu = np.asarray(img[0], np.float32)
    np.testing.assert_array_equal(hu, np.rint(insert_lesions(bg, [solid, glass])))
    at = back["bed-000"][0].centre_ras  # the truth's centre is where the solid nodule reads soft tissue
    box = _box(bg, at, 10)
    assert abs(np.median(hu[box][_dist(bg, box, at) <= 0.4 * solid.radius_mm]) - 40.0) < 20
    # a second background into the same folder adds its rows under the one header
    write_lesion_bed(bg, [("bed-002", [glass])], tmp_path)
    assert (tmp_path / "truth.csv").read_text().count("kind,place") == 1
    assert list(read_truth(truth)) == ["bed-000", "bed-001", "bed-002"]
    assert len(json.loads((tmp_path / "datalist.json").read_text())["data"]) == 3


def test_draw_lesion_ranges():
    rng = np.random.default_rng(0)
    for kind in KINDS:
        specs = [draw_lesion(kind, rng) for _ in range(300)]
        d = np.array([s["diameter_mm"] for s in specs])
        lo, hi = MASS_MM if kind == "mass" else NODULE_MM
        assert d.min() >= lo and d.max() <= hi
        core = np.array([s["core_frac"] for s in specs])
        gg = np.array([s["gg_hu"] for s in specs])
        if kind in ("solid", "mass"):
            assert np.all(core == 1.0) and np.all(gg == 40.0)
        else:
            assert gg.min() >= -800 and gg.max() <= -300
            assert np.all(core == 0.0) if kind == "ground-glass" else (core.min() >= 0.1 and core.max() <= 0.6)
    assert draw_lesion("solid", rng, diameter_mm=7.0)["diameter_mm"] == 7.0
    with pytest.raises(ValueError, match="unknown lesion kind"):
        draw_lesion("calcified", rng)
    with pytest.raises(ValueError, match="unknown place"):
        InsertedLesion("solid", "airway", 5.0, (0.0, 0.0, 0.0))


def test_plan_lesions_keeps_masses_alone_and_lesions_apart(lidc_background):
    bg = lidc_background
    cells = {("mass", "pleura"): 2, ("solid", "free"): 3, ("ground-glass", "mediastinum"): 2,
             ("part-solid", "vessel"): 1}
    scans = plan_lesions(bg, cells, np.random.default_rng(10), per_scan=2)
    placed = [x for s in scans for x in s]
    assert 6 <= len(placed) <= 8
    for s in scans:
        assert 1 <= len(s) <= 2 and (len(s) == 1 or not any(x.kind == "mass" for x in s))
        for i, a in enumerate(s):
            for b in s[i + 1:]:
                assert np.linalg.norm(np.subtract(a.centre_ras, b.centre_ras)) > a.radius_mm + b.radius_mm + 15
    for x in placed:  # clear of the scan's own 3 cm nodule
        for c, r in bg.exclude:
            assert np.linalg.norm(np.asarray(x.centre_ras) - c) > r + x.radius_mm + 15
