"""``lungcal build-bags``: the cache a training run would build, locally or on a Dask LocalCluster."""
from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser

import lungcal.candidates.cache as cache_module
from lungcal.cli import build_parser, main
from lungcal.ctapp.data.bagbuild import LocalRunner, build_cohort
from lungcal.ctapp.data.bagstream import StreamedBags
from lungcal.data.manifest import load_manifest, save_manifest

ROOT = Path(__file__).resolve().parents[2]
#: the tiny cohort is at 5 mm: series checks that accept its slices and pixels (as the bundle tests)
TINY_QC = {"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0,
           "max_pixel_mm": 6.0}
TINY = {"spacing": [5.0, 5.0, 5.0], "patch_size": 8, "qc": TINY_QC, "num_workers": 0}


@pytest.fixture(scope="module")
def override(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("params") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def build(datalist, out, *params, extra=()) -> int:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # a bundle's % macros resolve from the project root
        return main(["build-bags", str(datalist), "--params", *map(str, params), "--output-dir", str(out), *extra])


@pytest.fixture(scope="module")
def local_build(tiny_cohort, override, tmp_path_factory) -> Path:
    """The cache built by `lungcal build-bags` in-process from the CT bundle at the tiny overrides."""
    out = tmp_path_factory.mktemp("local")
    assert build(tiny_cohort, out, "bundles/nlst_focal.json", override) == 0
    return out


def training_cohort(datalist, out, **keys):
    """The cohort exactly as a training run makes it: the bundle's ``cohort`` object, with overrides."""
    parser = ConfigParser()
    parser.read_config([str(ROOT / "bundles" / "nlst_focal.json")])
    for k, v in {**TINY, "datalist": str(datalist), "output_dir": str(out), **keys}.items():
        parser[k] = v
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        return parser.get_parsed_content("cohort")


def entries(out: Path) -> dict[str, dict[str, np.ndarray]]:
    found = {}
    for p in sorted((out / "cache" / "bags").glob("*.npz")):
        with np.load(p) as z:
            found[p.name] = {k: z[k] for k in z.files}
    return found


def test_help_documents_the_scheduler(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["build-bags", "--help"])
    text = capsys.readouterr().out
    assert "--scheduler" in text and "local:N" in text and "tcp://HOST:8786" in text and "--params" in text


def test_training_after_build_bags_builds_nothing_and_a_rerun_skips_every_entry(local_build, tiny_cohort, override,
                                                                               monkeypatch, capsys):
    built = entries(local_build)
    assert len(built) >= 10
    capsys.readouterr()
    assert build(tiny_cohort, local_build, "bundles/nlst_focal.json", override) == 0
    assert f"0 built, {len(built)} already cached, 0 failed" in capsys.readouterr().out

    def no_build(*a, **k):
        raise AssertionError("training built a bag that build-bags should have built")

    monkeypatch.setattr(cache_module, "compute_bag", no_build)
    cohort = training_cohort(tiny_cohort, local_build, stream_bags=False).load()
    assert sum(len(s["subjects"]) for s in cohort.splits.values()) == len(built)
    # the train split streamed from the same entries gives the same training batches
    streamed = training_cohort(tiny_cohort, local_build, stream_bags=True).load()
    assert isinstance(streamed.splits["train"]["bags"], StreamedBags)
    assert isinstance(streamed.splits["val"]["bags"], torch.Tensor)  # validation and test stay in memory
    loaders = [c.loader("train", batch_size=3, shuffle=True, seed=2, augment=True) for c in (cohort, streamed)]
    for a, b in zip(*loaders, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("bag", "mask", "label", "index"))
    assert entries(local_build).keys() == built.keys()


def test_a_dask_local_cluster_builds_the_same_entries_bit_for_bit(local_build, tiny_cohort, override, tmp_path,
                                                                 capsys):
    pytest.importorskip("distributed")
    rows = [r for r in load_manifest(tiny_cohort) if r["split"] == "test"]
    assert build(tiny_cohort, tmp_path, "bundles/nlst_focal.json", override,
                 extra=["--scheduler", "local:2", "--splits", "test"]) == 0
    out = capsys.readouterr().out
    assert f"{len(rows)} built, 0 already cached, 0 failed (a local Dask cluster, 2 worker(s))" in out
    local, dask = entries(local_build), entries(tmp_path)
    assert len(dask) == len(rows) and dask.keys() <= local.keys()
    assert len(list((tmp_path / "cache" / "qc").glob("*.json"))) == len(rows)  # the series checks ran there too
    for name, arrays in dask.items():
        assert arrays.keys() == local[name].keys()
        for key, value in local[name].items():
            assert arrays[key].dtype == value.dtype and np.array_equal(arrays[key], value), (name, key)


def test_a_running_scheduler_given_by_address_builds_the_same_entries(local_build, tiny_cohort, override, tmp_path,
                                                                      capsys):
    distributed = pytest.importorskip("distributed")
    dask = pytest.importorskip("dask")
    with dask.config.set({"distributed.worker.multiprocessing-method": "fork"}), \
            distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                     scheduler_kwargs={"dashboard": False}) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tcp://")
        assert build(tiny_cohort, tmp_path, "bundles/nlst_focal.json", override,
                     extra=["--scheduler", address, "--splits", "test"]) == 0
    assert f"(the Dask scheduler at {address}, 1 worker(s))" in capsys.readouterr().out
    local, built = entries(local_build), entries(tmp_path)
    assert len(built) == len([r for r in load_manifest(tiny_cohort) if r["split"] == "test"])
    for name, arrays in built.items():
        assert all(np.array_equal(arrays[k], v) for k, v in local[name].items()), name


