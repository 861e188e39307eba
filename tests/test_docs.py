"""The README and docs/ are where a newcomer starts: every relative link in them must lead somewhere.

A link to a file that was moved, or to a heading that was reworded, fails silently on GitHub: the page
opens at its top, or not at all. Anchors are derived the way GitHub derives them (lower case, spaces to
hyphens, punctuation dropped, a numeric suffix for repeated headings).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    return "".join("-" if ch == " " else ch for ch in heading.strip().lower() if ch in " -_" or ch.isalnum())


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset:
    seen, found, fenced = {}, set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            s = slug(m.group(1))
            found.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return frozenset(found)


def broken_links(page: Path) -> list:
    bad = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):
            continue  # http(s), mailto: not checked offline
        path, _, frag = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif frag and target.suffix == ".md" and frag not in anchors(target):
            bad.append(f"{link}: no heading with that anchor in {target.name}")
    return bad


def test_slug_matches_githubs_rule_on_this_projects_headings():
    assert slug("DP at C = 0.01, lr 0.01 (`stress_private@dp-c1e-2-lr1e-2-p3`)") == \
        "dp-at-c--001-lr-001-stress_privatedp-c1e-2-lr1e-2-p3"
    assert slug("UGSA's β: the paper's ablation, under each normaliser") == \
        "ugsas-β-the-papers-ablation-under-each-normaliser"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# The cells (`x@y`)\n## The cells (`x@y`)\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#the-cells-xy) [second](docs/a.md#the-cells-xy-1) "
                    "[gone](docs/b.md) [moved](docs/a.md#the-cell) [http](https://example.org/#x)")
    assert [b.split(":")[0] for b in broken_links(page)] == ["docs/b.md", "docs/a.md#the-cell"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} has broken links"
