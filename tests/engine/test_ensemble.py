"""EnsembleRun's pieces without training: members differ only in seed and run name; incompatible members are refused."""
from __future__ import annotations

import pytest

from lungcal.engine.train.ensemble import EnsembleRun, check_compatible
from lungcal.errors import ConfigError

NET = {"_target_": "lungcal.mil.LogSumExpMIL", "encoder": {"_target_": "lungcal.mil.SmallCNNEncoder", "embed_dim": 64}}
BAGS = {"spacing": [2.5, 2.5, 2.5], "k": 8, "patch_size": 16}


def test_members_differ_in_seed_and_run_name_only(tmp_path):
    cfg = {"seed": 7, "run_name": "x", "lr": 0.002, "member": {"_target_": "lungcal.engine.train.stage1.Stage1Run"}}
    run = EnsembleRun(members=3, seed=7, run_name="ens", output_dir=tmp_path, config=cfg)
    configs = [run.member_config(i) for i in range(3)]
    assert [c["seed"] for c in configs] == [7, 8, 9]
    assert [c["run_name"] for c in configs] == ["ens-m0", "ens-m1", "ens-m2"]
    for c in configs:
        assert {k: v for k, v in c.items() if k not in ("seed", "run_name")} == \
               {k: v for k, v in cfg.items() if k not in ("seed", "run_name")}
    assert run.params()["member_seeds"] == [7, 8, 9]


def test_members_of_another_architecture_or_preprocessing_are_refused():
    a = {"network_def": NET, "bag_params": BAGS}
    check_compatible([a, dict(a)])
    with pytest.raises(ConfigError, match="architecture"):
        check_compatible([a, {"network_def": {**NET, "attn_dim": 32}, "bag_params": BAGS}])
    with pytest.raises(ConfigError, match="preprocessing"):
        check_compatible([a, {"network_def": NET, "bag_params": {**BAGS, "patch_size": 8}}])


def test_bad_ensemble_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="ensemble_members"):
        EnsembleRun(members=1, output_dir=tmp_path, config={"member": {}})
    with pytest.raises(ConfigError, match="member"):
        EnsembleRun(members=2, output_dir=tmp_path, config={"seed": 0})
