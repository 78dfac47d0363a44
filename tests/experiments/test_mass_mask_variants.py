"""experiments/mass_mask.py: the variant table counts each masker's lesions at least half inside the mask."""
from __future__ import annotations

from tests.experiments.conftest import load_script


def test_variant_table_counts_each_masker_per_kind_and_place():
    mass_mask = load_script("mass_mask")
    rows = [{"kind": "mass", "place": "pleura", "share_before": "0.1", "share_v": "0.6"},
            {"kind": "mass", "place": "pleura", "share_before": "0.7", "share_v": "0.4"},
            {"kind": "mass", "place": "mediastinum", "share_before": "0.2", "share_v": "0.9"}]
    table = mass_mask.variant_table(rows, ["before", "v"]).splitlines()
    assert table[0] == "| lesion | place | n | before | v |"
    assert table[2] == "| mass | mediastinum | 1 | 0% (0.20) | 100% (0.90) |"
    assert table[3] == "| mass | pleura | 2 | 50% (0.40) | 50% (0.50) |"
