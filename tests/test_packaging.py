"""Package metadata: one version, the licence, and a changelog entry for it.

``make dist`` builds the sdist and the wheel and checks them in a fresh venv
(``scripts/check_dist.sh``); these check what the installed metadata says.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import clipopt

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_written_once_and_the_metadata_reads_it() -> None:
    assert importlib.metadata.version("clipopt") == clipopt.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'version = { attr = "clipopt.__version__" }' in pyproject
    assert "\nversion = " not in pyproject.split("[tool.setuptools.dynamic]")[0]


def test_licence_and_changelog() -> None:
    metadata = importlib.metadata.metadata("clipopt")
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in changelog
    assert f"## {clipopt.__version__}" in changelog
