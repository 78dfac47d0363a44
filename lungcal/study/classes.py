"""Report section ``classes``: where a model loses accuracy, per class and per many / medium / few group.

For each configuration of the report whose run logged multi-class predictions
(``predictions/{split}_predictions.npz``): the accuracy, the mean per-class accuracy of each group of classes
with a 95% bootstrap CI (resampling the test cases), and the accuracy of each class
(:mod:`lungcal.calibration.class_accuracy`). The groups are MiSLAS's index ranges for CIFAR-10-LT
(many: classes 0-2, 4,500-1,796 training images; medium: 3-6, 1,077-232; few: 7-9, 139-50); other
datasets get the per-class table only.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lungcal.calibration.class_accuracy import group_accuracy, per_class_accuracy
from lungcal.study.differences import load_predictions
from lungcal.study.sections import Config
from lungcal.tracking.names import predictions_artifact

__all__ = ["GROUPS", "class_lines"]

#: class groups per dataset: MiSLAS's head / medium / tail class-index ranges for CIFAR-10-LT
GROUPS: dict[str, dict[str, tuple[int, ...]]] = {
    "cifar10lt": {"many": (0, 1, 2), "medium": (3, 4, 5, 6), "few": (7, 8, 9)},
}


def _span(classes: Sequence[int]) -> str:
    return f"{min(classes)}-{max(classes)}" if len(classes) > 1 else str(classes[0])


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _pct(v: float, digits: int = 2) -> str:
    return "" if np.isnan(v) else f"{100 * v:.{digits}f}"


def class_lines(client, configs: Sequence[Config], split: str = "test", n_bootstrap: int = 1000,
                groups: Mapping[str, Mapping[str, Sequence[int]]] | None = None) -> list[str]:
    """Markdown lines of the section (one group table and one per-class table per dataset)."""
    groups = GROUPS if groups is None else groups
    lines = [f"## Accuracy by class ({split})", "",
             "Accuracy in %. A group's accuracy is the mean of its classes' accuracies, with a 95% bootstrap CI "
             f"({n_bootstrap} resamples of the {split} cases).", ""]
    datasets = list(dict.fromkeys(c.dataset for c in configs))
    if not datasets:
        return lines + ["No configuration to show.", ""]
    for dataset in datasets:
        rows, per_class, skipped, width = [], [], [], 0
        grp = {k: tuple(v) for k, v in groups.get(dataset, {}).items()}
        for cfg in (c for c in configs if c.dataset == dataset):
            found = load_predictions(client, cfg.run_id, split)
            if found is None or np.ndim(found[1]) != 2:
                skipped.append(cfg.label)
                continue
            _, probs, labels = found
            pred = probs.argmax(1)
            acc = per_class_accuracy(pred, labels, n_classes=probs.shape[1])
            width = max(width, len(acc))
            cells = []
            if grp:
                g = group_accuracy(pred, labels, grp, n_bootstrap=n_bootstrap)
                cells = [f"{_pct(g[k]['acc'])} [{_pct(g[k]['ci_low'])}, {_pct(g[k]['ci_high'])}]" for k in grp]
            rows.append(_row([cfg.label, str(len(labels)), _pct(float((pred == labels).mean())), *cells]))
            per_class.append(_row([cfg.label, *(_pct(a, 1) for a in acc)]))
        lines += [f"### {dataset}", ""]
        if rows:
            lines += [_row(["configuration", "n", "ACC", *(f"{k} ({_span(v)})" for k, v in grp.items())]),
                      "|---|---|---|" + "---|" * len(grp), *rows, ""]
            if grp:
                lines += ["Groups: " + "; ".join(f"{k} = classes {_span(v)}" for k, v in grp.items())
                          + " (MiSLAS's many / medium / few).", ""]
            lines += [_row(["configuration", *map(str, range(width))]),
                      "|---|" + "---|" * width, *per_class, ""]
        if skipped:
            lines += [f"No multi-class {predictions_artifact(split, 'npz')} (left out): " + ", ".join(skipped) + ".",
                      ""]
    return lines
