"""Keep the documented examples executable.

pytest runs every ``>>>`` example of ``README.md`` and ``docs/*.md`` as a doctest (see
``addopts`` in pyproject.toml). A fenced Python block written as a plain script would
silently escape that, and its printed outputs could drift from the truth; these tests
fail on such a block in any page, on a page that should show an example and shows
none, and on a configuration that stops collecting the pages.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PAGES_WITH_EXAMPLES = [
    "README.md",
    "docs/index.md",
    "docs/functional.md",
    "docs/optimizer.md",
    "docs/distributed.md",
    "docs/integrations.md",
    "docs/adaptive.md",
]
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(page: str) -> list[tuple[int, str]]:
    """(line number, body) of each fenced block marked python, py or pycon."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [
        (text[: match.start()].count("\n") + 1, match["body"])
        for match in FENCE.finditer(text)
        if match["lang"] in ("python", "py", "pycon")
    ]


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES)
def test_page_shows_an_example(page: str) -> None:
    assert python_blocks(page), f"{page} shows no Python example"


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_is_a_doctest(page: str) -> None:
    for line, body in python_blocks(page):
        examples = doctest.DocTestParser().get_examples(body)
        assert examples, f"{page}:{line}: a Python block without >>> is never executed"
        assert body.endswith("\n\n"), (
            f"{page}:{line}: leave a blank line before the closing fence, "
            "or doctest reads the fence as expected output"
        )


def test_pytest_collects_the_markdown_doctests(pytestconfig: pytest.Config) -> None:
    assert "--doctest-glob=*.md" in pytestconfig.getini("addopts")
    assert {"docs", "README.md"} <= set(pytestconfig.getini("testpaths"))
