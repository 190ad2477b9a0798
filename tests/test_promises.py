"""tests/PROMISES.md maps every promise of the README and docs/ to the tests that check
it: each test it names must exist, and each page it names, so the map cannot point at a
test or page that was renamed or removed."""

import re
from pathlib import Path

TESTS = Path(__file__).parent


def test_every_test_the_promises_name_exists():
    text = (TESTS / "PROMISES.md").read_text()
    named = re.findall(r"`(test_\w+\.py)(?:::(test_\w+))?`", text)
    assert len(named) > 80
    missing = []
    for module, function in named:
        path = TESTS / module
        if not path.is_file() or (function and not re.search(
                rf"^def {function}\(", path.read_text(), re.M)):
            missing.append(f"{module}::{function}" if function else module)
    assert not missing, f"PROMISES.md names tests that do not exist: {missing}"


def test_every_section_names_the_pages_its_promises_live_on():
    """Each section of PROMISES.md links the README or the guide in docs/ that makes its
    promises, and each page it links exists."""
    text = (TESTS / "PROMISES.md").read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert len(sections) >= 10
    for heading in sections:
        pages = re.findall(r"\]\(\.\./((?:docs/[\w-]+|README)\.md)\)", heading)
        assert pages, f"PROMISES.md section names no page: {heading}"
        for page in pages:
            assert (TESTS.parent / page).is_file(), f"{heading}: {page} does not exist"
