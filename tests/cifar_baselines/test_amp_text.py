"""``--amp false`` on the command line reaches the bundle as the text "false", which must turn AMP off.

Before the fix, the text was truthy: a run of ``bundles/cifar10lt_ce.json --amp false`` logged ``amp=false`` but
trained in bf16 (``train_precision=bfloat16``), and gave the bf16 run's numbers to the last digit. The text is
now parsed once, by the bundle's ``run_settings`` (``lungcal.runtime.settings``, issue 44 item 2), and the step
and the workflow get a bool.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cifar_baselines.bundle import load_bundle
from cifar_baselines.steps import autocast_for, training_precision
from lungcal.errors import ConfigError
from lungcal.runtime.exit_hook import find_lungcal_error

BASE = Path(__file__).resolve().parents[2] / "bundles" / "cifar10lt_ce.json"


def _step_and_workflow_amp(value):
    p = load_bundle(BASE, {"amp": value})
    return p.get_parsed_content("train#step").amp, p.get_parsed_content("workflow#amp")


@pytest.mark.parametrize("text", ["false", "False", "0", "off", 0, False])
def test_amp_false_as_text_means_float32(text):
    step_amp, workflow_amp = _step_and_workflow_amp(text)
    assert step_amp is False and workflow_amp is False
    assert autocast_for("cpu", step_amp, training=True)[1] == torch.float32
    assert training_precision("cpu", workflow_amp) == "float32"


def test_amp_true_as_text_is_the_same_as_true():
    assert _step_and_workflow_amp("true") == _step_and_workflow_amp(True) == (True, True)


def test_amp_other_text_is_an_error():
    with pytest.raises(Exception) as info:
        _step_and_workflow_amp("maybe")
    err = find_lungcal_error(info.value)
    assert isinstance(err, ConfigError) and "amp must be true or false" in str(err)
