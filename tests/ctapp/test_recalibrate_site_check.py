"""The site check of a label-free recalibration, unfaked: a 1-epoch model trained on the session's tiny cohort by
the real bundle, then ``lungcal recalibrate --prevalence`` on it. The check runs on the CTs the recalibration has
screened and scored itself (each CT is scored once, by the recalibration, not a second time by a site check), and
the tiny cohort's 6 val and test CTs are too few for one: refused in one line, or run on with ``--force`` and
tagged ``unchecked`` (test_recalibrate.py fakes the check to test its verdicts)."""
from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from monai.bundle import run

from lungcal.cli import main
from lungcal.ctapp.evaluate.calibrators import UNCHECKED
from lungcal.ctapp.site import recalibrate as recalibrate_module
from lungcal.tracking import TAG_STAGE2, default_tracking_uri

ROOT = Path(__file__).resolve().parents[2]
TINY_QC = {"max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0, "max_pixel_mm": 6.0}
SET = [x for k, v in TINY_QC.items() for x in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def model(tiny_cohort, tmp_path_factory):
    store = tmp_path_factory.mktemp("recal_check_runs")
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)
    try:
        run(config_file="bundles/nlst_focal.json", logging_file=False, datalist=str(tiny_cohort),
            output_dir=str(store), epochs=1, n_bootstrap=20, num_workers=0, spacing=[5.0, 5.0, 5.0], patch_size=8,
            batch_size=4, run_name="tiny-recal-check", qc={"_target_": "lungcal.ct.qc.QCConfig", **TINY_QC})
    finally:
        mp.undo()
    uri = default_tracking_uri(store)
    client = MlflowClient(uri)
    s1 = client.search_runs([client.get_experiment_by_name("nlst").experiment_id], f"tags.`{TAG_STAGE2}` = 'none'")[0]
    return {"store": store, "uri": uri, "run": s1.info.run_id, "client": client, "cohort": tiny_cohort}


def _recalibrate(model, *extra):
    return main(["recalibrate", "--model", model["run"], "--datalist", str(model["cohort"]), "--tracking-uri",
                 model["uri"], "--output-dir", str(model["store"]), "--site", "site-r", "--prevalence", "0.2",
                 "--method", "prior", "--n-bootstrap", "0", *SET, *extra])


def test_the_label_free_route_checks_the_cts_it_scored_once_and_refuses_too_few(model, monkeypatch, capsys):
    scored = []
    real = recalibrate_module.score_rows

    def counting(net, rows, *a, **kw):
        scored.extend(r["image"] for r in rows)
        return real(net, rows, *a, **kw)

    monkeypatch.setattr(recalibrate_module, "score_rows", counting)
    capsys.readouterr()
    assert _recalibrate(model) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lungcal")]
    assert len(err) == 1 and "--prevalence needs a site check first, and it could not run" in err[0], err
    assert "too few to tell a site's data from the model's" in err[0] and "--force" in err[0]
    assert len(scored) == len(set(scored)) == 6  # the 3 val and 3 test CTs, each scored once
    scored.clear()
    assert _recalibrate(model, "--force") == 0
    assert "WARNING --force: --prevalence runs without a site check" in capsys.readouterr().out
    assert len(scored) == len(set(scored)) == 6
    client = model["client"]
    runs = client.search_runs([client.get_experiment_by_name("nlst").experiment_id], "tags.`lungcal.site` = 'site-r'")
    assert len(runs) == 1 and runs[0].data.tags["lungcal.forced_past_site_check"] == UNCHECKED
