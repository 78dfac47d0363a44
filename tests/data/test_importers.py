"""NLST and site importers, on a tiny fake TCIA tree and CSVs written here."""
from __future__ import annotations

import json
import logging
import shutil
import warnings

import numpy as np
import pytest

from lungcal.cli import main as cli_main
from lungcal.data.nlst import import_nlst, nlst_label
from lungcal.data.sites import import_site
from lungcal.data.splits import pseudonym
from lungcal.data.synthetic import fake_identifiers, write_dicom_series, write_nifti
from lungcal.errors import DataError

CSV_HEADER = "pid,candx_days,fup_days,scr_days0,scr_days1,scr_days2,cigsmok\n"


def _series(folder, seed=0):
    vol = np.random.default_rng(seed).integers(-1000, 400, (16, 16, 3)).astype(np.int16)
    write_dicom_series(vol, (0.0, 0.0, 0.0), (1.0, 1.0, 2.0), folder, fake_identifiers(np.random.default_rng(seed)))


@pytest.fixture(scope="module")
def tcia(tmp_path_factory):
    root = tmp_path_factory.mktemp("tcia")
    for pid in ("100001", "100002", "100003", "100004"):
        for year in (1999, 2000, 2001):
            study = root / "NLST" / pid / f"01-02-{year}-NLST-LSS-{pid[-2:]}{year}"
            _series(study / "1.000000-0OPASEVZOOMB30f320212080.0-123")
            (study / "2.000000-scout-456").mkdir(parents=True)
            (study / "2.000000-scout-456" / "1-1.dcm").write_bytes(b"")  # fewer files: not chosen
    _series(root / "NLST" / "100002" / "01-02-2002-NLST-LSS-extra" / "s")  # not a screening round
    csv = root / "clinical.csv"
    csv.write_text(CSV_HEADER
                   + "100001,400,2000,10,370,735,1\n"   # cancer 30 days after T1
                   + "100002,NA,2500,0,365,730,1\n"     # never cancer, long follow-up
                   + "100003,,500,0,365,730,0\n")       # follow-up ends 135 days after T1: censored
    return root, csv


def test_nlst_label_rule():
    assert nlst_label(370, 1, 400, 2000) == 1
    assert nlst_label(10, 0, 400, 2000) == 0          # diagnosed 390 days after T0: outside the window
    assert nlst_label(735, 2, 400, 2000) is None      # screen after diagnosis
    assert nlst_label(None, 1, None, 900) == 0        # nominal 365 days, followed 535 days
    assert nlst_label(365, 1, None, 500) is None      # censored
    assert nlst_label(0, 0, 365, None) == 1           # boundary: exactly one year


def test_import_nlst_rows(tcia, tmp_path):
    root, csv = tcia
    rows = import_nlst(root, csv, out=tmp_path / "nlst.json", salt="s", progress=False)
    got = {(r["subject"], r["round"]): r["label"] for r in rows}
    s1, s2, s3 = (pseudonym(p, "s") for p in ("100001", "100002", "100003"))
    assert got == {(s1, 0): 0, (s1, 1): 1, (s2, 0): 0, (s2, 1): 0, (s2, 2): 0, (s3, 0): 0}
    assert all(r["site"] == "nlst" and r["image"].endswith("0OPASEVZOOMB30f320212080.0-123") for r in rows)
    for r in rows:  # one split per patient
        assert len({x["split"] for x in rows if x["subject"] == r["subject"]}) == 1
    text = (tmp_path / "nlst.json").read_text()
    assert json.loads(text)["source"] == "nlst"
    # no participant ID anywhere in the rows except inside TCIA's own folder paths
    for r in rows:
        assert "10000" not in r["subject"] and "10000" not in r["ct"]


