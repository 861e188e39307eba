"""The README and docs/ are where a newcomer starts: every link in them leads somewhere inside the
repository, the pages stay short enough to read, every system's page has the same sections, the
commands they give exist, and the repository speaks of the product, not of how it was worked on.

A link to a file that was moved, or to a heading that was reworded, fails silently on GitHub: the page
opens at its top, or not at all. Anchors are derived the way GitHub derives them (lower case, spaces to
hyphens, punctuation dropped, a numeric suffix for repeated headings).
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
SYSTEM_SECTIONS = ["What it is", "How to run", "Headline results", "Full results", "Decisions", "Limits and departures"]
# How the project was worked on, which belongs to git, not to the product: checked in every tracked file
# outside tests/ (pytest's scope="session" and a database session are product words, so only these forms).
PROCESS_WORDS = re.compile(
    r"\b(sessions? \d+|this session|(an?|the|by a) helper\b|a review found|reviewer|"
    r"closing note|issue \d+|issue #\d+|sprint|ticket)",
    re.IGNORECASE,
)
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


def broken_links(page: Path, root: Path = ROOT) -> list:
    bad = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):
            continue  # http(s), mailto: not checked offline
        path, _, frag = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if root not in target.parents and target != root:
            bad.append(f"{link}: leaves the repository")
        elif not target.exists():
            bad.append(f"{link}: no such file")
        elif frag and target.suffix == ".md" and frag not in anchors(target):
            bad.append(f"{link}: no heading with that anchor in {target.name}")
    return bad


def test_slug_matches_githubs_rule_on_this_projects_headings():
    assert (
        slug("DP at C = 0.01, lr 0.01 (`stress_private@dp-c1e-2-lr1e-2-p3`)")
        == "dp-at-c--001-lr-001-stress_privatedp-c1e-2-lr1e-2-p3"
    )
    assert (
        slug("UGSA's β: the paper's ablation, under each normaliser")
        == "ugsas-β-the-papers-ablation-under-each-normaliser"
    )


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# The cells (`x@y`)\n## The cells (`x@y`)\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#the-cells-xy) [second](docs/a.md#the-cells-xy-1) "
        "[gone](docs/b.md) [moved](docs/a.md#the-cell) [http](https://example.org/#x)"
    )
    assert [b.split(":")[0] for b in broken_links(page, tmp_path)] == ["docs/b.md", "docs/a.md#the-cell"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], f"{page.relative_to(ROOT)} has broken links"


def test_links_that_leave_the_repository_are_found(tmp_path):
    # Prepare: a folder beside the repository, as ../shared sits beside a checkout
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "a.md").write_text("# A\n")
    (repo / "README.md").write_text("# R\n")
    page = repo / "docs" / "x.md"
    page.write_text("[out](../../shared/a.md) [in](../README.md)")

    # Execute / Assert: the file exists, but a clone without the folder beside it would not have it
    assert broken_links(page, repo) == ["../../shared/a.md: leaves the repository"]


def test_the_readme_and_each_system_page_stay_short():
    assert (ROOT / "README.md").stat().st_size <= 15 * 1024
    for page in (ROOT / "docs" / "systems").glob("*.md"):
        assert page.stat().st_size <= 25 * 1024, f"{page.name} is over 25 KB"


def test_every_system_has_a_page_with_the_same_sections_in_the_same_order():
    from flows import systems

    for system in systems.all_systems():
        page = ROOT / system.page
        headings = [line[3:].strip() for line in page.read_text().splitlines() if line.startswith("## ")]
        assert headings == SYSTEM_SECTIONS, f"{system.page}: sections {headings}"


def test_no_tracked_file_outside_tests_speaks_of_how_the_project_was_worked_on():
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        if name.startswith("tests/") or name.endswith((".lock", ".png", ".npz")) or name == "LICENSE":
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_the_process_word_check_finds_what_it_should_and_spares_product_words():
    assert PROCESS_WORDS.search("measured in session 35") and PROCESS_WORDS.search("as issue 13 asked")
    assert PROCESS_WORDS.search("a review found two bugs") and PROCESS_WORDS.search("the helper's run")
    assert not PROCESS_WORDS.search('@pytest.fixture(scope="session")')
    assert not PROCESS_WORDS.search("with sqlalchemy's Session(engine) as session:")


def test_the_commands_the_readme_and_the_guides_give_exist():
    import subprocess

    from flows import stages

    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.MULTILINE))
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "extending.md").read_text()
    used = set(re.findall(r"`make ([a-z][\w-]*)", text)) | set(re.findall(r"^make ([a-z][\w-]*)", text, re.MULTILINE))
    assert used and used <= targets, f"make targets that do not exist: {sorted(used - targets)}"
    steps = set(re.findall(r"python -m flows\.stages ([a-z_]+)", text))
    assert steps
    known = set(stages.stage_steps()) | {"partition_toy", "toy", "rounds_toy"}  # the worked example's plug-in
    assert steps <= known, f"steps that do not exist: {sorted(steps - known)}"
    for module in set(re.findall(r"python -m (flows(?:\.\w+)+)", text)):
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, f"python -m {module} --help: {out.stderr[-300:]}"


def test_the_guide_shows_the_worked_examples_code_as_it_is():
    plugin = (ROOT / "tests" / "flows" / "example_plugin" / "__init__.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "extending.md").read_text(), re.DOTALL)
    assert len(blocks) == 3
    for block in blocks:
        assert block in plugin, f"docs/extending.md shows code the plug-in does not have:\n{block[:200]}"
