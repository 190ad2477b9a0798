"""The README is a landing page and the guides in docs/ hold the rest: the README stays
short, links every guide, and every relative link of the pages resolves, anchors included."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *GUIDES, ROOT / "experiments" / "README.md", ROOT / "tests" / "PROMISES.md",
         *sorted((ROOT / "examples").glob("*/README.md"))]


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks, whose brackets are code, not links."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _prose(page.read_text()), re.M)}


def test_the_readme_is_a_landing_page_of_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_every_guide():
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", README.read_text()))
    assert len(GUIDES) >= 8
    assert {f"docs/{g.name}" for g in GUIDES} == linked


def test_every_relative_link_of_the_pages_resolves():
    broken = []
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not this repository's
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists() or (anchor and file.suffix == ".md"
                                     and anchor not in _anchors(file)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked > 50
    assert not broken, broken
