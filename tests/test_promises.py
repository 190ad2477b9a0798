"""tests/PROMISES.md maps every README promise to the tests that check it: each test it
names must exist, so the map cannot point at a test that was renamed or removed."""

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
