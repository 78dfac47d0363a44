"""LesionDetector: its two channels interleaved by a pattern of slots, the ground-glass channel, its
config; on a real background (LIDC-IDRI-0001 with lesions inserted), every lesion type in every place
reaches the default bag."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from lungcal.candidates.detector import Candidates, LoGBlobDetector, MaskMemo
from lungcal.candidates.detector_config import detector_config, detector_from_config
from lungcal.candidates.lesions import GlassChannel, LesionDetector, interleave, median_filter
from lungcal.candidates.sensitivity import lesion_ranks
from lungcal.ctapp.evaluate.lesion_bed import PRESETS, _preprocessed
from lungcal.data.synthetic.insertion import InsertedLesion, choose_centre, draw_lesion, insert_lesions

WINDOW = (-1000.0, 400.0)


def _cands(xs, radius=1.0):
    vox = np.array([[x, 0, 0] for x in xs], np.int64).reshape(-1, 3)
    score = np.arange(len(xs), 0, -1, dtype=float)
    return Candidates(vox, vox.astype(float), np.full(len(xs), radius), score)


@pytest.mark.parametrize("shape,size", [((30, 27, 33), (3, 3, 3)), ((12, 17, 9), (5, 5, 3)), ((3, 20, 20), (5, 3, 3)),
                                        ((1, 7, 7), (3, 3, 3)), ((19, 10, 21), (1, 3, 5))])
def test_median_filter_is_scipys_bit_for_bit(shape, size):
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(size=shape).astype(np.float32)
    x[::3] = np.round(x[::3])  # ties
    np.testing.assert_array_equal(median_filter(x, size, slab=4), ndimage.median_filter(x, size=size))


def test_median_filter_refuses_an_even_window():
    with pytest.raises(ValueError, match="odd"):
        median_filter(np.zeros((4, 4, 4), np.float32), (2, 3, 3))


def test_mask_memo_closes_a_mask_once_and_finds_it_by_content():
    calls = []

    def compute():
        calls.append(1)
        return np.ones((4, 4, 4), bool), np.ones((4, 4, 4), bool)

    memo, mask = MaskMemo(), np.zeros((4, 4, 4), bool)
    first = memo.get(mask, (2.5, 2.5, 2.5), (8.0, 4.0), compute)
    again = memo.get(mask.copy(), np.array([2.5, 2.5, 2.5]), (8.0, 4.0), compute)  # another array, same content
    assert len(calls) == 1 and again[0] is first[0] and not first[0].flags.writeable
    memo.get(mask, (2.0, 2.5, 2.5), (8.0, 4.0), compute)  # another grid
    memo.get(mask, (2.5, 2.5, 2.5), (10.0, 4.0), compute)  # another closing
    other = mask.copy()
    other[1, 1, 1] = True
    memo.get(other, (2.5, 2.5, 2.5), (8.0, 4.0), compute)  # another mask
    assert len(calls) == 4


def test_the_memo_leaves_the_candidates_as_they_are(lidc_background):
    image, lung, affine, _ = _scan(lidc_background, [], 0)
    sp = np.linalg.norm(affine[:3, :3], axis=0)
    det = LoGBlobDetector(top_k=16)
    memo = MaskMemo()
    shared = [det.detect(image, lung, sp, affine, memo=memo) for _ in range(2)]  # the second finds the closing
    alone = det.detect(image, lung, sp, affine)
    for got in shared:
        np.testing.assert_array_equal(got.voxel, alone.voxel)
        np.testing.assert_array_equal(got.score, alone.score)


def test_interleave_follows_the_pattern_and_skips_overlaps():
    solid, glass = _cands([0, 100, 200, 300]), _cands([1000, 100, 2000])
    out = interleave({"S": solid, "G": glass}, "SSG", (1, 1, 1), top_k=10)
    # S S G S S G ...: the glass 100 overlaps the solid one taken before it, so the glass 2000 comes next
    assert out.voxel[:, 0].tolist() == [0, 100, 1000, 200, 300, 2000]
    assert np.all(np.diff(out.score) < 0) and out.score[0] == len(out)


def test_interleave_gives_a_spent_channels_slots_to_the_other():
    out = interleave({"S": _cands([0]), "G": _cands([10, 20, 30])}, "SG", (1, 1, 1), top_k=3)
    assert out.voxel[:, 0].tolist() == [0, 10, 20]
    assert len(interleave({"S": Candidates(), "G": Candidates()}, "SG", (1, 1, 1), top_k=3)) == 0


def test_interleave_keeps_the_reference_channels_scores():
    """With a reference channel, its picks keep their own scores and the others' are interpolated
    between them: sorted, and a CT whose other channel is empty scores as the reference alone."""
    vox = np.array([[0, 0, 0], [100, 0, 0], [200, 0, 0]])
    solid = Candidates(vox, vox.astype(float), np.ones(3), np.array([0.9, 0.5, 0.3]))
    glass = _cands([1000, 2000])
    out = interleave({"S": solid, "G": glass}, "SG", (1, 1, 1), top_k=10, reference="S")
    assert out.voxel[:, 0].tolist() == [0, 1000, 100, 2000, 200]
    np.testing.assert_allclose(out.score, [0.9, 0.7, 0.5, 0.4, 0.3])
    alone = interleave({"S": solid, "G": Candidates()}, "SG", (1, 1, 1), top_k=10, reference="S")
    np.testing.assert_array_equal(alone.score, solid.score)
    # a ranking that starts or ends with the other channel takes its nearest reference score
    edge = interleave({"S": solid.top(1), "G": glass}, "GS", (1, 1, 1), top_k=10, reference="S")
    np.testing.assert_allclose(edge.score, [0.9, 0.9, 0.9])


def test_the_gate_keeps_only_peaks_scoring_at_least_min_score(lidc_background):
    """The ground-glass channel's gate filters its own ranking: gated, it returns the ungated peaks
    that score at least ``min_score``, in the same order."""
    image, lung, affine, _ = _scan(lidc_background, [], 0)
    sp = np.linalg.norm(affine[:3, :3], axis=0)
    free = GlassChannel(hu_window=WINDOW, min_score=None, top_k=64).detect(image, lung, sp, affine)
    gated = GlassChannel(hu_window=WINDOW, min_score=0.05, top_k=64).detect(image, lung, sp, affine)
    keep = free.score >= 0.05
    assert 0 < len(gated) < len(free)
    np.testing.assert_array_equal(gated.world, free.world[keep][: len(gated)])


def test_interleave_refuses_a_pattern_naming_a_missing_channel():
    with pytest.raises(ValueError, match="pattern"):
        interleave({"S": _cands([0])}, "SG", (1, 1, 1), top_k=3)


def test_the_config_rebuilds_it():
    det = LesionDetector(pattern="SG", glass={"median_mm": 4.0}, hu_window=[-1000, 400])
    cfg = detector_config(det)
    assert cfg["_target_"] == "lungcal.candidates.lesions.LesionDetector"
    again = detector_from_config(cfg)
    assert isinstance(again, LesionDetector) and again.config() == det.config()
    with pytest.raises(ValueError, match="pattern"):
        LesionDetector(pattern="SX")


def _scan(bg, specs, seed):
    """``bg`` with lesions ``(kind, place, diameter, gg_hu, core_frac)`` inserted, preprocessed at the
    default preset: image, lung mask, affine and the lesions."""
    rng = np.random.default_rng(seed)
    lesions: list[InsertedLesion] = []
    for kind, place, d, gg, core in specs:
        got = choose_centre(bg, place, d, rng, [(np.asarray(x.centre_ras), x.radius_mm) for x in lesions])
        assert got is not None, (kind, place)
        lesions.append(InsertedLesion(place=place, centre_ras=tuple(float(v) for v in got[0]),  # type: ignore[arg-type]
                                      posterior=got[1], seed=seed, **draw_lesion(kind, rng, d, gg, core)))
    image, lung, affine = _preprocessed(insert_lesions(bg, lesions), bg, PRESETS["default"], WINDOW)
    return np.asarray(image[0]), lung, affine, lesions


def _ranks(c: Candidates, lesions, affine, patch):
    return lesion_ranks(np.array([x.centre_ras for x in lesions]), np.array([x.radius_mm for x in lesions]),
                        np.array([x.kind == "mass" for x in lesions]), c.voxel, c.world, affine, patch)


def test_the_glass_channel_ranks_ground_glass_the_solid_search_leaves_out(lidc_background):
    image, lung, affine, lesions = _scan(lidc_background, [("ground-glass", "free", 14.0, -600.0, None)], seed=3)
    sp = np.linalg.norm(affine[:3, :3], axis=0)
    glass = _ranks(GlassChannel(hu_window=WINDOW).detect(image, lung, sp, affine), lesions, affine, 16)
    solid = _ranks(LoGBlobDetector().detect(image, lung, sp, affine), lesions, affine, 16)
    assert 0 < glass[0] <= 3, glass
    assert solid[0] == 0 or solid[0] > glass[0], (solid, glass)


#: the lesions of the Latin square below: one of each kind to a scan, each kind in every place once
_KINDS = [("solid", 12.0, None, None), ("part-solid", 16.0, -600.0, 0.4), ("ground-glass", 16.0, -600.0, None),
          ("mass", 45.0, None, None)]
_PLACES = ("free", "pleura", "mediastinum", "vessel")


#: issue 43 item 3's target, not met yet: scans that miss a lesion of the default bag (K = 16). The solid
#: nodule touching a vessel of scan 3 (9th) is in it since K went from 8 to 16; the ground glass against the
#: mediastinum of scan 0 ranks 24th with the default pattern SSSG (18th with SSG, 12th with SG)
_SHORT = {0: "ground glass against the mediastinum ranks 24th"}


@pytest.mark.parametrize("shift", [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=_SHORT[s]))
                                   if s in _SHORT else s for s in range(4)])
def test_every_kind_in_every_place_reaches_the_bag(lidc_background, shift):
    """Scan ``shift`` holds the four kinds, kind ``i`` in place ``(i + shift) % 4``: over the four scans
    each kind meets each place once, each lesion in the bag of the default preset (K = 16). The scans
    that still miss a lesion are strict xfails naming it, so that a fix shows up here."""
    specs = [(kind, _PLACES[(i + shift) % 4], d, gg, core) for i, (kind, d, gg, core) in enumerate(_KINDS)]
    image, lung, affine, lesions = _scan(lidc_background, specs, seed=100 + shift)
    sp = np.linalg.norm(affine[:3, :3], axis=0)
    ranks = _ranks(LesionDetector().detect(image, lung, sp, affine), lesions, affine, PRESETS["default"].patch_size)
    missed = [(x.kind, x.place, int(r)) for x, r in zip(lesions, ranks) if not 0 < r <= PRESETS["default"].k]
    assert not missed, missed
