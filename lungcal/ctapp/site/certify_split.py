"""May this split certify a site's threshold? Not if the CTs in it trained the model or chose its checkpoint.

A threshold's guarantee (:mod:`lungcal.ctapp.site.threshold`) treats the network's score as fixed before the
certify split was drawn. A stage-1 run keeps the epoch with the best val AUC (``best.pt``): the val CTs chose
the weights, so their cancers tend to score better than the population's, and a threshold certified on them
promises more than it keeps. The fine-tune route (``--init_run_id`` on the site's datalist, then ``lungcal
recalibrate --miss-rate``) did exactly that, on the same val split.

:func:`certify_check` decides before anything is scored:

- the stage-1 run logged which CTs made its checkpoint (``data/selection.json``,
  :func:`lungcal.ctapp.model.checkpoint.selection_record`): any subject of the certify split among them
  (val: chose the checkpoint; train: trained it) is **refused** (ConfigError, exit 2). A known-void guarantee
  is not stored, because ``predict --site`` would state it on every CT; a warning could not stop that. The
  way out is named: ``--certify-split test`` (the split the run never chose on; nothing is then left to
  check the threshold), or a datalist whose val split holds site CTs outside the run's train and val;
- an older run without that record, trained on this very datalist (the same sha256): its val split chose the
  checkpoint and its train split trained it, so certifying on either is refused the same way;
- what cannot be checked (a checkpoint file, an older run trained on another datalist) goes on with a warning
  in the summary and ``guarantee.json``: refusing it would block the reference-model route, where certifying on
  the site's val split is valid (the model never saw the site).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lungcal.ctapp.model.checkpoint import Stage1Model
from lungcal.errors import ConfigError
from lungcal.tracking import file_digest, run_selection

__all__ = ["CertifyCheck", "certify_check"]

#: the stage-1 run's param holding its datalist's digest (:func:`lungcal.tracking.file_digest`)
DATALIST_DIGEST_PARAM = "datalist.sha256"


@dataclass(frozen=True)
class CertifyCheck:
    """Whether the certify split was checked against the CTs that made the checkpoint (``checked``), and what was
    found or why it could not be checked (``note``, one sentence)."""

    checked: bool
    note: str


def _refuse(split: str, model: str, why: str, datalist: str | Path) -> ConfigError:
    other = "test" if split != "test" else "val"
    return ConfigError(
        f"the {split} split cannot certify the threshold: {why}; a threshold certified on CTs that chose or trained "
        "the model has no valid guarantee (its cancers score better than the population's)", file=datalist,
        field="--certify-split",
        fix=f"certify on CTs model {model} never saw: --certify-split {other} (if it holds enough cancers; nothing "
            "is then left to check the threshold), or a datalist whose val split holds site CTs outside the run's "
            "train and val splits")


def certify_check(stage1: Stage1Model, rows: Sequence[Mapping[str, Any]], split: str, datalist: str | Path,
                  tracking_uri: str) -> CertifyCheck:
    """Check that no CT of ``rows`` (the certify split ``split`` of ``datalist``) trained ``stage1`` or chose its
    checkpoint (module doc); raises ConfigError when some did."""
    subjects = {str(r.get("subject")) for r in rows}
    run = stage1.run
    if run is None:
        return CertifyCheck(False, f"the model is a checkpoint file: whether its checkpoint was chosen on (or "
                                   f"trained on) these {split} CTs could not be checked; the guarantee holds only if "
                                   "it was not (a model trained elsewhere)")
    run_id = run.info.run_id
    record = run_selection(tracking_uri, run_id)
    if record is not None:
        chose, trained = subjects & set(record.get("val", ())), subjects & set(record.get("train", ()))
        if chose or trained:
            parts = ([f"{len(chose)} of its {len(subjects)} subjects chose run {run_id}'s checkpoint "
                      f"({record.get('selected_by', 'its best val epoch')})"] if chose else [])
            parts += [f"{len(trained)} trained it"] if trained else []
            raise _refuse(split, run_id, " and ".join(parts), datalist)
        return CertifyCheck(True, f"none of the {len(subjects)} {split} subjects trained model {run_id} or chose its "
                                  "checkpoint (its data/selection.json)")
    same = run.data.params.get(DATALIST_DIGEST_PARAM) == file_digest(datalist)
    if same and split in ("train", "val"):
        role = "chose its checkpoint (best val AUC)" if split == "val" else "trained it"
        raise _refuse(split, run_id, f"run {run_id} was trained on this datalist (the same sha256), so its {split} "
                                     f"split {role}", datalist)
    if same:
        return CertifyCheck(True, f"run {run_id} was trained on this datalist and chose its checkpoint on val; the "
                                  f"{split} split did neither")
    return CertifyCheck(False, f"run {run_id} logged no record of the CTs that made its checkpoint (a run made before "
                               f"2026-12-06) and was trained on another datalist: whether these {split} CTs chose or "
                               "trained it could not be checked; the guarantee holds only if they did neither")
