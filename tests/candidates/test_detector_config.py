"""The swappable detector: its config, its part of the bag cache key, its rebuild from stored bag parameters."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from lungcal.candidates.cache import BagCache, BagParams, build_bags, compute_bag, load_bag
from lungcal.candidates.detector import Candidates, LoGBlobDetector, voxel_to_world
from lungcal.candidates.detector_config import (
    LOG_TARGET,
    detector_bag_params,
    detector_config,
    detector_from_config,
    detector_key,
)
from lungcal.errors import ConfigError
from tests.candidates.test_cache import fake_preprocess, sources  # noqa: F401  (a fixture, used by name)

#: the bag parameters of the CT bundles (bundles/nlst_*.json) with the default detector
BUNDLE_PARAMS = {"spacing": [2.5, 2.5, 2.5], "hu_window": [-1000.0, 400.0], "k": 8, "patch_size": 16}
#: sha256 of their resolved parameters (the part of the cache key that is not source, code or version),
#: computed before the detector could be swapped: the default pipeline's cache entries stay valid
BUNDLE_PARAMS_SHA256 = "24949858fb0028a053e75f653c314010deba37c782424e84ef9047a2c8bdad3a"


class FixedPoints:
    """A test detector: candidates at given voxels, scored by the image there (the brightest first)."""

    def __init__(self, points=((20, 18, 15), (8, 8, 8)), radius_mm: float = 3.0) -> None:
        self.points = [list(map(int, p)) for p in points]
        self.radius_mm = float(radius_mm)

    def detect(self, image, lung_mask, spacing, affine) -> Candidates:
        vol = np.asarray(image)[0] if np.ndim(image) == 4 else np.asarray(image)
        vox = np.asarray(self.points, np.int64).reshape(-1, 3)
        score = vol[vox[:, 0], vox[:, 1], vox[:, 2]].astype(np.float64)
        order = np.argsort(-score, kind="stable")
        vox = vox[order]
        return Candidates(vox, voxel_to_world(vox, affine), np.full(len(vox), self.radius_mm), score[order])

    def config(self) -> dict:
        return {"_target_": f"{__name__}.FixedPoints", "points": self.points, "radius_mm": self.radius_mm}


class NoConfig:
    def detect(self, image, lung_mask, spacing, affine) -> Candidates:
        return Candidates()


class Forgetful(FixedPoints):
    """Its config leaves out an argument: the stored config would rebuild another detector."""

    def config(self) -> dict:
        return {"points": self.points}


class NotCandidates(FixedPoints):
    def detect(self, image, lung_mask, spacing, affine):
        return [(20, 18, 15)]

    def config(self) -> dict:
        return {**super().config(), "_target_": f"{__name__}.NotCandidates"}


def test_the_default_detector_keeps_the_key_it_always_had():
    resolved = BagParams.from_any(BUNDLE_PARAMS).resolved()
    assert hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest() == BUNDLE_PARAMS_SHA256
    assert resolved["detector"] == {"class": "LoGBlobDetector",
                                    **json.loads(json.dumps(dataclasses.asdict(LoGBlobDetector())))}
    # the default object, or the default named by _target_ (any import path), adds nothing to the bag parameters
    assert detector_bag_params(LoGBlobDetector()) is None and detector_bag_params(None) is None
    for cfg in ({}, {"_target_": LOG_TARGET}, {"_target_": "lungcal.candidates.LoGBlobDetector"}):
        assert detector_key(cfg) == resolved["detector"]
    # another LoGBlobDetector setting is stored as before: its arguments, no _target_
    tuned = detector_bag_params(LoGBlobDetector(top_k=16))
    assert "_target_" not in tuned and tuned["top_k"] == 16
    assert detector_key(tuned) == BagParams(detector={"top_k": 16}).resolved()["detector"]


def test_a_plugged_in_detector_is_used_keyed_apart_and_rebuilt_from_its_config(sources, tmp_path):  # noqa: F811
    a, b, _ = sources
    det = FixedPoints()
    cfg = detector_config(det)
    assert cfg == {"_target_": "tests.candidates.test_detector_config.FixedPoints",
                   "points": [[20, 18, 15], [8, 8, 8]], "radius_mm": 3.0}
    assert detector_bag_params(det) == cfg
    params = {"k": 4, "patch_size": 8, "detector": cfg}
    # (2) its own key: not the default's, not another setting's
    cache = BagCache(tmp_path / "cache")
    keys = {cache.key(a, params), cache.key(a, {"k": 4, "patch_size": 8}),
            cache.key(a, {**params, "detector": detector_config(FixedPoints(radius_mm=4.0))})}
    assert len(keys) == 3
    # (1) it is what builds the bag: its points, its radius, the blob's (brighter) point first
    rows = [{"image": str(a), "subject": "s-a", "split": "test"}, {"image": str(b), "subject": "s-b", "split": "test"}]
    out = build_bags(rows, params, tmp_path / "cache", num_workers=0, progress=False, preprocess=fake_preprocess)
    entry = load_bag(out[0]["bag"])
    assert entry["voxel"].tolist() == [[20, 18, 15], [8, 8, 8]] and entry["radius_mm"].tolist() == [3.0, 3.0]
    assert entry["mask"].tolist() == [True, True, False, False] and int(entry["n_detected"]) == 2
    assert json.loads(str(entry["meta"]))["params"]["detector"] == cfg
    default = compute_bag(a, {"k": 4, "patch_size": 8}, preprocess=fake_preprocess)
    assert [8, 8, 8] not in default["voxel"].tolist()  # the LoG detector finds the blob only
    # (3) stored as a checkpoint stores it (JSON), the parameters rebuild the same detector and key
    stored = BagParams.from_any(json.loads(json.dumps(params)))
    rebuilt = stored.make_detector()
    assert type(rebuilt) is FixedPoints and rebuilt.config() == det.config()
    assert cache.key(a, stored) == cache.key(a, params)


def test_a_detector_without_config_is_a_one_line_config_error_naming_the_field_and_the_fix():
    for bad in (NoConfig(), type("Sub", (LoGBlobDetector,), {})(), object()):
        with pytest.raises(ConfigError) as e:
            detector_config(bad)
        text = str(e.value)
        assert e.value.field == "detector" and "\n" not in text
        assert "no config()" in text and "Fix: give it detect(image, lung_mask, spacing, affine)" in text


def test_a_config_that_does_not_rebuild_the_detector_or_a_class_that_does_not_import_is_refused():
    with pytest.raises(ConfigError, match="not rebuilt by its config") as e:
        detector_config(Forgetful(radius_mm=4.0))
    assert e.value.field == "detector"

    class Local(FixedPoints):  # defined in a function: no class path can import it
        def config(self):
            return {"points": self.points, "radius_mm": self.radius_mm}

    with pytest.raises(ConfigError, match="cannot import the detector"):
        detector_config(Local())
    with pytest.raises(ConfigError, match="cannot import the detector") as e:
        BagParams(detector={"_target_": "no_such_package.Detector"}).resolved()
    assert e.value.field == "bag_params.detector"
    with pytest.raises(ConfigError, match="bad detector settings"):
        detector_from_config({"_target_": f"{__name__}.FixedPoints", "colour": "red"})


def test_a_detector_that_returns_something_else_than_candidates_is_a_config_error(sources):  # noqa: F811
    a, *_ = sources
    with pytest.raises(ConfigError, match="not Candidates"):
        compute_bag(a, {"k": 2, "patch_size": 8, "detector": detector_config(NotCandidates())},
                    preprocess=fake_preprocess)
