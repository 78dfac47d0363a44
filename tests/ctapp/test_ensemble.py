"""EnsembleRun's pieces without training: members differ only in seed and run name; incompatible members are refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from lungcal.ctapp.train.ensemble import EnsembleRun, check_compatible
from lungcal.errors import ConfigError
from lungcal.workflow import Evaluation, Store

ROOT = Path(__file__).resolve().parents[2]
NET = {"_target_": "lungcal.mil.LogSumExpMIL", "encoder": {"_target_": "lungcal.mil.SmallCNNEncoder", "embed_dim": 64}}
BAGS = {"spacing": [2.5, 2.5, 2.5], "k": 8, "patch_size": 16}


def test_members_differ_in_seed_and_run_name_only(tmp_path, monkeypatch):
    """Member i is the member bundle with the ensemble's settings, seed + i and its own run name."""
    monkeypatch.chdir(ROOT)
    settings = {"seed": 7, "run_name": "x", "lr": 0.002, "epochs": 3, "output_dir": str(tmp_path)}
    run = EnsembleRun(members=3, settings=settings, store=Store(output_dir=tmp_path, run_name="ens"),
                      evaluation=Evaluation(seed=7))
    parsers = [run.member_parser(i) for i in range(3)]
    assert [p["seed"] for p in parsers] == [7, 8, 9]
    assert [p["run_name"] for p in parsers] == ["ens-m0", "ens-m1", "ens-m2"]
    for p in parsers:
        assert p["lr"] == 0.002 and p["epochs"] == 3 and p["workflow"]["_target_"].endswith("Stage1Run")
        assert {k: p.get(k) for k in ("network_def", "loss", "train")} == \
               {k: parsers[0].get(k) for k in ("network_def", "loss", "train")}
    assert run.params()["member_seeds"] == [7, 8, 9] and "output_dir" not in run.params()


def test_members_of_another_architecture_or_preprocessing_are_refused():
    a = {"network_def": NET, "bag_params": BAGS}
    check_compatible([a, dict(a)])
    with pytest.raises(ConfigError, match="architecture"):
        check_compatible([a, {"network_def": {**NET, "attn_dim": 32}, "bag_params": BAGS}])
    with pytest.raises(ConfigError, match="preprocessing"):
        check_compatible([a, {"network_def": NET, "bag_params": {**BAGS, "patch_size": 8}}])


def test_bad_ensemble_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="ensemble_members"):
        EnsembleRun(members=1, store=Store(output_dir=tmp_path))
    with pytest.raises(ConfigError, match="member's bundle file is missing"):
        EnsembleRun(members=2, store=Store(output_dir=tmp_path), member_files=[str(tmp_path / "none.json")])
