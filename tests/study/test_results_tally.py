"""The tally at the top of docs/results.md counts the verdicts of its table (they must not drift apart)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results.md"
VERDICTS = ("not reproduced", "not run", "not graded", "direction only", "reproduced")


def _verdicts(text: str) -> Counter:
    start = text.index("| finding | paper | ours: 95% CI (command) | verdict |")
    table = text[start:text.index("\n\n", start)]
    counts: Counter = Counter()
    for line in table.splitlines()[2:]:
        if line.startswith("| **"):  # a section row
            continue
        verdict = line.rstrip(" |").split(" | ")[-1].lower()
        counts[next(v for v in VERDICTS if verdict.startswith(v))] += 1
    return counts


def test_the_tally_line_counts_the_verdict_table():
    text = RESULTS.read_text()
    counts = _verdicts(text)
    tally = re.search(r"\*\*Tally of the (\d+) claims graded below: (\d+) reproduced, (\d+) direction only, "
                      r"(\d+) not reproduced, (\d+) not run, (\d+) not graded", text)
    assert tally is not None
    total, rep, direction, notrep, notrun, notgraded = map(int, tally.groups())
    assert (rep, direction, notrep, notrun, notgraded) == (counts["reproduced"], counts["direction only"],
                                                            counts["not reproduced"], counts["not run"],
                                                            counts["not graded"])
    assert total == sum(counts.values())
