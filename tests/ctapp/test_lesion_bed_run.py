"""``lungcal lesion-bed`` (lungcal.ctapp.evaluate.lesion_bed_run): a tiny run on a phantom background, the
scans it writes, the detectors it reads, and its user errors (one line, exit 2)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from lungcal.cli import main
from lungcal.ctapp.evaluate.lesion_bed_run import REAL_FIELDS, cells_of, detectors_of, find_backgrounds, presets_of
from lungcal.data.synthetic import ScannerProfile, make_phantom, write_nifti
from lungcal.data.synthetic.insertion import read_truth
from lungcal.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]
SHAPE, SPACING = (128, 128, 96), (2.5, 2.5, 2.5)


@pytest.fixture(scope="module")
def backgrounds(tmp_path_factory):
    """A folder of case folders: one phantom chest CT at 2.5 mm, and one at 5 mm slices (fails a series check)."""
    root = tmp_path_factory.mktemp("lesion_bed_cli") / "cts"
    hu, origin, _ = make_phantom(np.random.default_rng(3), SHAPE, SPACING, (), ScannerProfile(noise_hu=15))
    (root / "phantom").mkdir(parents=True)
    write_nifti(hu, origin, SPACING, root / "phantom" / "ct.nii.gz")
    thick = np.rint(hu.reshape(SHAPE[0], SHAPE[1], SHAPE[2] // 2, 2).mean(-1)).astype(np.int16)
    (root / "thick").mkdir()
    write_nifti(thick, origin, (2.5, 2.5, 5.0), root / "thick" / "ct.nii.gz")
    (root / "thick" / "notes.txt").write_text("not a CT")
    return root


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_tiny_bed_prints_its_tables_and_writes_rows_and_scans(backgrounds, tmp_path, capsys):
    out = tmp_path / "bed"
    rc = main(["lesion-bed", "--backgrounds", str(backgrounds), "--per-cell", "1", "--kinds", "solid", "ground-glass",
               "--places", "free", "pleura", "--seed", "2", "--out", str(out), "--write-scans"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "skipped thick: series check 'slice_thickness' failed" in printed  # the pipeline would refuse it too
    for table in ("In the bag, by kind x place", "In the bag, by kind x size band", "candidates per CT (median)"):
        assert table in printed
    assert "| solid | free | 1/1" in printed or "| solid | free | 0/1" in printed
    rows = _csv(out / "rows.csv")
    assert sorted((r["kind"], r["place"]) for r in rows) == [("ground-glass", "free"), ("ground-glass", "pleura"),
                                                             ("solid", "free"), ("solid", "pleura")]
    assert {r["background"] for r in rows} == {"phantom"} and {r["preset"] for r in rows} == {"default"}
    assert {r["detector"] for r in rows} == {"default"}  # the bundles' LoG detector
    assert list(_csv(out / "real.csv")) == [] and (out / "real.csv").read_text().strip() == ",".join(REAL_FIELDS)
    # the scans a site can run its own pipeline on: the same lesions, with their truth
    truth = read_truth(out / "scans" / "truth.csv")
    assert sorted(truth) == sorted({r["scan"] for r in rows})
    written = sorted((x.kind, x.place, x.diameter_mm) for lesions in truth.values() for x in lesions)
    assert written == sorted((r["kind"], r["place"], float(r["diameter_mm"])) for r in rows)
    items = json.loads((out / "scans" / "datalist.json").read_text())["data"]
    assert all((out / "scans" / i["image"]).is_file() for i in items) and len(items) == len(truth)
    # a second run into the same folder is refused (truth.csv would be appended to)
    assert main(["lesion-bed", "--backgrounds", str(backgrounds), "--out", str(out)]) == 2
    assert "already holds a lesion bed" in capsys.readouterr().err


@pytest.mark.parametrize("args, field", [
    (["--kinds", "solid", "calcified"], "--kinds"),
    (["--places", "lung"], "--places"),
    (["--preset", "halfres"], "--preset"),
    (["--per-cell", "0"], "--per-cell"),
    (["--detector", "x=not.a.module.Detector"], "--detector"),
    (["--detector", "x={not json"], "--detector"),
    (["--detector", "x=missing.json"], "--detector"),
    (["--cases", "nope"], "--cases"),
])
def test_user_errors_are_one_line_and_exit_2(backgrounds, tmp_path, capsys, args, field):
    assert main(["lesion-bed", "--backgrounds", str(backgrounds), "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lungcal lesion-bed: error:") and f"'{field}'" in err
    assert not (tmp_path / "o" / "rows.csv").exists()


def test_a_folder_without_a_usable_ct_is_refused_naming_why(backgrounds, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no CT"):
        find_backgrounds(tmp_path / "empty")
    with pytest.raises(DataError, match="not a folder"):
        find_backgrounds(tmp_path / "nowhere")
    with pytest.raises(DataError, match="no usable background CT.*slice_thickness") as err:
        find_backgrounds(backgrounds, cases=["thick"])
    assert err.value.field == "--backgrounds" and err.value.fix


def test_detectors_are_read_from_a_bundle_a_class_path_or_json():
    # the default is the CT bundles' detector, as the bundle resolves it
    default = detectors_of(None)["default"]
    assert default == {"_target_": "lungcal.candidates.lesions.LesionDetector"}
    bundle = detectors_of([f"base={ROOT / 'bundles' / 'nlst_focal.json'}"])["base"]
    assert bundle["_target_"] == default["_target_"] and bundle["hu_window"] == [-1000.0, 400.0]
    got = detectors_of([f"subsolid={ROOT / 'bundles' / 'nlst_subsolid.json'}", "log={\"top_k\": 16}",
                        "glass=lungcal.candidates.subsolid.SubsolidLoGDetector"])
    assert got["subsolid"]["_target_"] == "lungcal.candidates.subsolid.SubsolidLoGDetector"
    assert got["subsolid"]["hu_window"] == [-1000.0, 400.0]  # its @hu_window: the bundles' window
    assert got["log"] == {"top_k": 16}
    assert got["glass"] == {"_target_": "lungcal.candidates.subsolid.SubsolidLoGDetector"}
    with pytest.raises(ConfigError, match="given twice"):
        detectors_of(["a={}", "a={}"])
    with pytest.raises(ConfigError, match="bad --detector"):
        detectors_of(["{}"])


def test_cells_and_presets():
    assert cells_of(["mass"], ["pleura", "mediastinum"], 3) == {("mass", "pleura"): 3, ("mass", "mediastinum"): 3}
    assert len(cells_of(None, None, 30)) == 16 and set(cells_of(None, None, 30).values()) == {30}
    assert [p.name for p in presets_of(None)] == ["default"]
    got = [(p.spacing, p.k, p.patch_size) for p in presets_of(["fullres", "default"])]
    assert got == [(1.0, 16, 32), (2.5, 16, 16)]
