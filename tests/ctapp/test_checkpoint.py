"""Stage-1 checkpoints: the network's own description (network_def) is rebuilt by MONAI's parser; old
model_config checkpoints still load."""
from __future__ import annotations

import json

import pytest
import torch
from monai.bundle import ConfigParser

from lungcal.ctapp.model.checkpoint import bag_params_of, build_network, load_checkpoint, load_stage1, network_config
from lungcal.ctapp.model.handlers import AtomicCheckpoint, atomic_torch_save
from lungcal.errors import ConfigError
from lungcal.mil import LogSumExpMIL, build_mil_model
from lungcal.runtime.bundle_config import spec_of

NETWORK_DEF = {"_target_": "lungcal.mil.LogSumExpMIL",
               "encoder": {"_target_": "lungcal.runtime.bundle_config.build", "target": "monai.networks.nets.resnet10",
                           "spatial_dims": 3, "n_input_channels": 1, "num_classes": "@embed_dim"},
               "embed_dim": "@embed_dim", "attn_dim": 8, "tta_flips": True}


def _inputs():
    torch.manual_seed(3)
    return torch.rand(2, 3, 1, 8, 8, 8), torch.tensor([[True, True, False], [True, False, False]])


def test_the_network_describes_itself_and_its_spec_rebuilds_it_without_the_bundle(tmp_path):
    parser = ConfigParser({"embed_dim": 12, "network_def": NETWORK_DEF})
    net = parser.get_parsed_content("network_def").eval()
    spec = spec_of(net)  # what the bundle built it with, references resolved: a foreign encoder through build
    assert spec["_target_"] == "lungcal.mil.models.LogSumExpMIL" and spec["embed_dim"] == 12
    assert spec["encoder"]["target"] == "monai.networks.nets.resnet10" and spec["encoder"]["num_classes"] == 12
    assert json.loads(json.dumps(spec)) == spec
    path = tmp_path / "best.pt"
    torch.save({"state_dict": net.state_dict(), "network_def": spec, "bag_params": json.dumps({"k": 3})}, path)
    ck = load_checkpoint(path)
    assert network_config(ck) == {"network_def": spec} and bag_params_of(ck) == {"k": 3}
    stage1 = load_stage1(str(path), "sqlite:///unused.db")
    assert isinstance(stage1.network, LogSumExpMIL) and stage1.run is None and not stage1.network.training
    bags, mask = _inputs()
    with torch.no_grad():
        assert torch.equal(stage1.network(bags, mask)[0], net(bags, mask)[0])


def test_old_model_config_checkpoints_still_load(tmp_path):
    cfg = {"encoder": "small", "head": "attention", "embed_dim": 16, "attn_dim": 8, "patch_size": 8, "num_classes": 2}
    net = build_mil_model(**cfg).eval()
    path = tmp_path / "old.pt"
    torch.save({"state_dict": net.state_dict(), "model_config": cfg, "bag_params": json.dumps({"k": 3}),
                "method": "focal"}, path)
    stage1 = load_stage1(None, "sqlite:///unused.db", checkpoint=path)
    assert stage1.stage1_name("lungcal.stage1") == "focal"
    bags, mask = _inputs()
    with torch.no_grad():
        assert torch.equal(stage1.network(bags, mask)[0], net(bags, mask)[0])
    assert type(build_network({"model_config": cfg})) is type(net)


def test_not_a_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save({"weights": 1}, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="not a lungcal stage-1 checkpoint"):
        load_checkpoint(tmp_path / "x.pt")


def test_binding_the_checkpoint_folder_sweeps_a_killed_write(tmp_path):
    """A process killed while writing best.pt / last.pt leaves its temporary file; the run's next process
    removes it when it binds the folder, and nothing else there."""
    atomic_torch_save({"epoch": 3}, tmp_path / "last.pt")
    stale = [tmp_path / ".last.pt.k1ll3d.tmp", tmp_path / ".best.pt.x9.tmp"]
    kept = [tmp_path / ".other.json.ab.tmp", tmp_path / "last.pt", tmp_path / "notes.txt"]
    for p in stale + kept[:1] + kept[2:]:
        p.write_bytes(b"half")
    AtomicCheckpoint(torch.nn.Linear(2, 2), evaluator=None).bind(tmp_path)
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)
    assert torch.load(tmp_path / "last.pt", weights_only=True) == {"epoch": 3}
    AtomicCheckpoint(torch.nn.Linear(2, 2), evaluator=None).bind(tmp_path / "not_yet")  # a new run's folder
