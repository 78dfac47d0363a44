"""Renamed modules keep their old paths (issue 44 item 4): ``lungcal.engine`` is now ``lungcal.ctapp`` and
``cifar_baselines.workflow`` is ``cifar_baselines.stages``.

Stored runs (checkpoints, ``config/resolved.json``, MLflow params, bundles copied elsewhere) name classes by the
old paths, so an old path must give the very same module and class; and nothing in the project may still use
the old names but the aliases themselves."""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import lungcal.engine.data.bagstream
import lungcal.engine.train.las
import pytest
import torch
from lungcal.engine.model.checkpoint import load_stage1 as old_load_stage1
from monai.bundle import ConfigParser

import cifar_baselines.stages
import cifar_baselines.workflow  # the old module path
import lungcal.ctapp
import lungcal.ctapp.data.bagstream
import lungcal.ctapp.train.las
import lungcal.engine  # the old package path
from cifar_baselines.stages import LASRun, Stage1Model, trainable_head
from cifar_baselines.workflow import Stage1Run as OldCifarStage1Run
from lungcal.ctapp.data.bagstream import seed_worker
from lungcal.ctapp.model import checkpoint
from lungcal.ctapp.model.steps import MILTrainStep
from lungcal.ctapp.train.stage1 import Stage1Run
from lungcal.mil import build_mil_model
from lungcal.runtime.bundle_config import spec_of

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the same module objects
def test_old_module_paths_are_the_same_module_objects():
    old, new = lungcal.engine.train.las, lungcal.ctapp.train.las
    assert old is new and lungcal.engine.data.bagstream is lungcal.ctapp.data.bagstream
    assert lungcal.engine is lungcal.ctapp  # the package itself: its attributes are ctapp's
    assert sys.modules["lungcal.engine.train.las"] is new
    assert importlib.import_module("lungcal.engine.site.site_check") is importlib.import_module(
        "lungcal.ctapp.site.site_check")
    # the module keeps its own name and spec (the import system would give it the alias's)
    assert new.__name__ == new.__spec__.name == "lungcal.ctapp.train.las"
    assert old.LASRun.__module__ == "lungcal.ctapp.train.las"
    assert old_load_stage1 is checkpoint.load_stage1


