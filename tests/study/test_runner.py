"""The study runner on tiny fake bundles (real MONAI bundle configs that only log MLflow runs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lungcal.cli import main
from lungcal.errors import ConfigError
from lungcal.study.runner import (
    TAG_STUDY_KEY,
    bundle_command,
    inprocess_runner,
    plan_study,
    print_plan,
    run_study,
)


def _tracker(stage2: str, parent: str | None = None) -> dict:
    t = {"_target_": "lungcal.tracking.RunTracker", "experiment": "nlst",
         "run_name": f"$'fake_' + @stage1 + '_{stage2}'", "tracking_uri": "@tracking_uri",
         "tags": {"lungcal.dataset": "synthetic", "lungcal.stage1": "@stage1", "lungcal.stage2": stage2}}
    if parent:
        t["parent_run_id"] = parent
    return t


def _stage1_bundle(method: str, fail: bool = False) -> dict:
    run = ["$1 / 0"] if fail else [
        "$@s1.log_params({'epochs': @epochs})",
        "$@s1.log_report('test', {'ece': 0.2, 'ece_ci_low': 0.1, 'ece_ci_high': 0.3})",
        "$@s1.end()",
        "$@ts.log_report('test', {'ece': 0.05, 'ece_ci_low': 0.01, 'ece_ci_high': 0.09})",
        "$@ts.end()",
    ]
    return {"tracking_uri": "sqlite:///unused.db", "epochs": 100, "stage1": method,
            "s1": _tracker("none"), "ts": _tracker("ts", "$@s1.run_id"), "run": run}


LAS_BUNDLE = {"tracking_uri": "sqlite:///unused.db", "epochs": 100, "stage1_run_id": None,
              "client": {"_target_": "mlflow.tracking.MlflowClient", "tracking_uri": "@tracking_uri"},
              "stage1": "$@client.get_run(@stage1_run_id).data.tags['lungcal.stage1']",
              "las": _tracker("las", "@stage1_run_id"),
              "run": ["$@las.log_report('test', {'ece': 0.04})", "$@las.end()"]}


@pytest.fixture
def bundles(tmp_path):
    d = tmp_path / "bundles"
    d.mkdir()
    (d / "nlst_ce.json").write_text(json.dumps(_stage1_bundle("ce")))
    (d / "nlst_focal.json").write_text(json.dumps(_stage1_bundle("focal", fail=True)))
    (d / "nlst_las.json").write_text(json.dumps(LAS_BUNDLE))
    return d


def _plan(bundles, uri, tmp_path, **kw):
    plan = plan_study(["nlst"], stage1=kw.pop("stage1", ["ce", "focal"]), tracking_uri=uri, bundle_dir=bundles,
                      output_dir=tmp_path / "out", **kw)
    plan.runner = inprocess_runner
    return plan


def test_study_runs_resumes_and_reports_failures(bundles, tmp_path, capsys):

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = _plan(bundles, uri, tmp_path)
    assert [(j.stage1, j.kind, j.produces, j.skip) for j in plan.jobs] == [
        ("ce", "stage1", ["none", "ts"], False), ("ce", "las", ["las"], False),
        ("focal", "stage1", ["none", "ts"], False), ("focal", "las", ["las"], False)]
    assert plan.jobs[0].overrides == {"epochs": 6} and plan.jobs[1].overrides == {"epochs": 15}  # reduced preset

    results = run_study(plan, progress=False)
    assert [r.status for r in results] == ["finished", "finished", "failed", "failed"]
    assert "ZeroDivisionError" in results[2].log.read_text()
    assert results[3].message == "its stage-1 job failed"

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("nlst")
    runs = {r.data.tags["lungcal.stage2"]: r for r in client.search_runs([exp.experiment_id])
            if r.data.tags.get("lungcal.stage1") == "ce"}
    assert set(runs) == {"none", "ts", "las"}
    assert all(r.info.status == "FINISHED" and r.data.tags[TAG_STUDY_KEY] == plan.jobs[0].study_key
               for r in runs.values())
    assert runs["none"].data.params["epochs"] == "6"  # preset reached the bundle
    assert runs["las"].data.tags["lungcal.parent_run"] == runs["none"].info.run_id

    # resume: the ce configurations are skipped, focal is planned again
    again = _plan(bundles, uri, tmp_path)
    assert [j.skip for j in again.jobs] == [True, True, False, False]
    print_plan(again)
    out = capsys.readouterr().out
    assert "4 jobs, 2 to run, 2 already finished" in out and "[skip] nlst/ce/none+ts" in out
    # other settings are another configuration: nothing is reused
    other = _plan(bundles, uri, tmp_path, overrides={"epochs": 2})
    assert not any(j.skip for j in other.jobs) and other.jobs[0].overrides == {"epochs": 2}
    # --force replans everything
    assert not any(j.skip for j in _plan(bundles, uri, tmp_path, force=True).jobs)


def test_stage2_subsets_and_errors(bundles, tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    plan = _plan(bundles, uri, tmp_path, stage1=["ce"], stage2=["las"])
    assert [(j.kind, j.produces) for j in plan.jobs] == [("stage1", ["none"]), ("las", ["las"])]
    plan = _plan(bundles, uri, tmp_path, stage1=["ce"], stage2=["ts"])
    assert [(j.kind, j.produces) for j in plan.jobs] == [("stage1", ["ts"])]
    with pytest.raises(ConfigError, match="nlst_mixup.json"):
        _plan(bundles, uri, tmp_path, stage1=["mixup"])
    with pytest.raises(ConfigError, match="unknown dataset"):
        plan_study(["imagenet"], tracking_uri=uri, bundle_dir=bundles)
    with pytest.raises(ConfigError, match="stage-2"):
        _plan(bundles, uri, tmp_path, stage2=["platt"])


def test_bundle_command_and_cli_dry_run(bundles, tmp_path, capsys):
    cmd = bundle_command(bundles / "nlst_ce.json", {"epochs": 3, "datalist": "/d/site.json"})
    assert cmd[1:5] == ["-m", "monai.bundle", "run", "--config_file"]
    assert cmd[-4:] == ["--epochs", "3", "--datalist", "/d/site.json"]

    uri = f"sqlite:///{tmp_path / 'cli.db'}"
    rc = main(["study", "--stage1", "ce", "--stage2", "none", "ts", "--bundle-dir", str(bundles),
               "--tracking-uri", uri, "--dry-run", "-o", "epochs=1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "1 jobs, 1 to run" in out and "--epochs 1" in out
    assert main(["study", "-o", "epochs", "--bundle-dir", str(bundles), "--tracking-uri", uri]) == 2


def test_seeds_are_configurations_and_las_follows_its_seed(bundles, tmp_path):
    uri = f"sqlite:///{tmp_path / 's.db'}"
    plan = _plan(bundles, uri, tmp_path, stage1=["ce"], seeds=[0, 1])
    assert [(j.kind, j.seed, j.overrides.get("seed")) for j in plan.jobs] == [
        ("stage1", 0, 0), ("las", 0, 0), ("stage1", 1, 1), ("las", 1, 1)]
    assert plan.jobs[0].study_key == plan.jobs[1].study_key != plan.jobs[2].study_key
    assert plan.jobs[2].label == "nlst/ce/none+ts/seed1"
    results = run_study(plan, progress=False)
    assert [r.status for r in results] == ["finished"] * 4
    client = MlflowClient(tracking_uri=uri)
    for s1_job, las_job in ((results[0], results[1]), (results[2], results[3])):
        none = [i for i in s1_job.run_ids if client.get_run(i).data.tags["lungcal.stage2"] == "none"][0]
        assert client.get_run(las_job.run_ids[0]).data.tags["lungcal.parent_run"] == none


def test_the_full_ct_study_plans_the_grid_on_the_nlst_like_cohort(tmp_path, capsys, monkeypatch):
    """`lungcal study --datasets nlst --preset full --seeds 0 1 2 --dry-run` on the real bundles."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the project root: bundles/ resolve from here
    uri = f"sqlite:///{tmp_path / 'grid.db'}"
    rc = main(["study", "--datasets", "nlst", "--preset", "full", "--seeds", "0", "1", "2", "--dry-run",
               "--tracking-uri", uri])
    assert rc == 0
    out = capsys.readouterr().out
    assert "24 jobs, 24 to run" in out  # 4 stage-1 methods x 3 seeds, each with its LAS job
    lines = [line for line in out.splitlines() if "[run ]" in line]
    stage1 = [line for line in lines if "none+ts" in line]
    las = [line for line in lines if "/las/" in line]
    assert len(stage1) == 12 and len(las) == 12
    assert {m for m in ("ce", "focal", "mixup", "focal_mixup") if any(f"nlst/{m}/none+ts/seed2" in x for x in lines)} \
        == {"ce", "focal", "mixup", "focal_mixup"}
    assert all("synthetic_study_3500/datalist.json" in x for x in lines)  # not the demo cohort
    assert not (tmp_path / "grid.db").exists()  # a dry run creates no store