def test_import_nlst_errors(tcia, tmp_path):
    root, _ = tcia
    dup = tmp_path / "dup.csv"
    dup.write_text(CSV_HEADER + "100001,,900,0,365,730,1\n100001,,900,0,365,730,1\n")
    with pytest.raises(DataError, match="listed twice") as err:
        import_nlst(root, dup, salt="s", progress=False)
    assert err.value.row == 1 and err.value.field == "pid"
    bad = tmp_path / "bad.csv"
    bad.write_text("pid,fup_days\n1,2\n")
    with pytest.raises(DataError, match="wrong columns"):
        import_nlst(root, bad, salt="s", progress=False)
    num = tmp_path / "num.csv"
    num.write_text(CSV_HEADER + "100001,soon,900,0,365,730,1\n")
    with pytest.raises(DataError, match="not a number") as err:
        import_nlst(root, num, salt="s", progress=False)
    assert err.value.field == "candx_days"
    none = tmp_path / "none.csv"
    none.write_text(CSV_HEADER + "999999,,900,0,365,730,1\n")
    with pytest.raises(DataError, match="no usable screening CT"):
        import_nlst(root, none, salt="s", progress=False)


def _site(tmp_path, lines, header="subject_id,image,label,split"):
    for name in ("a.nii.gz", "b.nii.gz", "c.nii.gz", "d.nii.gz"):
        (tmp_path / "imgs").mkdir(exist_ok=True)
        (tmp_path / "imgs" / name).write_bytes(b"x")
    p = tmp_path / "site.csv"
    p.write_text(header + "\n" + "\n".join(lines) + "\n")
    return p


def test_import_site_relative_paths_and_splits(tmp_path):
    csv = _site(tmp_path, ["MRN1,imgs/a.nii.gz,1,test", "MRN1,imgs/b.nii.gz,0,", "MRN2,imgs/c.nii.gz,0,",
                           "MRN3,imgs/d.nii.gz,1,"])
    rows = import_site(csv, "upmc", out=tmp_path / "dl.json", salt="k")
    assert rows[0]["image"] == str(tmp_path / "imgs" / "a.nii.gz")
    assert rows[0]["split"] == rows[1]["split"] == "test"  # the patient's given split wins for its other CTs
    assert {r["site"] for r in rows} == {"upmc"}
    assert "MRN" not in (tmp_path / "dl.json").read_text()
    assert json.loads((tmp_path / "dl.json").read_text())["source"] == "site:upmc"


def test_import_site_keeps_a_study_date_column_for_the_monitor(tmp_path):
    csv = _site(tmp_path, ["MRN1,imgs/a.nii.gz,1,test,2031-03-04", "MRN2,imgs/b.nii.gz,0,test,20310411",
                           "MRN3,imgs/c.nii.gz,0,test,"], "subject_id,image,label,split,study_date")
    rows = import_site(csv, "upmc", salt="k")
    assert [r.get("study_date") for r in rows] == ["2031-03-04", "2031-04-11", None]
    bad = _site(tmp_path, ["MRN1,imgs/a.nii.gz,1,test,04/03/2031"], "subject_id,image,label,split,study_date")
    with pytest.raises(DataError, match="YYYY-MM-DD") as err:
        import_site(bad, "upmc", salt="k")
    assert err.value.row == 0 and err.value.field == "study_date" and "2031" not in str(err.value)


def test_import_site_dates_a_dicom_ct_from_its_study_date_and_says_it_nowhere_else(tmp_path, caplog):
    """A row without a CSV date whose CT is a DICOM series takes the series' StudyDate; the CSV's date wins where
    given; a NIfTI CT, or a DICOM StudyDate that is not a date, leaves the row undated. Privacy: the date reaches
    the datalist's study_date and nothing else (not the log, not another field)."""
    ids = [fake_identifiers(np.random.default_rng(k)) for k in range(3)]
    for k, (name, study_date) in enumerate([("d1", "20310305"), ("d2", "20310412"), ("d3", "2031-05")]):
        vol = np.random.default_rng(k).integers(-1000, 400, (16, 16, 3)).astype(np.int16)
        write_dicom_series(vol, (0.0, 0.0, 0.0), (1.0, 1.0, 2.0), tmp_path / "imgs" / name,
                           {**ids[k], "StudyDate": study_date})
    csv = _site(tmp_path, ["MRN1,imgs/d1,1,test,", "MRN2,imgs/d2,0,test,2031-06-01", "MRN3,imgs/a.nii.gz,0,test,",
                           "MRN4,imgs/d3,0,test,"], "subject_id,image,label,split,study_date")
    caplog.clear()  # (writing the malformed date above made pydicom warn it)
    with caplog.at_level(logging.DEBUG), warnings.catch_warnings():
        warnings.simplefilter("error")  # nor any warning (pydicom's would carry the value)
        rows = import_site(csv, "upmc", salt="k", out=tmp_path / "dl.json")
    assert [r.get("study_date") for r in rows] == ["2031-03-05", "2031-06-01", None, None]
    assert "1 of 4 rows dated from their DICOM StudyDate" in caplog.text
    assert not any(d in caplog.text for d in ("2031", "20310305", "2031-03-05"))
    written = json.loads((tmp_path / "dl.json").read_text())
    dated = [r for r in written["rows"] if "study_date" in r]
    assert [r["study_date"] for r in dated] == ["2031-03-05", "2031-06-01"]
    assert not any("2031" in str(v) for r in written["rows"] for k, v in r.items() if k != "study_date")
    assert [r.get("study_date") for r in import_site(csv, "upmc", salt="k", dicom_dates=False)] == [
        None, "2031-06-01", None, None]
    # a CSV without the study_date column at all: the DICOM date still fills it
    no_col = _site(tmp_path, ["MRN1,imgs/d1,1,test"])
    assert import_site(no_col, "upmc", salt="k")[0]["study_date"] == "2031-03-05"


