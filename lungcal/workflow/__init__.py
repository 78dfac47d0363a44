"""The tracked-run skeleton that the CT application (``lungcal.ctapp``) and ``cifar_baselines`` share (a layer both
may import).

- ``stage1.py``: :class:`TrackedStage1` (open or resume -> train -> evaluate -> post-hoc child runs ->
  paired differences -> summary), the settings it takes from a bundle (:class:`Store`, :class:`Evaluation`);
- ``summary.py``: the lines a run prints when it ends.
- ``stages.py``: the lines a run logs as each stage starts and ends, and its ``[plan]`` line.
"""
from lungcal.workflow.stage1 import (
    Evaluation,
    PostHocResult,
    SplitScores,
    Store,
    TrackedStage1,
    post_hoc_runs,
    prevalence,
)
from lungcal.workflow.summary import CIFAR_COLUMNS, CT_COLUMNS, post_hoc_lines, summary_lines, with_ci

__all__ = ["Evaluation", "PostHocResult", "SplitScores", "Store", "TrackedStage1", "post_hoc_runs", "prevalence",
           "CIFAR_COLUMNS", "CT_COLUMNS", "post_hoc_lines", "summary_lines", "with_ci"]