def test_the_series_checks_and_the_bags_are_one_task_per_ct_on_the_runner(local_build, tiny_cohort, tmp_path):
    class Recording(LocalRunner):
        calls: list = []

        def run(self, fn, tasks):
            self.calls.append((fn.__name__, len(tasks)))
            yield from super().run(fn, tasks)

    shutil.copytree(local_build / "cache" / "bags", tmp_path / "cache" / "bags")  # bags cached, checks not
    n = len([r for r in load_manifest(tiny_cohort) if r["split"] == "test"])
    runner = Recording(0)
    report = build_cohort(training_cohort(tiny_cohort, tmp_path), ("test",), runner, progress=False)
    assert runner.calls == [("check_and_bag", n)]
    assert len(list((tmp_path / "cache" / "qc").glob("*.json"))) == n
    assert (report.total, report.built, report.cached, report.failures) == (n, 0, n, [])


def test_rows_that_fail_a_series_check_are_skipped_as_training_skips_them(tiny_cohort, tmp_path, capsys):
    strict = tmp_path / "strict.json"  # the bundle's own series checks: the tiny cohort's 5 mm slices fail them
    strict.write_text(json.dumps({k: v for k, v in TINY.items() if k != "qc"}))
    assert build(tiny_cohort, tmp_path, "bundles/nlst_focal.json", strict, extra=["--splits", "test"]) == 0
    n = len([r for r in load_manifest(tiny_cohort) if r["split"] == "test"])
    out = capsys.readouterr().out
    assert f"series checks: {n} of {n} CT(s) skipped" in out and "slice_thickness" in out
    assert "bags: 0 CT(s): 0 built" in out and not entries(tmp_path)


def test_a_scheduler_nobody_answers_is_one_line_naming_it(tiny_cohort, override, tmp_path, capsys):
    pytest.importorskip("distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    address = f"tcp://127.0.0.1:{port}"
    t = time.monotonic()
    rc = build(tiny_cohort, tmp_path, "bundles/nlst_focal.json", override,
               extra=["--scheduler", address, "--connect-timeout", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and address in err[0] and "no Dask scheduler answers" in err[0], err
    assert time.monotonic() - t < 30
    assert build(tiny_cohort, tmp_path, "bundles/nlst_focal.json", override, extra=["--scheduler", "local:x"]) == 2
    assert "local:N" in capsys.readouterr().err


def test_failed_rows_are_reported_by_pseudonym_and_the_others_built(tiny_cohort, tmp_path, capsys):
    rows = [r for r in load_manifest(tiny_cohort) if r["split"] == "train"][:2]
    patient = tmp_path / "DOE^JANE-1234567"
    patient.mkdir()
    (patient / "scan.nii.gz").write_bytes(b"not a CT at all")
    rows.append({**rows[0], "image": str(patient / "scan.nii.gz"), "subject": "Sbad0000000000001"})
    datalist = save_manifest([{k: v for k, v in r.items()} for r in rows], tmp_path / "datalist.json",
                             source="site:test")
    params = tmp_path / "bag_params.json"
    params.write_text(json.dumps({"spacing": [5.0, 5.0, 5.0], "patch_size": 8}))
    for rerun in (False, True):
        rc = build(datalist, tmp_path / "out", params, extra=["--num-workers", "0"])
        out, err = capsys.readouterr()
        assert rc == 2
        assert ("0 built, 2 already cached, 1 failed" if rerun else "2 built, 0 already cached, 1 failed") in out
        assert "Sbad0000000000001" in err and "row 2" in err
        assert "DOE^JANE" not in out + err and "scan.nii" not in out + err
    assert len(entries(tmp_path / "out")) == 2
    shutil.rmtree(patient)


def test_a_checkpoints_bag_params_build_with_its_plugged_in_detector_the_entries_training_uses(tiny_cohort, tmp_path):
    detector = {"_target_": "tests.candidates.test_detector_config.FixedPoints", "points": [[1, 2, 3]],
                "radius_mm": 2.5}
    params = tmp_path / "bag_params.json"  # as a stage-1 checkpoint stores them
    k = json.loads((ROOT / "bundles" / "nlst_focal.json").read_text())["k"]  # the bundle's, as its checkpoint stores
    params.write_text(json.dumps({"spacing": [5.0, 5.0, 5.0], "hu_window": [-1000.0, 400.0], "k": k, "patch_size": 8,
                                  "detector": detector}))
    assert build(tiny_cohort, tmp_path, params, extra=["--num-workers", "0", "--splits", "test"]) == 0
    built = entries(tmp_path)
    assert built and all(e["voxel"].tolist() == [[1, 2, 3]] and e["radius_mm"].tolist() == [2.5]
                         for e in built.values())
    report = build_cohort(training_cohort(tiny_cohort, tmp_path, detector=detector, qc=None), ("test",),
                          progress=False)
    assert (report.total, report.built, report.cached) == (len(built), 0, len(built))