def test_the_cifar_study_runs_each_recipe_over_its_complete_base(tmp_path):
    """Issue 44 item 3: a CIFAR stage-1 job runs ``[cifar10lt_ce.json, recipe]`` (the base alone for its own
    recipe) and a LAS job ``[cifar10lt_las.json, cifar10_las.json]``, as the CT jobs run over nlst_focal.json."""
    root = Path(__file__).resolve().parents[2]
    plan = plan_study(["cifar10", "cifar10lt"], stage1=["ce", "focal"], tracking_uri=f"sqlite:///{tmp_path}/x.db",
                      bundle_dir=root / "bundles", output_dir=tmp_path / "out")
    files = {(j.dataset, j.stage1, j.kind): [b.name for b in j.bundle] for j in plan.jobs}
    assert files == {
        ("cifar10", "ce", "stage1"): ["cifar10lt_ce.json", "cifar10_ce.json"],
        ("cifar10", "ce", "las"): ["cifar10lt_las.json", "cifar10_las.json"],
        ("cifar10", "focal", "stage1"): ["cifar10lt_ce.json", "cifar10_focal.json"],
        ("cifar10", "focal", "las"): ["cifar10lt_las.json", "cifar10_las.json"],
        ("cifar10lt", "ce", "stage1"): ["cifar10lt_ce.json"],
        ("cifar10lt", "ce", "las"): ["cifar10lt_las.json"],
        ("cifar10lt", "focal", "stage1"): ["cifar10lt_ce.json", "cifar10lt_focal.json"],
        ("cifar10lt", "focal", "las"): ["cifar10lt_las.json"]}
    las = next(j for j in plan.jobs if (j.dataset, j.kind) == ("cifar10", "las"))
    cmd = bundle_command(las.bundle, {"epochs": 5})
    assert cmd[cmd.index("--config_file") + 1] == str([str(b) for b in las.bundle])
