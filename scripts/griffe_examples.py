"""A Griffe extension for the docs site (mkdocs.yml, mkdocstrings' ``extensions``).

clipopt's docstrings head their doctests ``Example:``. Griffe's Google-style parser
knows only ``Examples:`` as the section whose ``>>>`` lines are code; under any other
title the lines are Markdown, where ``>>>`` is a triply nested quote, and the page shows
the example as run-together prose. This retitles the section before it is parsed; the
docstrings, and what ``help()`` and the doctests see, are unchanged.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
