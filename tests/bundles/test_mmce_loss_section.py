"""The MMCE loss is reachable from a CT bundle by swapping its ``loss`` section (docs/architecture.md snippet)."""
from __future__ import annotations

from pathlib import Path

import torch
from monai.bundle import ConfigParser

from lungcal.calibration.losses import FocalLoss, MMCELoss, mmce_squared

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = {"_target_": "lungcal.calibration.losses.MMCELoss",
           "base": {"_target_": "lungcal.calibration.losses.FocalLoss", "gamma": "@focal_gamma",
                    "alpha": "@focal_alpha"},
           "lam": 2.0}


def test_swapped_loss_section_builds_mmce_over_the_bundle_loss(monkeypatch):
    monkeypatch.chdir(ROOT)  # the bundles' % macros resolve from the project root
    parser = ConfigParser()
    parser.read_config("bundles/nlst_focal.json")
    parser["loss"] = SNIPPET
    loss = parser.get_parsed_content("loss")
    assert isinstance(loss, MMCELoss) and isinstance(loss.base, FocalLoss) and loss.base.gamma == 2.0
    z = torch.tensor([[0.0, 2.0], [0.0, -1.0], [0.0, 0.5], [0.0, 3.0]])
    y = torch.tensor([1, 0, 0, 0])
    expected = FocalLoss(2.0)(z, y) + 2.0 * torch.sqrt(mmce_squared(z, y, weighted=True) + 1e-10)
    torch.testing.assert_close(loss(z, y), expected)