def test_an_old_path_imported_first_in_a_fresh_process_is_still_one_module():
    code = ("import sys; import lungcal.engine.model.schedule as old; import lungcal.ctapp.model.schedule as new; "
            "assert old is new, (old, new); "
            "assert sorted(m for m in sys.modules if m.endswith('model.schedule')) == "
            "['lungcal.ctapp.model.schedule', 'lungcal.engine.model.schedule'], sorted(sys.modules); "
            "assert new.__spec__.name == 'lungcal.ctapp.model.schedule'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_missing_old_module_is_a_plain_module_not_found():
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("lungcal.engine.no_such_room")
    assert info.value.name == "lungcal.engine.no_such_room"


def test_the_old_cifar_module_is_the_new_one():
    assert cifar_baselines.workflow is cifar_baselines.stages
    assert sys.modules["cifar_baselines.workflow"] is cifar_baselines.stages
    assert OldCifarStage1Run is cifar_baselines.stages.Stage1Run


# ----------------------------------------------------------------------------- a stored run's config still builds
def test_a_stored_config_with_old_target_paths_builds_the_new_classes(tmp_path):
    blob = tmp_path / "cifar10lt_ce_run.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "settings": {"epochs": 2}, "run_id": "abc"}, blob)
    # the shape of a stored config/resolved.json and bundle of before the rename: old _target_ and $ paths
    stored = json.loads(json.dumps({
        "imports": ["$import lungcal", "$import lungcal.engine.data.bagstream", "$import cifar_baselines.workflow",
                    "$import cifar_baselines"],
        "step": {"_target_": "lungcal.engine.model.steps.MILTrainStep", "mixup_alpha": 0.4, "seed": 3},
        "workflow": {"_target_": "lungcal.engine.train.stage1.Stage1Run", "_mode_": "callable"},
        "las": {"_target_": "cifar_baselines.workflow.LASRun", "_mode_": "callable"},
        "worker_init_fn": "$lungcal.engine.data.bagstream.seed_worker",
        "head": "$cifar_baselines.workflow.trainable_head",
        "stage1": {"_target_": "cifar_baselines.workflow.load_stage1", "checkpoint": str(blob)},
    }))
    parser = ConfigParser(stored)
    parser.get_parsed_content("imports")
    step = parser.get_parsed_content("step")
    assert type(step) is MILTrainStep and step.alpha == 0.4
    assert parser.get_parsed_content("workflow") is Stage1Run
    assert parser.get_parsed_content("las") is LASRun
    assert parser.get_parsed_content("worker_init_fn") is seed_worker
    assert parser.get_parsed_content("head") is trainable_head
    stage1 = parser.get_parsed_content("stage1")  # loading a stored CIFAR run through the old path
    assert isinstance(stage1, Stage1Model) and stage1.run_id == "abc" and stage1.settings == {"epochs": 2}


def test_a_stored_ct_checkpoint_loads_through_the_old_loader_path(tmp_path):
    net = build_mil_model(embed_dim=8, attn_dim=4, patch_size=8)
    path = tmp_path / "best.pt"
    torch.save({"state_dict": net.state_dict(), "network_def": spec_of(net), "bag_params": json.dumps({"k": 3})},
               path)
    parser = ConfigParser({"stage1": {"_target_": "lungcal.engine.model.checkpoint.load_stage1", "model": str(path),
                                      "tracking_uri": "sqlite:///unused.db"}})
    stage1 = parser.get_parsed_content("stage1")
    assert isinstance(stage1, checkpoint.Stage1Model) and type(stage1.network) is type(net)
    assert stage1.bag_params == {"k": 3}
    for a, b in zip(stage1.network.state_dict().values(), net.state_dict().values()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- nothing else uses the old names
OLD = re.compile(r"lungcal[./]engine\b|cifar_baselines[./]workflow\b")
#: the aliases and this test name the old paths on purpose
ALIASES = {"lungcal/engine/__init__.py", "cifar_baselines/workflow.py", "tests/test_renamed_paths.py"}


def _files():
    for folder in ("lungcal", "cifar_baselines", "bundles", "scripts", "experiments", "tests"):
        for p in sorted((ROOT / folder).rglob("*")):
            if p.suffix in (".py", ".json", ".toml") and "__pycache__" not in p.parts:
                yield p


def test_pyproject_names_the_old_package_only_to_fence_the_alias():
    """pyproject.toml names ``lungcal.engine`` only in the import-linter contracts (forbidden beside
    ``lungcal.ctapp``, and the alias's own contract), and the layer contracts are ctapp's."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    start, end = text.index("\n[tool.importlinter]\n"), text.index("\n[tool.mypy]\n")
    assert not OLD.search(text[:start] + text[end:])
    linter = text[start:end]
    assert 'containers = ["lungcal.ctapp"]' in linter and '    "ctapp",\n' in linter
    for contract in linter.split("[[tool.importlinter.contracts]]")[1:]:
        if "lungcal.engine" in contract and 'source_modules = ["lungcal.engine"]' not in contract:
            assert "lungcal.ctapp" in contract.split("forbidden_modules")[1]  # fenced together
            assert "lungcal.engine" not in contract.split("forbidden_modules")[0]


def test_no_module_imports_or_names_the_old_paths():
    offenders = []
    for p in _files():
        rel = p.relative_to(ROOT).as_posix()
        if rel in ALIASES:
            continue
        text = p.read_text(encoding="utf-8")
        offenders += [f"{rel}:{i}" for i, line in enumerate(text.split("\n"), 1) if OLD.search(line)]
    assert not offenders, offenders


def test_the_check_sees_an_old_import():
    assert OLD.search("from lungcal.engine.train.las import LASRun")
    assert OLD.search('"_target_": "cifar_baselines.workflow.Stage1Run"')
    assert not OLD.search("lungcal.ctapp.train.las, cifar_baselines.stages, the workflow section")