@pytest.mark.parametrize("lines, header, row, field, match", [
    (["MRN1,imgs/zzz.nii.gz,1,"], None, 0, "image", "not found"),
    (["MRN1,imgs/a.nii.gz,yes,"], None, 0, "label", "0 or 1"),
    (["MRN1,imgs/a.nii.gz,1,", "MRN1,imgs/a.nii.gz,1,"], None, 1, "image", "duplicate"),
    (["MRN1,imgs/a.nii.gz,1,train", "MRN1,imgs/b.nii.gz,1,test"], None, 1, "split", "in split"),
    (["MRN1,imgs/a.nii.gz,1,later"], None, 0, "split", "split must be"),
    (["MRN1,imgs/a.nii.gz"], "subject_id,image", None, "label", "wrong columns"),
])
def test_import_site_errors(tmp_path, lines, header, row, field, match):
    csv = _site(tmp_path, lines, header or "subject_id,image,label,split")
    with pytest.raises(DataError, match=match) as err:
        import_site(csv, "ucd", salt="k")
    assert err.value.row == row and err.value.field == field and "site.csv" in str(err.value)


def _case_folders(root):
    """Case folders as exported: a NIfTI CT beside its reader-count mask and XML; a DICOM series beside a CSV;
    one with annotations only."""
    hu = np.random.default_rng(0).integers(-1000, 400, (16, 16, 3)).astype(np.int16)
    write_nifti(hu, (0.0, 0.0, 0.0), (1.0, 1.0, 2.0), root / "nifti_case" / "ct.nii.gz")
    write_nifti((hu > 0).astype(np.uint8) * 4, (0.0, 0.0, 0.0), (1.0, 1.0, 2.0),
                root / "nifti_case" / "nodule_mask_nreaders.nii.gz")
    (root / "nifti_case" / "annotation.xml").write_text("<x/>")
    _series(root / "dicom_case" / "dicom")
    (root / "dicom_case" / "lesions.csv").write_text("x\n")
    (root / "no_ct").mkdir(parents=True)
    (root / "no_ct" / "boxes.xml").write_text("<x/>")


def test_import_site_reads_a_case_folder_as_the_ct_in_it(tmp_path):
    _case_folders(tmp_path / "cases")
    csv = tmp_path / "site.csv"
    csv.write_text("subject_id,image,label\nMRN1,cases/nifti_case,1\nMRN2,cases/dicom_case,0\n")
    rows = import_site(csv, "upmc", salt="k", fractions=(0.5, 0.5, 0.0))
    assert [r["image"] for r in rows] == [str(tmp_path / "cases" / "nifti_case" / "ct.nii.gz"),
                                         str(tmp_path / "cases" / "dicom_case")]
    csv.write_text("subject_id,image,label\nMRN1,cases/nifti_case,1\nMRN3,cases/no_ct,0\n")
    with pytest.raises(DataError, match=r"no_ct: the folder holds no CT; found boxes.xml: not a CT image") as err:
        import_site(csv, "upmc", salt="k")
    assert err.value.row == 1 and err.value.field == "image" and "site.csv" in str(err.value)


