"""Keep the documented examples executable.

pytest runs every ``>>>`` example of ``docs/*.md`` as a doctest (see ``addopts`` in
pyproject.toml). A fenced Python block written as a plain script would silently escape
that, and its printed outputs could drift from the truth; these tests fail on such a
block in any page, on a page that should show an example and shows none, and on a
configuration that stops collecting the pages. The README's blocks are the other way
round, scripts a reader copies without prompts: each runs here as a script.
"""

from __future__ import annotations

import doctest
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
PAGES_WITH_EXAMPLES = [
    "docs/index.md",
    "docs/getting-started.md",
    "docs/concepts.md",
    "docs/migrating.md",
    "docs/checkpointing.md",
    "docs/schedulers.md",
    "docs/amp.md",
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
    assert "docs" in pytestconfig.getini("testpaths")


def test_readme_quick_start_runs_as_copied(tmp_path: Path) -> None:
    """The README's Python blocks are scripts without prompts; the quick start trains,
    prints the last pre-clip norm and saves a checkpoint that loads as torch allows."""
    blocks = python_blocks("README.md")
    assert blocks, "README.md shows no Python example"
    for line, body in blocks:
        assert not doctest.DocTestParser().get_examples(body), (
            f"README.md:{line}: a >>> prompt in a block readers copy; doctests go in docs/"
        )
        script = tmp_path / f"readme_{line}.py"
        script.write_text(body, encoding="utf-8")
        run = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True
        )
        assert run.returncode == 0, f"README.md:{line}:\n{run.stderr}"
    printed = re.fullmatch(r"last pre-clip norm: ([\d.]+)\n", run.stdout)
    assert printed, run.stdout
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert sorted(saved) == ["clip", "param_groups", "state"]
    assert int(saved["clip"]["step_count"]) == 100
    assert float(printed[1]) == pytest.approx(float(saved["clip"]["last_norm"]), abs=5e-4)


# clipopt.distributed's user API.
DISTRIBUTED_USER_API = ["ClippedOptimizerState"]
REFERENCE = re.compile(r"^::: (\S+)$", re.MULTILINE)


def test_api_reference_documents_every_public_name() -> None:
    import clipopt
    import clipopt.distributed

    documented = REFERENCE.findall((ROOT / "docs" / "api.md").read_text(encoding="utf-8"))
    public = [f"clipopt.{name}" for name in clipopt.__all__ if name != "distributed"]
    public += [f"clipopt.distributed.{name}" for name in DISTRIBUTED_USER_API]
    assert sorted(public) == sorted(documented)
    for name in DISTRIBUTED_USER_API:
        assert name in clipopt.distributed.__all__


def test_every_page_is_in_the_site_nav() -> None:
    """mkdocs --strict fails on a page left out of the nav too; this says which, quickly."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    listed = set(re.findall(r"^ +- [^:#]+: (\S+\.md)$", nav, re.MULTILINE))
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}
