"""Switches are parsed once, where the settings enter (lungcal.runtime.settings; issue 44 item 2).

The parser itself: every accepted spelling, a bad value names its key.
"""
from __future__ import annotations

import argparse

import pytest

from lungcal.errors import ConfigError
from lungcal.runtime.settings import (
    FALSE_SPELLINGS,
    TRUE_SPELLINGS,
    Settings,
    parse_switch,
    switch,
    typed_arguments,
    typed_settings,
)


@pytest.mark.parametrize("text", [*TRUE_SPELLINGS, "TRUE", "True", " yes ", "On"])
def test_every_true_spelling(text):
    assert parse_switch(text, "amp") is True


@pytest.mark.parametrize("text", [*FALSE_SPELLINGS, "FALSE", "False", " no ", "Off", "None"])
def test_every_false_spelling(text):
    assert parse_switch(text, "amp") is False


@pytest.mark.parametrize("value, want", [(True, True), (False, False), (1, True), (0, False), (1.0, True),
                                         (0.0, False), (None, False)])
def test_json_and_python_values(value, want):
    assert parse_switch(value, "amp") is want


@pytest.mark.parametrize("value", ["maybe", "2", "tru", 2, -1, 0.5, [], {}, "nein"])
def test_a_bad_value_names_the_key_and_the_accepted_values_in_one_line(value):
    with pytest.raises(ConfigError) as info:
        parse_switch(value, "channels_last")
    text = str(info.value)
    assert "\n" not in text
    assert "channels_last is a switch" in text and "true/false, 1/0, yes/no or on/off" in text
    assert repr(value) in text and info.value.field == "channels_last"


def test_typed_settings_parses_the_switches_only():
    raw = {"amp": "false", "resume": 1, "augment": "YES", "mc_samples": 0, "mixup_space": "no",
           "test_pictures": "gallery", "spacing": (2.5, 2.5, 2.5), "focal_alpha": None}
    typed = typed_settings(raw)
    assert isinstance(typed, Settings)
    assert typed == {"amp": False, "resume": True, "augment": True, "mc_samples": 0, "mixup_space": "no",
                     "test_pictures": "gallery", "spacing": [2.5, 2.5, 2.5], "focal_alpha": None}
    assert typed["mc_samples"] == 0 and not isinstance(typed["mc_samples"], bool)  # a count stays a count
    assert typed_settings(typed) is typed  # parsed once: typed settings pass through as they are
    with pytest.raises(ConfigError, match="amp is a switch.*'maybe'"):
        typed_settings({"amp": "maybe"})


def test_typed_arguments_parses_the_bool_parameters_by_annotation():
    @typed_arguments
    def run(n: int, pictures: bool = True, label: str = "x") -> tuple:
        return n, pictures, label

    assert run(3, "false") == (3, False, "x")
    assert run(3, pictures="On", label="no") == (3, True, "no")
    assert run(3) == (3, True, "x")
    with pytest.raises(ConfigError, match="pictures is a switch.*'maybe'"):
        run(3, pictures="maybe")


def test_switch_is_an_argparse_type():
    parser = argparse.ArgumentParser(prog="lungcal")
    parser.add_argument("--pictures", type=switch, default=True)
    assert parser.parse_args(["--pictures", "false"]).pictures is False
    assert parser.parse_args(["--pictures", "1"]).pictures is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--pictures", "maybe"])