def test_import_nlst_reads_a_converted_study_folder_as_the_ct_in_it(tmp_path):
    root = tmp_path / "NLST"
    _case_folders(tmp_path / "cases")
    for pid, case in (("100001", "nifti_case"), ("100002", "dicom_case"), ("100003", "no_ct")):
        shutil.copytree(tmp_path / "cases" / case, root / pid / f"01-02-1999-NLST-LSS-{pid[-2:]}")
    csv = tmp_path / "clinical.csv"
    csv.write_text(CSV_HEADER + "".join(f"{pid},,2000,0,365,730,1\n" for pid in ("100001", "100002", "100003")))
    rows = import_nlst(tmp_path, csv, salt="s", progress=False, fractions=(0.5, 0.5, 0.0))
    assert sorted(r["image"] for r in rows) == [str(root / "100001" / "01-02-1999-NLST-LSS-01" / "ct.nii.gz"),
                                                str(root / "100002" / "01-02-1999-NLST-LSS-02" / "dicom")]


ACCENTED = "Müller-Gérard"  # an accented name: its bytes differ between UTF-8 and cp1252


def _excel_csv(tmp_path, encoding, delim, images):
    for name in ("a.nii.gz", "b.nii.gz", "c.nii.gz"):
        (tmp_path / "imgs").mkdir(exist_ok=True)
        (tmp_path / "imgs" / name).write_bytes(b"x")
    lines = [delim.join(("subject_id", "image", "label", "split"))]
    lines += [delim.join((sid, img, lab, "")) for sid, img, lab in images]
    lines.append(delim * 3)  # the empty row Excel leaves below a table
    p = tmp_path / "site.csv"
    p.write_bytes(("\r\n".join(lines) + "\r\n").encode(encoding))
    return p


@pytest.mark.parametrize("encoding, delim", [("cp1252", ";"), ("utf-8-sig", ","), ("utf-16", "\t"), ("utf-8", "\t"),
                                             ("utf-8", ";")])
def test_import_site_reads_csvs_as_excel_writes_them(tmp_path, caplog, encoding, delim):
    absolute = str(tmp_path / "imgs" / "c.nii.gz")
    csv_path = _excel_csv(tmp_path, encoding, delim, [(ACCENTED, "imgs\\a.nii.gz", "1"), ("MRN2", "imgs/b.nii.gz", "0"),
                                                      ("MRN3", absolute, "0")])
    with caplog.at_level(logging.WARNING, logger="lungcal.data.sites"):
        rows = import_site(csv_path, "ucd", salt="k")
    assert [r["image"] for r in rows] == [str(tmp_path / "imgs" / n) for n in ("a.nii.gz", "b.nii.gz", "c.nii.gz")]
    assert rows[0]["subject"] == pseudonym(ACCENTED, "k")  # the name was decoded, not mangled
    assert ("Windows-1252" in caplog.text) == (encoding == "cp1252")


def test_an_undecodable_csv_is_one_error_naming_the_line(tmp_path):
    p = tmp_path / "site.csv"
    p.write_bytes(b"subject_id,image,label\r\nMRN1,a.nii.gz,1\r\nMRN\x81,b.nii.gz,0\r\n")  # 0x81: in neither
    with pytest.raises(DataError, match="line 3 is not UTF-8 or Windows-1252 text") as err:
        import_site(p, "ucd", salt="k", check_files=False)
    assert "\n" not in str(err.value) and "site.csv" in str(err.value)


def test_cli_import_site_reads_a_cp1252_semicolon_csv(tmp_path, capsys):
    csv_path = _excel_csv(tmp_path, "cp1252", ";", [(ACCENTED, "imgs\\a.nii.gz", "1"), ("MRN2", "imgs\\b.nii.gz", "0")])
    out = tmp_path / "dl.json"
    assert cli_main(["import-site", str(csv_path), "--site", "ucd", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    text = out.read_text()
    assert '"imgs/b.nii.gz"' in text  # the backslash path, saved relative to the datalist
    assert ACCENTED not in text and "MRN2" not in text
