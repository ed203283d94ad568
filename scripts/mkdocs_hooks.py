"""MkDocs hooks for the docs site (mkdocs.yml ``hooks:``).

clipopt's docstrings mark names with Sphinx roles (``:func:`clip_grad_norm_```), which
``help()`` and IDEs show as they are, but which mkdocstrings' Google-style parser leaves
in the rendered page as literal ``:func:`` text before the code span. This drops the
role and keeps the code span.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:func|class|meth|attr|mod|exc|data|obj|py:\w+):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return ROLE.sub("", html)
