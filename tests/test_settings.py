"""Switches are parsed once, where the settings enter (lungcal.runtime.settings; issue 44 item 2).

The parser itself (every accepted spelling, a bad value names its key), the bundles' single parse
(``run_settings``: ``--amp false``, ``--amp False`` and ``--amp 0`` are one run, with one resume identity;
``--amp maybe`` stops in one line), and that no module but the parsing home parses a switch.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cifar_baselines.bundle import load_bundle
from cifar_baselines.stages import Stage1Run
from lungcal.ctapp.infer.inference import InferenceRun
from lungcal.ctapp.train.las import LASRun
from lungcal.errors import ConfigError
from lungcal.runtime.exit_hook import find_lungcal_error
from lungcal.runtime.settings import (
    FALSE_SPELLINGS,
    SWITCHES,
    TRUE_SPELLINGS,
    Settings,
    parse_switch,
    switch,
    typed_arguments,
    typed_settings,
)

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "lungcal" / "runtime" / "settings.py"


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
    assert "channels_last must be true or false (or 1/0, yes/no, on/off)" in text
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
    with pytest.raises(ConfigError, match="amp must be true or false.*'maybe'"):
        typed_settings({"amp": "maybe"})


def test_typed_arguments_parses_the_bool_parameters_by_annotation():
    @typed_arguments
    def run(n: int, pictures: bool = True, label: str = "x") -> tuple:
        return n, pictures, label

    assert run(3, "false") == (3, False, "x")
    assert run(3, pictures="On", label="no") == (3, True, "no")
    assert run(3) == (3, True, "x")
    with pytest.raises(ConfigError, match="pictures must be true or false.*'maybe'"):
        run(3, pictures="maybe")


def test_the_runs_built_from_their_own_arguments_parse_their_switches(tmp_path):
    common = {"device": "cpu", "output_dir": str(tmp_path)}
    las = LASRun(balanced_sampling="false", resume="0", **common)
    assert las.las["balanced_sampling"] is False and las.resume is False
    assert LASRun(**common).choices == LASRun(balanced_sampling="TRUE", **common).choices
    assert InferenceRun(inputs="x.json", pictures="no", **common).pictures is False
    with pytest.raises(ConfigError, match="pictures must be true or false"):
        InferenceRun(inputs="x.json", pictures="maybe", **common)


def test_switch_is_an_argparse_type():
    parser = argparse.ArgumentParser(prog="lungcal")
    parser.add_argument("--pictures", type=switch, default=True)
    assert parser.parse_args(["--pictures", "false"]).pictures is False
    assert parser.parse_args(["--pictures", "1"]).pictures is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--pictures", "maybe"])


# ------------------------------------------------------------------ the bundles' single parse
def _parser(files, overrides):
    return load_bundle([ROOT / "bundles" / f for f in files], overrides)


def test_every_switch_the_bundles_name_is_a_known_switch():
    """A top-level key or a ``settings`` entry whose value is a JSON bool is a switch a user can override
    (``--amp false``): :data:`SWITCHES` must name it, or ``run_settings`` would hand on its text."""
    keys = set()
    for path in (ROOT / "bundles").glob("*.json"):
        cfg = json.loads(path.read_text())
        keys |= {k for k, v in cfg.items() if isinstance(v, bool)}
        keys |= {k for k, v in cfg.get("settings", {}).items() if isinstance(v, bool)}
    assert keys and keys <= SWITCHES, sorted(keys - SWITCHES)


@pytest.mark.parametrize("files, key", [(["cifar10lt_ce.json"], "amp"), (["cifar10lt_las.json"], "shift_bn"),
                                        (["nlst_focal.json"], "amp"), (["nlst_focal.json"], "tta_flips")])
def test_false_False_0_and_off_are_one_setting(files, key):
    runs = [_parser(files, {key: v}).get_parsed_content("run_settings") for v in ("false", False, 0, "off", "No")]
    assert all(r[key] is False for r in runs)
    assert all(r == runs[1] for r in runs)


def test_false_False_and_0_give_one_resume_identity():
    def identity(value):
        p = _parser(["cifar10lt_ce.json"], {"amp": value})
        settings = p.get_parsed_content("run_settings")
        return Stage1Run(p.get_parsed_content("network_def"), None, settings["dataset"], settings["method"],
                         settings=settings, loss=p.get_parsed_content("loss"), amp=settings["amp"]).identity()

    same = {identity(v) for v in ("false", False, 0, "0", "FALSE")}
    assert len(same) == 1
    assert identity(True) != identity("false")


def test_the_objects_get_the_parsed_switch():
    p = _parser(["cifar10lt_ce.json"], {"amp": "false", "resume": "no"})
    assert p.get_parsed_content("train#step").amp is False
    assert p.get_parsed_content("store").resume is False
    assert p.get_parsed_content("workflow#amp") is False
    p = _parser(["nlst_focal.json"], {"amp": "false", "freeze_encoder": "0"})
    assert p.get_parsed_content("train#trainer#amp") is False
    assert p.get_parsed_content("workflow#init#freeze_encoder") is False


def test_a_bad_switch_names_its_key():
    p = _parser(["cifar10lt_ce.json"], {"amp": "maybe"})
    with pytest.raises(Exception) as info:
        p.get_parsed_content("run_settings")
    err = find_lungcal_error(info.value)
    assert isinstance(err, ConfigError) and "amp must be true or false" in str(err) and "'maybe'" in str(err)


def test_amp_maybe_stops_in_one_line_under_monai_bundle_run(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/cifar10lt_ce.json",
                           "--amp", "maybe", "--output_dir", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1 and "amp must be true or false" in errors[0] and "'maybe'" in errors[0]
    assert not list(tmp_path.iterdir())  # stopped before anything was written


# ------------------------------------------------------------------ nobody else parses a switch
_PARSERS = {"as_bool", "parse_switch"}


def _calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in _PARSERS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
        elif isinstance(node, (ast.FunctionDef, ast.ImportFrom)):
            names = [node.name] if isinstance(node, ast.FunctionDef) else [a.name for a in node.names]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n in _PARSERS]
        elif isinstance(node, ast.Compare) and any(_spells_a_switch(c) for c in [node.left, *node.comparators]):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} a comparison with the text of a switch")
    return found


def _spells_a_switch(node: ast.expr) -> bool:
    """``"true"`` / ``"false"`` (any case), alone or in a tuple, list or set: a hand-made switch parser
    (``str(x).lower() in ("true", "1")``, ``value == "false"``)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return any(isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value.strip().lower() in ("true", "false")
               for i in items)


#: comparisons with "true"/"false" that read a data file, not a setting: where and why
_NOT_SETTINGS = {"lungcal/data/synthetic/insertion.py": "read_truth: the posterior column of the truth.csv that "
                                                         "write_lesion_bed wrote (a bool as text)"}


def test_no_module_outside_the_parsing_home_parses_a_switch():
    files = [p for pkg in ("lungcal", "cifar_baselines") for p in (ROOT / pkg).rglob("*.py") if p != HOME]
    offenders = [hit for p in files for hit in _calls(p)
                 if not (hit.split(":")[0] in _NOT_SETTINGS and hit.endswith("the text of a switch"))]
    assert not offenders, offenders
    assert _calls(HOME)  # the check sees calls: the home itself has them
