"""Does the MLflow UI open where the comparison is? A headless-browser check of the address lungcal prints.

Makes a tiny SQLite store holding a stage-1 run and its TS child, written by
:class:`lungcal.tracking.RunTracker` with lungcal's real names (tags ``lungcal.stage1`` / ``stage2`` /
``parent_run``, metrics ``test/auc``, ``test/ece`` with ``_ci_low`` / ``_ci_high``, ``temperature``) and
as many other metrics as a real run logs; takes the address ``lungcal ui --print-only`` prints; starts
``mlflow ui`` on a free loopback port; opens the address in headless chromium; saves the screenshot and
the rendered DOM; and checks the DOM for the runs table and the study's columns. The server is stopped
at the end, whatever happens.

    python scripts/ui_check.py [--out DIR] [--chromium PATH]

Exit code 0: the check passed; 1: it failed (what failed is printed); 3: no chromium here
(``apt-get install chromium``). ``DIR/ui_check.json`` holds the address, the file names and the findings;
``DIR/ui_check.png`` is what a user sees, ``DIR/ui_check_dom.html`` what the browser rendered.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lungcal.cli import main as lungcal_main
from lungcal.tracking import (
    CT_EXPERIMENT,
    TAG_DATASET,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
)
from lungcal.tracking.commands import ui_command
from lungcal.tracking.runs_view import view_columns
from lungcal.tracking.server import free_port, running_server
from lungcal.workflow.summary import summary_lines

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
#: what the DOM must show: the study's column headers (as MLflow titles metric and tag columns)
EXPECTED_HEADERS = ("test/auc", "test/auc_ci_low", "test/auc_ci_high", "test/ece", "test/ece_ci_low",
                    "test/ece_ci_high", "temperature", TAG_STAGE1, TAG_STAGE2)
#: the order the saved view gives them
VIEW_HEADERS = tuple(re.sub(r"^\w+\.`(.*)`$", r"\1", c) for c in view_columns(CT_EXPERIMENT))
#: training-curve metrics a real run also has, which the view must keep out of sight
NOISE_METRICS = tuple(f"{split}/{m}" for split in ("train", "val") for m in (
    "loss", "acc", "auc", "ece", "mce", "nll", "brier", "adaptive_ece", "classwise_ece", "slope", "intercept",
    "oe_ratio", "sensitivity", "specificity", "lr", "grad_norm", "attention_entropy", "epoch_seconds",
    "positive_rate", "mean_confidence"))


def find_chromium(explicit: str | None = None) -> str | None:
    """The chromium executable: ``explicit``, ``$CHROMIUM``, or the first of :data:`CHROMIUM_NAMES` on PATH."""
    for name in (explicit, os.environ.get("CHROMIUM"), *CHROMIUM_NAMES):
        if name and (path := shutil.which(name)):
            return path
    return None


def make_store(root: Path) -> tuple[str, list[str]]:
    """A store with two stage-1 runs (focal, then ce), each with its TS child, named as lungcal names them
    (``<method>-<time>``, ``<method>-<time>+ts``): ``(tracking uri, run ids in creation order)``."""
    uri = default_tracking_uri(root)
    ids: list[str] = []
    for method, auc, ece, ece_ts, temperature in (("focal", 0.744, 0.081, 0.043, 1.37),
                                                   ("ce", 0.731, 0.112, 0.049, 1.62)):
        name = f"{method}-20261204-0831{len(ids):02d}"
        common = {TAG_DATASET: CT_EXPERIMENT, TAG_SITE: "reference", TAG_STAGE1: method}
        with RunTracker(CT_EXPERIMENT, name, tracking_uri=uri, tags={**common, TAG_STAGE2: "none"}) as stage1:
            for epoch in range(3):
                stage1.log_metrics({k: 0.5 + 0.01 * i + 0.001 * epoch for i, k in enumerate(NOISE_METRICS)},
                                   step=epoch)
            stage1.log_report("test", _report(auc, ece))
        with RunTracker(CT_EXPERIMENT, f"{name}+ts", tracking_uri=uri, parent_run_id=stage1.run_id,
                        tags={**common, TAG_STAGE2: "ts"}) as ts:
            ts.log_metrics({"temperature": temperature})
            ts.log_report("test", _report(auc, ece_ts))
        ids += [stage1.run_id, ts.run_id]
    return uri, ids


def _report(auc: float, ece: float) -> dict[str, float]:
    return {"auc": auc, "auc_ci_low": round(auc - 0.071, 3), "auc_ci_high": round(auc + 0.071, 3), "ece": ece,
            "ece_ci_low": round(0.6 * ece, 3), "ece_ci_high": round(1.5 * ece, 3), "acc": 0.71, "n": 200}


def printed_urls(uri: str, port: int) -> dict[str, str]:
    """The addresses ``lungcal ui --print-only`` prints, by experiment."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = lungcal_main(["ui", "--tracking-uri", uri, "--port", str(port), "--print-only"])
    if code != 0:
        raise RuntimeError(f"lungcal ui exited with {code}: {out.getvalue()}")
    return dict(re.findall(r"^then open (\S+)\s+(http://\S+)$", out.getvalue(), flags=re.M))


