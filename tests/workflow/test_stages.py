"""The stage lines of a run (lungcal.workflow.stages): one when a stage starts, one when it ends or stops."""
from __future__ import annotations

import logging

import pytest

from lungcal.ctapp.train.stage1 import plan_text
from lungcal.workflow.stages import announce, format_seconds, stage


def test_seconds_read_as_a_person_says_them():
    assert [format_seconds(s) for s in (4.4, 59.6, 460, 3725)] == ["4 s", "1 min 00 s", "7 min 40 s", "1 h 02 min"]


def test_a_stage_logs_its_start_and_its_end_or_where_it_stopped(caplog):
    caplog.set_level(logging.INFO, logger="lungcal.stages")
    with stage("series checks", "3 CTs"):
        pass
    with pytest.raises(KeyError), stage("bags"):
        raise KeyError("x")
    announce("focal stage 1 on the demo")
    lines = [r.getMessage() for r in caplog.records if r.name == "lungcal.stages"]
    assert lines[0] == "[stage] series checks: 3 CTs ..." and lines[1].startswith("[stage] series checks done in ")
    assert lines[2] == "[stage] bags ..." and lines[3].startswith("[stage] bags stopped after ")
    assert lines[4] == "[plan] focal stage 1 on the demo"


def test_the_plan_names_the_cohort_the_epochs_and_the_post_hoc_calibration():
    text = plan_text("focal", None, 20, ["ts"])
    assert "built-in synthetic demo cohort (1000 CTs" in text and "20 epochs" in text and "then TS" in text
    assert "9 min the first time" in text
    text = plan_text("ce", "/data/site/upmc.json", 5, [])
    assert "the datalist upmc.json" in text and "no post-hoc calibration" in text and "min the first" not in text
    assert "/data/site" not in text  # the file name only
