"""lungcal synth | import-site | import-nlst | check-data through the real CLI entry point."""
from __future__ import annotations

import json
import shutil

import numpy as np

from lungcal.cli import main
from lungcal.data.synthetic import fake_identifiers, write_dicom_series


def test_synth_then_check_data(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["synth", "--out", str(out), "--n", "3", "--shape", "48,48,32", "--spacing", "6,6,8",
                 "--workers", "1", "--formats", "nifti", "--site", "siteB", "--noise-hu", "35"]) == 0
    doc = json.loads((out / "datalist.json").read_text())
    assert len(doc["rows"]) == 3 and doc["rows"][0]["image"].endswith(".nii.gz")
    assert json.loads((out / "cohort.json").read_text())["scanner"]["noise_hu"] == 35
    capsys.readouterr()
    assert main(["check-data", str(out / "datalist.json")]) == 0
    text = capsys.readouterr().out
    assert "3 CTs" in text and "siteB" in text and "48-48 x 48-48 x 32-32" in text and "6-6" in text


def test_check_data_lists_unreadable_images(tmp_path, capsys):
    out = tmp_path / "c"
    main(["synth", "--out", str(out), "--n", "2", "--shape", "48,48,32", "--spacing", "6,6,8", "--workers", "1",
          "--formats", "dicom"])
    rows = json.loads((out / "datalist.json").read_text())["rows"]
    bad = sorted((out / rows[1]["image"]).iterdir())[5]
    bad.write_bytes(bad.read_bytes()[:400])
    capsys.readouterr()
    assert main(["check-data", str(out / "datalist.json")]) == 1
    text = capsys.readouterr().out
    assert "1 unreadable image" in text and bad.name in text


def test_user_errors_exit_2_with_one_line(tmp_path, capsys):
    (tmp_path / "s.csv").write_text("subject_id,image,label\nA,missing.nii.gz,1\n")
    assert main(["import-site", str(tmp_path / "s.csv"), "--site", "x", "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "row 0" in err and "image" in err and "Fix:" in err
    assert main(["check-data", str(tmp_path / "nothing.json")]) == 2
    assert main(["synth", "--out", str(tmp_path / "x"), "--shape", "1,2"]) == 2
    shutil.rmtree(tmp_path / "x", ignore_errors=True)


def test_import_nlst_command(tmp_path, capsys):


    vol = np.zeros((16, 16, 3), np.int16)
    write_dicom_series(vol, (0, 0, 0), (1, 1, 1), tmp_path / "NLST" / "7" / "01-02-1999-x" / "s",
                       fake_identifiers(np.random.default_rng(0)))
    (tmp_path / "c.csv").write_text("pid,candx_days,fup_days,scr_days0,scr_days1,scr_days2\n7,100,900,0,365,730\n")
    assert main(["import-nlst", str(tmp_path), str(tmp_path / "c.csv"), "--out", str(tmp_path / "n.json")]) == 0
    assert "1 CTs, 1 positive" in capsys.readouterr().out
