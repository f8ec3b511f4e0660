"""The README and docs/ stay linked: every relative link points at a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings."""
    anchors = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == [], broken


def test_the_readme_maps_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert {p.name for p in PAGES[1:]} == set(re.findall(r"\]\(docs/([\w-]+\.md)\)", readme))
