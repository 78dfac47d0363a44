"""A recipe run without its base, and a mistyped override, stop in one line before any work starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from monai.bundle import ConfigParser

from lungcal.errors import ConfigError
from lungcal.runtime import bundle_checks
from lungcal.runtime.bundle_checks import check_command_line, check_overrides, override_names, require_base

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = ROOT / "bundles"
MAIN = str(Path("/x/site-packages/monai/bundle/__main__.py"))
#: the complete CIFAR bundles, and each CIFAR recipe that states only what differs, with its base
CIFAR_BASES = ("cifar10lt_ce", "cifar10lt_las")
CIFAR_RECIPES = {**{f"{d}_{m}": "cifar10lt_ce" for d in ("cifar10", "cifar10lt")
                    for m in ("ce", "focal", "mixup", "focal_mixup") if (d, m) != ("cifar10lt", "ce")},
                 "cifar10_las": "cifar10lt_las"}


def test_override_names_reads_fire_style_arguments():
    files, names = override_names(["--config_file", "['bundles/a.json','bundles/b.json']", "--epochs", "2",
                                   "--network_def#encoder#embed_dim=8", "--resume", "--lr", "-1e-3"])
    assert files == ["bundles/a.json", "bundles/b.json"]
    assert names == ["epochs", "network_def#encoder#embed_dim", "resume", "lr"]
    assert override_names(["--config_file", "bundles/a.json,bundles/b.json"])[0] == ["bundles/a.json", "bundles/b.json"]


def test_a_mistyped_key_is_named_with_the_nearest_one():
    base = BUNDLES / "nlst_focal.json"
    check_overrides([base], ["epochs", "train#dataloader#batch_size", "logging_file", "meta_file", "+initialize"])
    with pytest.raises(ConfigError) as info:
        check_overrides([base], ["epoch"])
    msg = str(info.value)
    assert "field 'epoch'" in msg and "--epoch names no key" in msg and "did you mean --epochs?" in msg
    with pytest.raises(ConfigError, match="no key"):  # a nested override of a mistyped section too
        check_overrides([base], ["trian#dataloader#batch_size"])
    # a key only the recipe defines is known once the recipe is on the command line
    recipe = BUNDLES / "nlst_mixup.json"
    check_overrides([base, recipe], ["mixup_alpha"])


def test_the_command_line_is_checked_only_under_monai_bundle_run():
    bad = ["--config_file", str(BUNDLES / "nlst_focal.json"), "--epoch", "2"]
    check_command_line(["pytest", "run", *bad])  # not monai.bundle: nothing to check
    check_command_line([MAIN, "verify_metadata", *bad])
    with pytest.raises(ConfigError, match="epoch"):
        check_command_line([MAIN, "run", *bad])


def test_require_base_passes_after_a_base_and_stops_alone(monkeypatch):
    monkeypatch.setattr(bundle_checks, "_loaded", False)
    with pytest.raises(ConfigError) as info:
        require_base("bundles/nlst_focal.json", "bundles/nlst_ce.json")
    bundle_checks.base_loaded()
    require_base("bundles/nlst_focal.json", "bundles/nlst_ce.json")  # over its base: nothing,
    require_base("bundles/nlst_focal.json", "bundles/fullres.json")  # for every file merged over it
    assert "python -m monai.bundle run --config_file \"['bundles/nlst_focal.json','bundles/nlst_ce.json']\"" \
        in str(info.value)


def test_every_recipe_checks_for_its_base_and_every_complete_bundle_marks_itself():
    recipes = ["nlst_ce", "nlst_mixup", "nlst_focal_mixup", "nlst_ensemble", "nlst_scanner_mix", "nlst_subsolid",
               "fullres"]
    for name in recipes:
        cfg = json.loads((BUNDLES / f"{name}.json").read_text())
        assert "run" not in cfg and "initialize" not in cfg, name
        steps = cfg["+initialize"]
        assert any(f"require_base('bundles/nlst_focal.json', 'bundles/{name}.json')" in s for s in steps), name
    for name in ["nlst_focal", "nlst_las", "inference", "multi_gpu", *CIFAR_BASES]:
        steps = json.loads((BUNDLES / f"{name}.json").read_text())["initialize"]
        assert any("bundle_checks.base_loaded()" in s for s in steps), name
        assert any("bundle_checks.check_command_line()" in s for s in steps), name
    assert not (BUNDLES / "cifar_common.json").exists()


def test_every_cifar_recipe_checks_for_its_base():
    """Issue 44 item 3: the CIFAR recipes are override files over a complete base, as the CT ones are."""
    for name, base in CIFAR_RECIPES.items():
        cfg = json.loads((BUNDLES / f"{name}.json").read_text())
        assert "run" not in cfg and "initialize" not in cfg, name
        assert any(f"require_base('bundles/{base}.json', 'bundles/{name}.json')" in s for s in cfg["+initialize"]), name


def _monai_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "monai.bundle", "run", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def test_a_recipe_alone_and_a_typo_end_in_one_line_under_monai_bundle_run(tmp_path):
    proc = _monai_run("--config_file", "bundles/nlst_ce.json")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1 and "['bundles/nlst_focal.json','bundles/nlst_ce.json']" in errors[0]

    proc = _monai_run("--config_file", "bundles/nlst_focal.json", "--epoch", "2", "--output_dir", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1 and "did you mean --epochs?" in errors[0]
    assert not list(tmp_path.iterdir())  # stopped before anything was written


@pytest.mark.parametrize("files", [["nlst_focal", "nlst_ce", "fullres"], ["nlst_focal", "nlst_mixup"],
                                   ["nlst_focal", "fullres"], ["nlst_focal", "nlst_ensemble"],
                                   ["cifar10lt_ce", "cifar10_focal_mixup"], ["cifar10lt_las", "cifar10_las"]])
def test_the_checks_pass_over_the_base_in_the_order_initialize_runs_them(files, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(bundle_checks, "_loaded", False)
    parser = ConfigParser()
    parser.read_config([f"bundles/{f}.json" for f in files])
    steps = [i for i, s in enumerate(parser["initialize"]) if "bundle_checks" in s]
    checks = [parser["initialize"][i] for i in steps if "require_base" in parser["initialize"][i]]
    assert len(checks) == len(files) - 1  # each file over the base appends its check
    for i in steps:
        parser.get_parsed_content(f"initialize#{i}")


@pytest.mark.parametrize("recipe", ["cifar10_focal", "cifar10_las"])
def test_a_cifar_recipe_alone_and_a_typo_end_in_one_line_under_monai_bundle_run(recipe, tmp_path):
    """Issue 44 item 3: the CIFAR family is checked as the CT family is."""
    base = CIFAR_RECIPES[recipe]
    proc = _monai_run("--config_file", f"bundles/{recipe}.json")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1
    assert f"python -m monai.bundle run --config_file \"['bundles/{base}.json','bundles/{recipe}.json']\"" in errors[0]

    files = f"['bundles/{base}.json','bundles/{recipe}.json']"
    proc = _monai_run("--config_file", files, "--epoch", "2", "--output_dir", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1 and "did you mean --epochs?" in errors[0]
    assert not list(tmp_path.iterdir())  # stopped before anything was written


def test_a_mistyped_cifar_key_is_named_and_nested_ids_pass():
    files = [BUNDLES / "cifar10lt_ce.json", BUNDLES / "cifar10_mixup.json"]
    check_overrides(files, ["optimizer#momentum", "loss#gamma", "mixup_alpha", "settings#val_interval"])
    with pytest.raises(ConfigError, match="did you mean --mixup_alpha"):
        check_overrides(files, ["mixup_alhpa"])
    with pytest.raises(ConfigError, match="did you mean --optimizer"):
        check_overrides(files, ["optimiser#momentum"])
