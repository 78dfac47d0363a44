"""experiments/scanner_mix_pair.py: the mix's training rows and the single scanner's test rows, the same subjects."""
from __future__ import annotations

import pytest

from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import ensure_demo_cohort
from tests.experiments.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("scanner_mix_pair")


def test_the_mixed_datalist_trains_on_the_mix_and_tests_on_the_single_scanners_cts(script, tmp_path, monkeypatch):
    small = dict(shape=(48, 48, 32), progress=False)  # 120 x 120 x 80 mm at the demo's 2.5 mm
    monkeypatch.setattr(script, "ensure_demo_cohort", lambda root, **kw: ensure_demo_cohort(root, **small, **kw))
    single, mixed = script.paired_datalists(tmp_path, 8, "four_vendors")
    a, b = load_manifest(single), load_manifest(mixed)
    assert sorted((r["subject"], r["split"], r["label"]) for r in a) == sorted(
        (r["subject"], r["split"], r["label"]) for r in b)
    for r in b:
        pinned = r["acquisition"]["profile"] == "pinned"
        assert pinned == (r["split"] == "test")
    assert {r["image"] for r in a if r["split"] == "test"} == {r["image"] for r in b if r["split"] == "test"}
