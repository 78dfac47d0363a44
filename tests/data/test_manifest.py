"""lungcal.data.manifest and splits: every validation error names row, field and fix."""
from __future__ import annotations

import json

import pytest

from lungcal.data.manifest import load_manifest, rows_for_split, save_manifest, validate_rows
from lungcal.data.splits import apply_splits, assign_splits, get_salt, pseudonym
from lungcal.errors import DataError


def _rows(tmp_path, n=4):
    rows = []
    for i in range(n):
        f = tmp_path / f"ct{i}.nii.gz"
        f.write_bytes(b"x")
        rows.append({"image": f.name, "label": i % 2, "subject": f"S{i}", "site": "a",
                     "split": ["train", "train", "val", "test"][i % 4]})
    return rows


def _write(tmp_path, rows, **doc):
    p = tmp_path / "datalist.json"
    p.write_text(json.dumps({"version": 1, "source": "test", "rows": rows, **doc}))
    return p


def test_roundtrip_resolves_relative_paths(tmp_path):
    rows = _rows(tmp_path)
    p = _write(tmp_path, rows)
    loaded = load_manifest(p)
    assert loaded[0]["image"] == str(tmp_path / "ct0.nii.gz")
    out = save_manifest(loaded, tmp_path / "copy.json", source="x", extra=1)
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and doc["source"] == "x" and doc["extra"] == 1
    assert doc["rows"][0]["image"] == "ct0.nii.gz"  # written relative to the datalist
    assert load_manifest(out) == loaded
    assert [r["subject"] for r in rows_for_split(loaded, "train")] == ["S0", "S1"]


@pytest.mark.parametrize("mutate, row, field, match", [
    (lambda r: r[2].update(image="gone.nii.gz"), 2, "image", "not found"),
    (lambda r: r[1].update(label=2), 1, "label", "0 or 1"),
    (lambda r: r[1].update(label="1"), 1, "label", "0 or 1"),
    (lambda r: r[3].update(image="ct0.nii.gz", subject="S0", split="train"), 3, "image", "duplicate"),
    (lambda r: r[2].update(subject="S0"), 2, "split", "two splits|in split"),
    (lambda r: r[0].pop("site"), 0, "site", "missing column"),
    (lambda r: r[1].update(split="holdout"), 1, "split", "split must be"),
    (lambda r: r[0].update(subject=""), 0, "subject", "non-empty"),
])
def test_each_row_error_names_row_field_and_fix(tmp_path, mutate, row, field, match):
    rows = _rows(tmp_path)
    mutate(rows)
    with pytest.raises(DataError, match=match) as err:
        load_manifest(_write(tmp_path, rows))
    e = err.value
    assert e.row == row and e.field == field and e.fix and "datalist.json" in str(e)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no rows"):
        load_manifest(_write(tmp_path, []))
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(DataError, match="JSON"):
        load_manifest(p)
    p.write_text(json.dumps([{"image": "x"}]))
    with pytest.raises(DataError, match="rows"):
        load_manifest(p)
    with pytest.raises(DataError, match="version"):
        load_manifest(_write(tmp_path, _rows(tmp_path), version=7))
    with pytest.raises(DataError, match="not found"):
        load_manifest(tmp_path / "missing.json")


def test_validate_rows_without_file_check(tmp_path):
    rows = [{"image": "/nowhere/a", "label": 0, "subject": "S1", "site": "a", "split": "val"}]
    assert validate_rows(rows, check_files=False)[0]["image"] == "/nowhere/a"


def test_pseudonym_salted_and_stable(monkeypatch, tmp_path):
    assert pseudonym("123", "a") == pseudonym("123", "a") != pseudonym("123", "b")
    assert "123" not in pseudonym("123", "a")
    monkeypatch.setenv("LUNGCAL_SALT", "env-salt")
    assert get_salt() == "env-salt" and pseudonym("1") == pseudonym("1", "env-salt")
    monkeypatch.delenv("LUNGCAL_SALT")
    f = tmp_path / "salt.txt"
    f.write_text("file-salt\n")
    monkeypatch.setenv("LUNGCAL_SALT_FILE", str(f))
    assert get_salt() == "file-salt"
    monkeypatch.delenv("LUNGCAL_SALT_FILE")
    monkeypatch.setenv("LUNGCAL_HOME", str(tmp_path / "home"))
    s1 = get_salt()
    assert len(s1) == 64 and get_salt() == s1 and (tmp_path / "home" / "salt").is_file()


def test_splits_stratified_by_patient_and_seeded():
    labels = {f"p{i}": int(i < 30) for i in range(100)}
    a = assign_splits(labels, (0.6, 0.2, 0.2), seed=1)
    assert a == assign_splits(labels, (0.6, 0.2, 0.2), seed=1) != assign_splits(labels, (0.6, 0.2, 0.2), seed=2)
    for split, n_pos, n_all in (("train", 18, 60), ("val", 6, 20), ("test", 6, 20)):
        members = [s for s, v in a.items() if v == split]
        assert len(members) == n_all and sum(labels[s] for s in members) == n_pos
    # several CTs of one patient land in one split; a positive CT makes the patient positive
    rows = [{"subject": f"p{i // 3}", "label": int(i == 4), "image": str(i)} for i in range(30)]
    out = apply_splits(rows, seed=0)
    by_subject = {}
    for r in out:
        by_subject.setdefault(r["subject"], set()).add(r["split"])
    assert all(len(v) == 1 for v in by_subject.values())
