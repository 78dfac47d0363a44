"""The MIL trainer step: mixup draws on the CPU whatever the device, AMP, float32 logits."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from lungcal.calibration.losses import FocalLoss
from lungcal.ctapp.model.steps import MILEvalStep, MILPrepareBatch, MILTrainStep
from lungcal.mil import LogSumExpMIL, SmallCNNEncoder


def _engine(amp: bool):
    torch.manual_seed(0)
    net = LogSumExpMIL(SmallCNNEncoder(embed_dim=8), attn_dim=8)
    return SimpleNamespace(network=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.01), amp=amp, scaler=None,
                           loss_function=FocalLoss(gamma=2.0), prepare_batch=MILPrepareBatch(),
                           state=SimpleNamespace(device=torch.device("cpu")), non_blocking=False)


def _batch():
    g = torch.Generator().manual_seed(1)
    return {"bag": torch.rand(4, 3, 1, 8, 8, 8, generator=g), "mask": torch.ones(4, 3, dtype=torch.bool),
            "label": torch.tensor([0, 1, 0, 1])}


def test_amp_on_cpu_trains_in_bf16_and_returns_float32_logits():
    for amp in (False, True):
        engine = _engine(amp)
        out = MILTrainStep(mixup_alpha=0.4, seed=3)(engine, _batch())
        assert out["pred"].dtype == torch.float32 and torch.isfinite(out["loss"])
        ev = MILEvalStep()(engine, _batch())
        assert ev["pred"].dtype == torch.float32  # evaluation never autocasts


def test_mixup_draws_do_not_depend_on_the_device_of_the_batch():
    """The step's generator is a CPU generator: the same seed gives the same mixing on any device."""
    a, b = MILTrainStep(mixup_alpha=0.4, seed=7), MILTrainStep(mixup_alpha=0.4, seed=7)
    assert a.generator.device.type == "cpu"
    assert torch.equal(torch.randperm(16, generator=a.generator), torch.randperm(16, generator=b.generator))


def test_eval_step_without_flips_runs_one_view_and_leaves_the_models_flips_on():
    engine = _engine(False)
    engine.network.tta_flips = True
    batch = _batch()
    flipped = MILEvalStep()(engine, batch)["pred"]
    one = MILEvalStep(flips=False)(engine, batch)["pred"]
    assert engine.network.tta_flips  # restored
    engine.network.tta_flips = False
    plain = MILEvalStep()(engine, batch)["pred"]
    torch.testing.assert_close(one, plain)
    assert not torch.allclose(one, flipped)  # the 8 flips average to another output
