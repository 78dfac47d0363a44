"""``--balanced_sampling false`` on the command line reaches :class:`LASRun` as the text "false", which must mean False.

Before the fix, ``bool("false")`` was True: the CT LAS control of 2026-12-04 (``experiments/las_sampling.py``) ran
its "smoothing alone" arm with the balanced batches still on.
"""
from __future__ import annotations

import pytest

from lungcal.ctapp.train.las import LASRun
from lungcal.errors import ConfigError


@pytest.mark.parametrize(("value", "want"), [("false", False), ("False", False), (False, False), ("true", True),
                                             (True, True)])
def test_balanced_sampling_text_is_read_as_a_switch(value, want):
    assert LASRun(balanced_sampling=value).las["balanced_sampling"] is want


def test_balanced_sampling_other_text_is_an_error():
    with pytest.raises(ConfigError, match="balanced_sampling must be true or false"):
        LASRun(balanced_sampling="sometimes")
