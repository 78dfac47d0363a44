"""May a split certify a site's threshold? Not when its CTs trained the model or chose its checkpoint
(:mod:`lungcal.ctapp.site.certify_split`): real MLflow runs in a SQLite store, with and without the stage-1
record of the CTs that made the checkpoint (``data/selection.json``), and with the datalist digest older runs
logged."""
from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from lungcal.ctapp.model.checkpoint import Stage1Model, selection_record
from lungcal.ctapp.site.certify_split import certify_check
from lungcal.errors import ConfigError
from lungcal.tracking import SELECTION_ARTIFACT, RunTracker, file_digest, run_selection


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLflow store (creating one costs seconds) and a site datalist; each test adds its own runs."""
    tmp_path = tmp_path_factory.mktemp("certify")
    rows = [{"image": f"ct{i}.nii.gz", "label": i % 2, "subject": f"s{i:03d}", "site": "b",
             "split": ("train", "val", "test")[i % 3]} for i in range(30)]
    dl = tmp_path / "site.json"
    dl.write_text(json.dumps({"version": 1, "source": "site:b", "rows": rows}))
    split = {s: [r for r in rows if r["split"] == s] for s in ("train", "val", "test")}
    return {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "datalist": dl, "rows": split}


def _model(store, *, record=None, params=None) -> Stage1Model:
    """A stage-1 model whose run logged ``record`` as its selection and ``params``."""
    with RunTracker("nlst", "stage1", tracking_uri=store["uri"], tags={"lungcal.stage2": "none"}) as tr:
        if record is not None:
            tr.log_dict(record, SELECTION_ARTIFACT)
        if params:
            tr.log_params(params)
        run_id = tr.run_id
    return Stage1Model(network=None, checkpoint={}, run=MlflowClient(store["uri"]).get_run(run_id),  # type: ignore[arg-type]
                       bag_params={})


def _subjects(rows):
    return [r["subject"] for r in rows]


def test_the_fine_tune_route_val_split_chose_the_checkpoint_and_is_refused_naming_the_way_out(store):
    rows = store["rows"]
    record = selection_record(_subjects(rows["train"]), _subjects(rows["val"]), "val_auc")
    model = _model(store, record=record)
    assert run_selection(store["uri"], str(model.run_id)) == record
    with pytest.raises(ConfigError, match="val split cannot certify") as info:
        certify_check(model, rows["val"], "val", store["datalist"], store["uri"])
    e = info.value
    assert e.field == "--certify-split" and str(store["datalist"]) in str(e)
    assert f"10 of its 10 subjects chose run {model.run_id}'s checkpoint (the best val_auc over epochs" in e.message
    assert "--certify-split test" in (e.fix or "") and "\n" not in str(e)
    # the test split chose nothing and trained nothing: it may certify
    ok = certify_check(model, rows["test"], "test", store["datalist"], store["uri"])
    assert ok.checked and "none of the 10 test subjects" in ok.note


def test_subjects_that_trained_the_model_are_refused_too(store):
    rows = store["rows"]
    model = _model(store, record=selection_record(_subjects(rows["train"]) + ["s001"], ["x1", "x2"], "val_auc"))
    with pytest.raises(ConfigError, match="1 trained it"):
        certify_check(model, rows["val"], "val", store["datalist"], store["uri"])


def test_a_model_trained_elsewhere_may_certify_on_the_site_val_split(store):
    model = _model(store, record=selection_record(["n1", "n2"], ["n3", "n4"], "val_auc"))  # NLST's pseudonyms
    ok = certify_check(model, store["rows"]["val"], "val", store["datalist"], store["uri"])
    assert ok.checked and "none of the 10 val subjects trained model" in ok.note


def test_an_older_run_without_the_record_is_judged_by_its_datalist_digest(store):
    rows, dl = store["rows"], store["datalist"]
    same = _model(store, params={"datalist": {"source": "site:b", "sha256": file_digest(dl)}})
    with pytest.raises(ConfigError, match="trained on this datalist .* so its val split chose its checkpoint"):
        certify_check(same, rows["val"], "val", dl, store["uri"])
    assert certify_check(same, rows["test"], "test", dl, store["uri"]).checked
    other = _model(store, params={"datalist": {"source": "nlst", "sha256": "0123456789abcdef"}})
    unknown = certify_check(other, rows["val"], "val", dl, store["uri"])
    assert not unknown.checked and "could not be checked" in unknown.note


def test_a_checkpoint_file_cannot_be_checked_and_says_so(store):
    model = Stage1Model(network=None, checkpoint={}, run=None, bag_params={})  # type: ignore[arg-type]
    res = certify_check(model, store["rows"]["val"], "val", store["datalist"], store["uri"])
    assert not res.checked and "checkpoint file" in res.note and "could not be checked" in res.note


def test_the_record_holds_pseudonyms_only_sorted_and_unique():
    rec = selection_record(["s2", "s1", "s2"], ("s3",), "val_auc")
    assert rec == {"version": 1, "selected_by": "the best val_auc over epochs on the val split", "train": ["s1", "s2"],
                   "val": ["s3"]}
