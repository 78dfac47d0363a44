"""How a run gets its bundle's config: by reference (settings), and components that describe themselves."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser
from monai.data import DataLoader
from torch import nn

from lungcal.calibration.losses import FocalLoss
from lungcal.errors import ConfigError
from lungcal.mil import AttentionMIL, LogSumExpMIL, NoisyORMIL, ResNetEncoder, SmallCNNEncoder
from lungcal.runtime import bundle_config
from lungcal.runtime.bundle_config import Described, build, build_section, plain_settings, spec_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("make", [
    lambda: LogSumExpMIL(SmallCNNEncoder(embed_dim=8), attn_dim=4, dropout=0.1, tta_flips=True),
    lambda: AttentionMIL(SmallCNNEncoder(embed_dim=8, width=4), num_classes=3),
    lambda: NoisyORMIL(ResNetEncoder(embed_dim=8), leak_init=0.05),
])
def test_a_described_network_is_rebuilt_from_its_spec(make):
    torch.manual_seed(0)
    net = make().eval()
    spec = spec_of(net)
    assert json.loads(json.dumps(spec)) == spec  # plain JSON: it goes into checkpoints and MLflow params
    again = build_section(spec).eval()
    again.load_state_dict(net.state_dict())
    bags, mask = torch.rand(2, 3, 1, 8, 8, 8), torch.tensor([[True, True, False], [True, False, False]])
    with torch.no_grad():
        assert torch.equal(again(bags, mask)[0], net(bags, mask)[0])


def test_recording_how_a_network_was_built_leaves_the_random_state_alone():
    """Described only records arguments: the weights and the RNG stream match the unwrapped constructor's."""
    torch.manual_seed(1)
    recorded = SmallCNNEncoder(embed_dim=8)
    next_draw = torch.rand(1)
    torch.manual_seed(1)
    bare = SmallCNNEncoder.__new__(SmallCNNEncoder)
    SmallCNNEncoder.__init__.__wrapped__(bare, embed_dim=8)  # the class's own __init__, without the recording
    assert torch.equal(torch.rand(1), next_draw)
    assert all(torch.equal(x, y) for x, y in zip(recorded.state_dict().values(), bare.state_dict().values()))
    assert "_described_args" in recorded.__dict__ and "_described_args" not in bare.__dict__


def test_a_subclass_records_its_own_arguments_and_a_foreign_object_must_be_built_to_describe_itself():
    class Wide(SmallCNNEncoder):
        def __init__(self, embed_dim: int = 4, scale: int = 2) -> None:
            super().__init__(embed_dim=embed_dim, width=4 * scale)

    assert spec_of(Wide(scale=3))["scale"] == 3 and "width" not in spec_of(Wide())
    with pytest.raises(ConfigError, match="cannot say how it was built") as info:
        spec_of(LogSumExpMIL(nn.Sequential(nn.Flatten(), nn.Linear(512, 4)), embed_dim=4))
    assert info.value.field == "lungcal.mil.models.LogSumExpMIL"
    made = build("torch.nn.Linear", in_features=3, out_features=2)
    assert spec_of(made) == {"_target_": "lungcal.runtime.bundle_config.build", "target": "torch.nn.Linear",
                             "in_features": 3, "out_features": 2}
    assert build_section(spec_of(made)).weight.shape == (2, 3)
    assert spec_of(torch.optim.SGD(made.parameters(), lr=0.1), strict=False)["lr"] == 0.1


def test_settings_hold_values_only():
    assert plain_settings({"spacing": (2.5, 2.5, 2.5), "k": 8}) == {"spacing": [2.5, 2.5, 2.5], "k": 8}
    with pytest.raises(ConfigError, match="settings#net is a Linear"):
        plain_settings({"net": nn.Linear(2, 2)})


def test_no_object_looks_for_the_bundle_that_built_it():
    """The call-stack walk that found MONAI's parser is gone: nothing may come back to it."""
    assert not hasattr(bundle_config, "active_parser") and not hasattr(bundle_config, "active_config")
    for path in list((ROOT / "lungcal").rglob("*.py")) + list((ROOT / "cifar_baselines").rglob("*.py")):
        text = path.read_text()
        assert "inspect.currentframe" not in text and "f_back" not in text, path
    assert issubclass(SmallCNNEncoder, Described)


def test_the_headline_bundle_parses_with_a_nested_override():
    parser = ConfigParser()
    parser.read_config(str(ROOT / "bundles" / "nlst_focal.json"))
    parser.update({"network_def#encoder#embed_dim": 32})  # under a macro section this raised ValueError
    parser["output_dir"] = None
    assert parser.get_parsed_content("network_def").encoder.embed_dim == 32


def test_an_object_without_a_config_records_the_plain_arguments_it_keeps():
    assert spec_of(FocalLoss(gamma=3.5, alpha=[0.2, 0.8]), strict=False) == {
        "_target_": "lungcal.calibration.losses.FocalLoss", "gamma": 3.5, "alpha": [0.2, 0.8], "reduction": "mean"}
    ce = spec_of(nn.CrossEntropyLoss(label_smoothing=0.1), strict=False)
    assert ce["label_smoothing"] == 0.1 and ce["reduction"] == "mean" and ce["weight"] is None
    # a data loader: what shapes the batches, not the data, nor how fast it is served
    data = [torch.zeros(2)] * 10
    loader = spec_of(torch.utils.data.DataLoader(data, batch_size=3, drop_last=True, pin_memory=True), strict=False)
    assert loader["batch_size"] == 3 and loader["drop_last"] is True
    assert not {"dataset", "pin_memory", "sampler", "collate_fn"} & set(loader)
    # a subclass that passes **kwargs on records its base's arguments too (monai.data.DataLoader)
    assert spec_of(DataLoader(data, batch_size=4), strict=False)["batch_size"] == 4
    # an optimizer keeps its defaults, as before
    opt = spec_of(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9), strict=False)
    assert opt["lr"] == 0.1 and opt["momentum"] == 0.9 and "params" not in opt
