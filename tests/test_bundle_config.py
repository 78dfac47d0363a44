"""What a run records of its bundle: hyperparameters, self-contained sections, and settings nothing uses."""
from __future__ import annotations

from pathlib import Path

import torch
from monai.bundle import ConfigParser

from lungcal.runtime.bundle_config import active_config, build_section, hyperparameters, unused_keys

ROOT = Path(__file__).resolve().parents[1]


def test_build_section_and_hyperparameters():
    net = build_section({"_target_": "lungcal.mil.SmallCNNEncoder", "embed_dim": 5})
    assert net(torch.rand(2, 1, 8, 8, 8)).shape == (2, 5)
    cfg = {"epochs": 3, "lr": 0.1, "spacing": [2.5, 2.5, 2.5], "imports": ["$import torch"], "loss": {"_target_": "x"},
           "network": "$@network_def.to('cpu')", "train": {"dataset": "$@cohort.dataset('train')"}, "_meta_": {}}
    assert hyperparameters(cfg) == {"epochs": 3, "lr": 0.1, "spacing": [2.5, 2.5, 2.5]}


def test_every_setting_of_the_stage1_bundles_is_used_and_a_stale_one_is_found(monkeypatch):
    monkeypatch.chdir(ROOT)
    for name in ("nlst_ce", "nlst_focal", "nlst_mixup", "nlst_focal_mixup"):
        parser = ConfigParser()
        parser.read_config(f"bundles/{name}.json")
        parser.resolve_macro_and_relative_ids()
        assert unused_keys(parser.get()) == [], name
        parser["head"] = "attention"  # a key of the former name-based bundles
        parser["lr_warmup"] = 3
        assert unused_keys(parser.get()) == ["head", "lr_warmup"]


def test_active_config_is_empty_outside_a_bundle_and_the_parser_config_inside():
    assert active_config() == {}
    parser = ConfigParser({"epochs": 2, "seen": {"_target_": "lungcal.runtime.bundle_config.active_config"}})
    assert parser.get_parsed_content("seen")["epochs"] == 2
