"""The sections of ``lungcal report`` and the configurations they are about.

- ``study``: the comparison tables (stage 1 x stage 2, beside the published numbers), referral at
  90% coverage and the study's paired differences (:mod:`lungcal.study.report`,
  :mod:`lungcal.study.differences`); the default;
- ``classes``: accuracy per class and per many / medium / few group (:mod:`lungcal.study.classes`);
- ``posthoc``: the post-hoc fixes of each CIFAR stage-1 run side by side, against its LAS runs
  (:mod:`lungcal.study.posthoc`).
"""
from __future__ import annotations

from typing import NamedTuple

from lungcal.errors import ConfigError

__all__ = ["SECTIONS", "DEFAULT_SECTIONS", "Config", "parse_sections"]

SECTIONS = ("study", "classes", "posthoc")
DEFAULT_SECTIONS = ("study",)


class Config(NamedTuple):
    """One configuration of the report: its dataset, methods, display label and latest finished run."""

    dataset: str
    stage1: str
    stage2: str
    label: str
    run_id: str


def parse_sections(text: str | None) -> tuple[str, ...]:
    """``"classes,posthoc"`` -> ``("classes", "posthoc")`` in :data:`SECTIONS` order; ``all``: every section."""
    if text is None or not str(text).strip():
        return DEFAULT_SECTIONS
    names = {s.strip().lower() for s in str(text).split(",") if s.strip()}
    if "all" in names:
        return SECTIONS
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown report section(s) {', '.join(unknown)}", field="--sections",
                          fix="choose from " + ", ".join(SECTIONS) + " or all, comma-separated")
    return tuple(s for s in SECTIONS if s in names)
