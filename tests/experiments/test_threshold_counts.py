"""experiments/threshold_counts.py: the misses MAPIE's floating-point count certified, against the exact tail."""
from __future__ import annotations

import pytest

from lungcal.calibration.guarantee import misses_allowed
from tests.experiments.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("threshold_counts")


def test_mapie_counted_one_miss_of_forty_as_two_and_the_exact_tail_does_not(script):
    # 38 cancers: 1 - 37/38 times 38 rounds to exactly 1, so MAPIE certifies the miss; 39-43 it does not
    assert [script.mapie_misses(n, 0.1, 0.1) for n in (37, 38, 39, 40, 43, 44)] == [0, 1, 0, 0, 0, 1]
    assert [misses_allowed(n, 0.1, 0.1) for n in (37, 38, 39, 40, 43, 44)] == [0, 1, 1, 1, 1, 1]
    assert script.mapie_misses(21, 0.1, 0.1) == -1  # too few for any threshold, either way


def test_the_count_table_names_the_counts_that_gained_a_miss(script):
    (row, *_) = script.count_table(36, 46)
    assert (row["alpha"], row["delta"]) == (0.1, 0.1) and row["counts"] == 11
    assert row["gained"] == [39, 40, 41, 42, 43, 45] == row["zero_instead_of_one"] and row["lost"] == []
    assert script._ranges(row["gained"]) == "39-43, 45"
