"""The table ``lungcal recalibrate`` prints: one row per candidate, clinical calibration measures with CIs."""
from __future__ import annotations

from typing import TYPE_CHECKING

from lungcal.ctapp.site.site_check import PREVALENCE_SHIFT
from lungcal.ctapp.site.subgroups import subgroup_text
from lungcal.tracking.ui import open_with_lines
from lungcal.workflow import with_ci

if TYPE_CHECKING:  # recalibrate imports this module to print its result
    from lungcal.ctapp.site.recalibrate import Recalibration
    from lungcal.ctapp.site.threshold import SiteThreshold

__all__ = ["ROW_LABELS", "format_summary", "threshold_lines", "prior_hint"]

#: display names of the fixed rows (local calibrators show as ``local <name>``)
ROW_LABELS = {"uncalibrated": "uncalibrated", "prior": "prior-adjusted", "em": "EM prior-adjusted"}
_COLS = (("ece", "test ECE"), ("cal_slope", "slope"), ("cal_intercept", "intercept"), ("oe_ratio", "O/E"),
         ("auc", "AUC"), ("acc", "ACC"))


def _label(key: str) -> str:
    if key in ROW_LABELS:
        return ROW_LABELS[key]
    if key.startswith("reference_"):
        return f"shipped ({key[len('reference_'):]})"
    return f"local {key}"


def threshold_lines(t: SiteThreshold, site: str) -> list[str]:
    """The guaranteed decision threshold: what it guarantees (fitted on the certify split), what it did there and
    on test, and the warnings (a threshold that hardly triages, a certify split that could not be checked)."""
    g = t.guarantee
    split = t.fit_split
    if g.delta is None:
        promise = (f"ON AVERAGE over draws of the {split} split (a weaker promise: no probability is stated for "
                   "this split)")
        how = "conformal risk control"
    else:
        promise, how = f"with probability at least {100 * (1 - g.delta):g}%", "Learn-then-Test"
    allowed = f"; {g.misses_allowed} missed cancer(s) allowed there" if g.misses_allowed is not None else ""
    lines = [f"  decision      p(cancer) >= {g.threshold:.4f} -> work-up, chosen on the {split} split "
             f"({g.n_cancers} cancers among {g.n} CTs; {how}{allowed}): at most {100 * g.alpha:g}% of cancers below "
             f"it, {promise}"]
    if t.checked_on_test:
        lo, hi = t.test_sensitivity_ci
        lines.append(f"                work-up rate {split} {100 * g.positive_rate:.1f}%, test "
                     f"{100 * t.test_positive_rate:.1f}%; sensitivity {split} {100 * g.sensitivity:.1f}%, test "
                     f"{100 * t.test_sensitivity:.1f}% [{100 * lo:.1f}-{100 * hi:.1f}] (Clopper-Pearson 95%, "
                     f"{t.test_cancers} cancers)")
    else:
        lines.append(f"                work-up rate {split} {100 * g.positive_rate:.1f}%; sensitivity {split} "
                     f"{100 * g.sensitivity:.1f}%; no independent split is left to check it (the {split} split "
                     "certified it)")
    lines.append("                the guarantee is over the population the certify split was drawn from, at the "
                 f"site's prevalence; `lungcal predict --site {site}` applies it and states it per CT")
    lines += [f"  WARNING       {w}" for w in t.warnings()]
    return lines


def prior_hint(res: Recalibration) -> str | None:
    """A pointer to ``--method prior`` where the site check found a prevalence change only, the site's
    prevalence was given, and another calibrator was chosen; else None.

    Decided from the check and the method alone, never from the test rows: the prior adjustment is the
    correction that the check's verdict licenses and fits nothing on the val split, whereas the chosen
    calibrator was fitted on the val split's few events (at a low-prevalence site a flexible fit can be
    inconsistent with calibration where the adjustment is not: ``docs/results.md``, the two-site workflow).
    """
    chk = res.site_check
    if chk is None or chk["verdict"] != PREVALENCE_SHIFT or "prior" not in res.rows or res.chosen_row == "prior":
        return None
    return (f"  NOTE          the site check found a prevalence change only and the site's prevalence is given: "
            f"`--method prior` stores the prior-adjusted row, which fits nothing on the val split "
            f"({res.n_events} CTs of the rarer class there); the chosen {_label(res.chosen_row)} was fitted on it "
            "(decide by the check's verdict, not by the test rows above)")


def _intervals(t, mask) -> str:
    """``"0.02-0.18, 0.30"``: the runs of thresholds where ``mask`` holds."""
    runs, start = [], None
    for i, ok in enumerate(list(mask) + [False]):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            a, b = t[start], t[i - 1]
            runs.append(f"{a:.2f}" if start == i - 1 else f"{a:.2f}-{b:.2f}")
            start = None
    return ", ".join(runs)


