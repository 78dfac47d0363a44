"""``bundles/fullres.json``: the full-resolution bag preset, merged after a CT bundle as an override file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from monai.bundle import ConfigParser

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["nlst_focal", "nlst_ce"])
def test_fullres_overrides_only_the_bag_grid_of_a_ct_bundle(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # the bundles' % macros are relative to the project root
    preset = json.loads((ROOT / "bundles" / "fullres.json").read_text())
    assert {k for k in preset if not k.startswith("_")} == {"spacing", "k", "patch_size", "+initialize"}
    assert "require_base('bundles/nlst_focal.json', 'bundles/fullres.json')" in preset["+initialize"][-1]
    files = ["bundles/nlst_focal.json"] + ([] if name == "nlst_focal" else [f"bundles/{name}.json"])
    base, merged = ConfigParser(), ConfigParser()
    base.read_config(files)
    merged.read_config([*files, "bundles/fullres.json"])
    for key, want in (("spacing", [1.0, 1.0, 1.0]), ("k", 16), ("patch_size", 32)):
        assert merged.get_parsed_content(f"cohort#{key}") == want  # what the bag builder gets
    assert merged.get_parsed_content("preprocessing#spacing") == [1.0, 1.0, 1.0]
    # everything else is the bundle's own: window, detector, training
    for key in ("hu_window", "epochs", "lr", "method", "detector"):
        base.get_parsed_content(key, instantiate=False)  # resolves the % macros of both
        assert merged.get(key) == base.get(key)
