"""``--amp false`` on the command line reaches the bundle as the text "false", which must turn AMP off.

Before the fix, the text was truthy: a run of ``bundles/cifar10lt_ce.json --amp false`` logged ``amp=false`` but
trained in bf16 (``train_precision=bfloat16``), and gave the bf16 run's numbers to the last digit.
"""
from __future__ import annotations

import pytest
import torch

from cifar_baselines.steps import TrainStep, autocast_for, training_precision
from lungcal.errors import ConfigError


@pytest.mark.parametrize("text", ["false", "False", "0", "off"])
def test_amp_false_as_text_means_float32(text):
    assert autocast_for("cpu", text, training=True)[1] == torch.float32
    assert training_precision("cpu", text) == "float32"
    assert TrainStep(amp=text).amp is False


def test_amp_true_as_text_is_the_same_as_true():
    assert autocast_for("cpu", "true", training=True)[1] == autocast_for("cpu", True, training=True)[1]
    assert TrainStep(amp="true").amp is True


def test_amp_other_text_is_an_error():
    with pytest.raises(ConfigError, match="amp must be true or false"):
        autocast_for("cpu", "maybe", training=True)
