"""The README and docs/ point only at what the repository has: every link and every path
they name exists, nothing cites a document outside the repository, and the README stays a
page a user reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Documents this project's authors read that the repository does not hold.
OUTSIDE = re.compile(r"\.\./shared|\b(KNOBS|TPU7X|CPU|ACCELERATORS|GUIDE|INTEGRATION|DESIGN|"
                     r"STYLE)\.md\b")  # fmt: skip
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path of the repository named in prose or code spans: a folder of ours, then a file.
NAMED_PATH = re.compile(
    r"\b((?:sweeper|trainer|tests|benchmarks|docs|search_spaces|results)/[\w./-]+\.(?:py|md|yaml|csv|json|txt|log))"
)


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_points_at_a_file_of_the_repository(page):
    missing = [t for t in _links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert missing == [], f"{page.name} links to files that do not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page):
    named = set(NAMED_PATH.findall(page.read_text()))
    missing = sorted(p for p in named if not (REPO / p).exists() and "*" not in p)
    assert missing == [], f"{page.name} names paths that do not exist"


def test_nothing_cites_a_document_outside_the_repository():
    files = [*PAGES, *REPO.glob("sweeper/**/*.py"), *REPO.glob("trainer/**/*.py"),
             *REPO.glob("tests/*.py"), *REPO.glob("benchmarks/*.py"),
             *REPO.glob("results/*/README.md")]  # fmt: skip
    cited = [
        f"{path.relative_to(REPO)}:{n}"
        for path in files
        if path.name != "test_docs.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert cited == [], "copy the facts into docs/facts.md and cite that"


def test_the_readme_is_a_page_a_user_reads():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move evidence to docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert "## Two commands" in headings
    assert any(line.strip().startswith("make run") for line in lines)
    assert any(line.strip().startswith("make test") for line in lines)
