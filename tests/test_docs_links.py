"""The docs' links resolve: every relative link of README.md and docs/ names a file that exists, and every
``#anchor`` a heading of that file (GitHub's slugs). The record lives on several pages under docs/results/ that
link each other and the summary, so a moved or renamed entry must not leave a dead link."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's heading slugs of a page's ``text`` (lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``,
    a repeated slug numbered), headings inside code fences left out."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fence = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6} (.*)$", line)
        if m:
            s = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            seen[s] = seen.get(s, -1) + 1
            out.add(s if seen[s] == 0 else f"{s}-{seen[s]}")
    return out


def test_the_slugs_follow_github():
    assert anchors("## 2026-12-07: the headline's defaults (issue 43 item 4; `2910c11`)\n## A\n## A") == {
        "2026-12-07-the-headlines-defaults-issue-43-item-4-2910c11", "a", "a-1"}


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(md: Path):
    dead = []
    for m in LINK.finditer(md.read_text(encoding="utf-8")):
        url = m.group(1)
        if re.match(r"^(https?:|mailto:)", url):
            continue
        path, _, anchor = url.partition("#")
        target = (md.parent / path).resolve() if path else md
        if not target.exists():
            dead.append(f"{url}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text(encoding="utf-8")):
            dead.append(f"{url}: no such heading")
    assert not dead, f"{md.relative_to(ROOT)}: " + "; ".join(dead)
