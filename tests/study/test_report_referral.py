"""The report's referral section, from runs that logged the selective-prediction metrics."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.calibration.plots import risk_coverage_plot
from lungcal.calibration.selective import selective_report
from lungcal.study.report import build_report, collect_tables, render_markdown
from lungcal.tracking import TAG_DATASET, TAG_STAGE1, TAG_STAGE2, RunTracker


def _run(uri, experiment, s1, s2, report, plot=None):
    tags = {TAG_DATASET: experiment, TAG_STAGE1: s1, TAG_STAGE2: s2}
    with RunTracker(experiment, f"{s1}-{s2}", tracking_uri=uri, tags=tags) as t:
        t.log_report("test", {"acc": 0.8, "auc": 0.85, "ece": 0.05})
        if report is not None:
            t.log_report("test", report)
        if plot is not None:
            t.log_figure(plot, "plots/test_risk_coverage.png")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlf') / 'mlflow.db'}"
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    p1 = np.clip(0.5 + (y - 0.5) * rng.uniform(-0.5, 1.0, 200), 0, 1)
    binary = selective_report(p1, y)
    _run(uri, "nlst", "ce", "none", binary, plot=risk_coverage_plot(p1, y))
    _run(uri, "nlst", "ce", "ts", None)  # an older-style run without referral metrics
    logits = rng.normal(size=(300, 10)) * 3
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    multi = selective_report(probs, rng.integers(0, 10, 300))
    multi_logged = {k: multi[k] for k in ("aurc", "acc_cov90")}
    multi_logged["acc"] = 0.8
    _run(uri, "cifar10", "ce", "none", multi_logged)
    _run(uri, "plain", "ce", "none", None)
    return uri, binary, multi_logged


def test_binary_referral_section_shows_logged_sensitivities(store):
    uri, rep, _ = store
    md = render_markdown(collect_tables("nlst", tracking_uri=uri), "nlst")
    assert "### Referral: refer the 10% least certain (test)" in md
    row = next(line for line in md.splitlines() if line.startswith("| CE + none |") and "AURC" not in line
               and line.count("|") == 10)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"{100 * rep['sensitivity']:.1f}"
    assert cells[2] == f"{100 * rep['sensitivity_cov90']:.1f}"
    assert cells[3] == f"{100 * (rep['sensitivity_cov90'] - rep['sensitivity']):+.1f}"
    assert cells[6] == f"{100 * rep['referred_cancer_share_cov90']:.1f}"
    assert cells[7] == "20"
    assert cells[8] == f"{rep['aurc']:.3f}"
    assert "CE + TS |" not in md.split("### Referral")[1]  # the run without referral metrics is left out


def test_multiclass_section_uses_accuracy_and_plain_runs_get_none(store):
    uri, _, multi = store
    md = render_markdown(collect_tables("cifar10", tracking_uri=uri), "cifar10")
    section = md.split("### Referral")[1]
    assert "acc kept 90%" in section and "sensitivity" not in section
    assert f"| {100 * multi['acc_cov90']:.1f} |" in section and f"{multi['aurc']:.3f}" in section
    assert "### Referral" not in render_markdown(collect_tables("plain", tracking_uri=uri), "plain")


def test_html_report_embeds_the_risk_coverage_plots(store, tmp_path):
    uri, _, _ = store
    out = build_report("nlst", tmp_path / "nlst", tracking_uri=uri, log_run=False)
    page = out["html"].read_text()
    grid = page.split("<h3>Risk-coverage curves (nlst, test)</h3>")[1].split("</div></body>")[0]
    assert grid.count("data:image/png;base64,") == 1  # CE + none has a plot, CE + TS has none
    assert "no plot" in grid
    assert "### Referral" in out["markdown"].read_text()
    plain = build_report("plain", tmp_path / "plain", tracking_uri=uri, log_run=False)
    assert "Risk-coverage" not in plain["html"].read_text()