def _chromium(chromium: str, url: str, profile: Path, *extra: str, timeout: float = 240.0) -> str:
    """Run headless chromium on ``url`` with ``extra`` (``--screenshot=...`` or ``--dump-dom``); its stdout."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={profile}", "--virtual-time-budget=15000", *extra, url]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"chromium exited with {res.returncode}: {res.stderr[-2000:]}")
    return res.stdout


@dataclasses.dataclass
class Findings:
    """What the rendered page shows."""

    runs_table: bool  # the runs table (ag-grid) is on the page
    genai_overview: bool  # the GenAI overview (usage, tokens) is what opened
    headers: list[str]  # the table's columns in display order
    run_names: list[str]  # its rows' run names in display order
    saved_view_error: bool  # MLflow reported lungcal's saved view missing or unreadable

    @property
    def missing_headers(self) -> list[str]:
        return [h for h in EXPECTED_HEADERS if h not in self.headers]

    @property
    def noise_headers(self) -> list[str]:
        return [h for h in self.headers if h in NOISE_METRICS]

    def problems(self) -> list[str]:
        out = []
        if not self.runs_table or self.genai_overview:
            out.append("no runs table in the page")
        if self.missing_headers:
            out.append(f"columns not in view: {self.missing_headers}")
        if self.noise_headers:
            out.append(f"training-curve columns in view: {self.noise_headers}")
        if [h for h in self.headers if h in VIEW_HEADERS] != list(VIEW_HEADERS):
            out.append(f"columns out of the view's order: {self.headers}")
        names = self.run_names
        if len(names) != 4 or names != sorted(names) or any(names[i + 1] != f"{names[i]}+ts" for i in (0, 2)):
            out.append(f"not each TS run right under its stage-1 run: {names}")
        if self.saved_view_error:
            out.append("MLflow could not load lungcal's saved view")
        return out


def dom_findings(dom: str) -> Findings:
    """Read :class:`Findings` from the DOM chromium rendered (columns by ``aria-colindex``, rows by
    ``row-index``: the grid places its elements by style, not in DOM order)."""
    cells = re.findall(r'<div class="ag-header-cell[ "][^>]*aria-colindex="(\d+)" col-id="([^"]*)"', dom)
    headers = [re.sub(r"^\w+\.`(.*)`$", r"\1", col) for _, col in sorted(cells, key=lambda c: int(c[0]))]
    by_row: dict[int, str] = {}
    starts = [(m.start(), int(m.group(1))) for m in re.finditer(r'<div[^>]*role="row"[^>]*row-index="(\d+)"', dom)]
    for (start, index), (end, _) in zip(starts, [*starts[1:], (len(dom), -1)]):
        cell = re.search(r'col-id="attributes.`Run Name`".*?<a [^>]*href="#/experiments/[^"]*/runs/[^"]*"[^>]*>'
                         r'(?:<[^>]*>)*([^<]+)<', dom[start:end], flags=re.S)
        if cell:
            by_row[index] = cell.group(1).strip()
    return Findings(runs_table="ag-root" in dom and 'role="grid"' in dom,
                    genai_overview="Usage" in dom and "Tokens" in dom, headers=headers,
                    run_names=[by_row[i] for i in sorted(by_row)],
                    saved_view_error="Error loading shared view state" in dom)


def run_check(out: Path, chromium: str) -> dict[str, Any]:
    """The whole check; the findings, with ``ok`` and the ``problems`` that make it fail. The screenshot is a
    1600x1000 window (what a user sees); the DOM comes from a 2600-wide one, so that the table renders every
    column (it leaves out those scrolled out of sight)."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lungcal-ui-check-"))
    try:
        uri, ids = make_store(work / "store")
        port = free_port()
        urls = printed_urls(uri, port)
        summary = summary_lines("focal (stage 1) + TS", [], work, uri, [("stage 1", ids[0]), ("+ TS", ids[1])])
        url = urls.get(CT_EXPERIMENT, "")
        png = out / "ui_check.png"
        with running_server(ui_command(uri, port), port, timeout=180.0):
            png.unlink(missing_ok=True)
            _chromium(chromium, url, work / "profile-shot", "--window-size=1600,1000", f"--screenshot={png}")
            dom = _chromium(chromium, url, work / "profile-dom", "--window-size=2600,1000", "--dump-dom")
        (out / "ui_check_dom.html").write_text(dom, encoding="utf-8")
        found = dom_findings(dom)
        problems = []
        if not url:
            problems.append("lungcal ui printed no address for nlst")
        if url.split("/#/", 1)[-1] not in summary:
            problems.append("the run summary prints another address than lungcal ui")
        if not png.exists() or png.stat().st_size == 0:
            problems.append("no screenshot")
        problems += found.problems()
        result = {"ok": not problems, "problems": problems, "url": url, "urls": urls, "summary": summary,
                  "png": str(png), "dom": str(out / "ui_check_dom.html"), "chromium": chromium,
                  **dataclasses.asdict(found)}
        (out / "ui_check.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="where the PNG, the DOM and ui_check.json go (default: a new temp dir)")
    ap.add_argument("--chromium", default=None, help="the chromium executable (default: $CHROMIUM or on PATH)")
    args = ap.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        print("no chromium here: apt-get install chromium (or pass --chromium PATH)", file=sys.stderr)
        return 3
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="lungcal-ui-shot-"))
    result = run_check(out, chromium)
    print(f"address   {result['url']}\nscreenshot {result['png']}\nDOM       {result['dom']}")
    print(f"headers   {result['headers']}")
    for p in result["problems"]:
        print(f"FAIL      {p}")
    print("ok" if result["ok"] else "the UI does not open where the comparison is")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