def decision_line(res: Recalibration) -> str:
    """Where the chosen calibrator's test decision curve beats treating all and none, and its net benefit at the
    site's threshold (else at 0.05 and 0.10)."""
    c = res.decision
    assert c is not None
    where = _intervals(c.thresholds, c.useful())
    marks = [res.threshold.guarantee.threshold] if res.threshold is not None else [0.05, 0.10]
    at = "; ".join(f"at {a['threshold']:.3f}: model {a['model']:+.3f}, treat all {a['treat_all']:+.3f}"
                   for a in (c.at(m) for m in marks))
    return (f"  decision curve (test, net benefit) model above treat-all and treat-none at threshold "
            f"probabilities {where or 'none of 0.01-0.50'}; {at}")


def format_summary(res: Recalibration) -> str:
    """Every row's test ECE, calibration slope / intercept, O/E, AUC and ACC with 95% CIs, its ECE
    consistency p-value, the chosen calibrator (``*``), and the warnings."""
    lines = [f"== lungcal recalibrate: site {res.site} (val n={res.n_val}, test n={res.n_test}) =="]
    skipped = {k: v for k, v in (res.qc_skipped or {}).items() if v}
    if skipped:
        lines.append("  series checks left out " + ", ".join(f"{v} {k}" for k, v in skipped.items())
                     + " CT(s) that inference would refuse (reasons above; `lungcal qc` shows each)")
    if res.reference_temperature is not None:
        lines.append(f"  reference T   {res.reference_temperature:.3f} "
                     "(fitted by the stage-1 run on its own val split)")
    if res.temperature is not None:
        lines.append(f"  temperature   {res.temperature:.3f} (fitted on the site's val split; no retraining)")
    pri = res.priors or {}
    if "source_prior" in pri:
        lines.append(f"  prevalence    shipped model calibrated to {pri['source_prior']:.3f} ({pri['source']})"
                     + (f"; site {pri['site_prior']:.3f} (given)" if "site_prior" in pri else "")
                     + (f"; EM on {pri['n_unlabelled']} unlabelled CTs {pri['em_prior']:.3f}" if "em_prior" in pri
                        else ""))
    chk = res.site_check
    if chk is not None:
        lines.append(f"  site check    {chk['verdict']}" + (f" (run {chk['run']})" if chk["run"] else "")
                     + (f"; FORCED past {chk['forced']}: the prior-adjusted rows are not valid if the scanners "
                        "changed" if chk["forced"] else ""))
    head = f"  {'':<22}" + "".join(f"{name:<25}" for _, name in _COLS) + "p(calibrated)"
    lines.append(head)
    chosen = res.chosen_row
    for key, rep in res.rows.items():
        mark = "*" if key == chosen else " "
        cells = "".join(f"{with_ci(rep, k):<24} " for k, _ in _COLS)
        lines.append(f"{mark} {_label(key):<22}{cells}{rep.get('ece_pvalue', float('nan')):.3f}")
    lines.append(f"  * chosen ({res.method}): stored on the run as calibrator/{res.chosen}.json; "
                 f"`inference.json --site {res.site}` applies it")
    hint = prior_hint(res)
    if hint is not None:
        lines.append(hint)
    if res.cv_nll:
        lines.append("  cross-validated NLL on val: " + ", ".join(f"{k} {v:.4f}" for k, v in res.cv_nll.items()))
    lines.append("  slope 1, intercept 0 and O/E 1 = calibrated; p(calibrated): consistency-resampling p-value of "
                 "the ECE (small = miscalibrated on this site)")
    if res.threshold is not None:
        lines.extend(threshold_lines(res.threshold, res.site))
    if res.decision is not None:
        lines.append(decision_line(res))
    if res.subgroups and res.threshold is not None:
        split = "test" if res.threshold.fit_split == "val" else "test (the certify split)"
        lines.extend(subgroup_text(res.subgroups, split, res.threshold.guarantee.threshold))
    for name, flags in (res.warnings or {}).items():
        note = " -> the chosen calibrator is NO SIGNAL, not a result" if name == chosen else ""
        lines.append(f"  WARNING {name}: {'; '.join(flags)}{note}")
    if res.few_events:
        lines.append(f"  WARNING only {res.n_events} CTs of the rarer class in the val split (< 100): "
                     "the fits are noisy and the CIs are wide")
    if res.run_id:
        lines.append(f"  MLflow run    {res.run_id} (parent {res.parent_run or 'checkpoint'})")
        lines += open_with_lines(res.tracking_uri, res.run_id, width=13)
    return "\n".join(lines)
