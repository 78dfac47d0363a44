"""The bag-extraction step keeps the cache key of the name-based bundles and refuses what the cache cannot key."""
from __future__ import annotations

import pytest

from lungcal.candidates.cache import BagParams
from lungcal.candidates.detector import LoGBlobDetector
from lungcal.engine.cohort import CTCohort
from lungcal.errors import ConfigError, DataError

#: the ``bag_params`` of bundles/nlst_*.json before the pipeline moved into config
NAME_BASED = {"spacing": [2.5, 2.5, 2.5], "hu_window": [-1000, 400], "k": 8, "patch_size": 16}


def test_default_objects_give_the_cache_key_of_the_name_based_bundles(tmp_path):
    cohort = CTCohort(None, detector=LoGBlobDetector(), output_dir=tmp_path)
    assert BagParams.from_any(cohort.bag_params).resolved() == BagParams.from_any(NAME_BASED).resolved()
    tuned = CTCohort(None, detector=LoGBlobDetector(top_k=16), output_dir=tmp_path)
    assert BagParams.from_any(tuned.bag_params).resolved()["detector"]["top_k"] == 16


def test_a_detector_the_cache_cannot_key_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="LoGBlobDetector"):
        CTCohort(None, detector=object(), output_dir=tmp_path)


def test_missing_datalist_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="datalist not found"):
        CTCohort(str(tmp_path / "none.json"), output_dir=tmp_path).load()
