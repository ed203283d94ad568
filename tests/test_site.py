"""The built documentation site, read as a browser would: every page has a title, every
image and internal link resolves, and nothing is fetched from outside the site.

``mkdocs build --strict`` (run here once, into a temporary folder) already fails on a
broken Markdown link or anchor; what it does not check is the HTML the theme adds
around the pages (fonts, scripts, icons) and the links the API reference generates.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = re.compile(r"^([a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)""")
LOADED = {("img", "src"), ("script", "src"), ("source", "src"), ("link", "href")}


class Page(HTMLParser):
    """The parts of one HTML page the checks read."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.ids: set[str] = set()
        self.loads: list[str] = []  # what a browser fetches to show the page
        self.links: list[str] = []  # what a reader can click
        self.styles: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value for name, value in attrs if value is not None}
        if tag in ("h1", "h2", "h3", "h4", "h5", "h6"):
            self.headings.append(tag)
        if "id" in values:
            self.ids.add(values["id"])
        for name, value in values.items():
            if (tag, name) in LOADED:
                self.loads.append(value)
            elif tag == "a" and name == "href":
                self.links.append(value)
            elif name == "style":
                self.styles.append(value)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stderr
    return out


@pytest.fixture(scope="module")
def pages(site: Path) -> dict[Path, Page]:
    """Every built page, parsed once for all the checks."""
    parsed = {}
    for path in sorted(site.rglob("*.html")):
        page = Page()
        page.feed(path.read_text(encoding="utf-8"))
        parsed[path] = page
    return parsed


def target(site: Path, page: Path, url: str) -> tuple[Path, str]:
    """The file and fragment a relative URL in ``page`` points at."""
    parts = urlsplit(url)
    base = site if parts.path.startswith("/") else page.parent  # 404.html's are absolute
    path = (base / unquote(parts.path).lstrip("/")).resolve() if parts.path else page
    if path.is_dir():
        path = path / "index.html"
    return path, parts.fragment


def test_every_page_has_one_title(site: Path, pages: dict[Path, Page]) -> None:
    for path, page in pages.items():
        if path.name == "404.html":
            continue
        assert page.headings.count("h1") == 1, f"{path.relative_to(site)}: {page.headings}"


def test_nothing_is_fetched_from_outside_the_site(site: Path, pages: dict[Path, Page]) -> None:
    """Fonts, scripts, stylesheets and images come with the site (or the system): the
    docs read offline, and no third party learns who reads them. Links a reader clicks
    may go outside (none do today)."""
    for path, page in pages.items():
        fetched = page.loads + [url for style in page.styles for url in CSS_URL.findall(style)]
        outside = [url for url in fetched if OUTSIDE.match(url)]
        assert not outside, f"{path.relative_to(site)} fetches {outside}"
    for sheet in site.rglob("*.css"):
        urls = CSS_URL.findall(sheet.read_text(encoding="utf-8"))
        assert not [url for url in urls if OUTSIDE.match(url)], f"{sheet}: {urls}"
        assert "@import" not in sheet.read_text(encoding="utf-8"), sheet


def test_every_image_and_internal_link_resolves(site: Path, pages: dict[Path, Page]) -> None:
    broken = []
    for path, page in pages.items():
        for url in page.loads + page.links:
            if OUTSIDE.match(url) or url.startswith(("mailto:", "data:", "javascript:")):
                continue
            file, fragment = target(site, path, url)
            if not file.is_file():
                broken.append(f"{path.relative_to(site)}: {url} (no file)")
            elif fragment and file in pages and fragment not in pages[file].ids:
                broken.append(f"{path.relative_to(site)}: {url} (no anchor)")
    assert not broken, "\n".join(broken)


def test_the_home_page_shows_the_figure_and_the_install(
    site: Path, pages: dict[Path, Page]
) -> None:
    home = pages[site / "index.html"]
    assert "img/adaptive-thresholds.png" in home.loads
    text = re.sub(r"<[^>]+>", "", (site / "index.html").read_text(encoding="utf-8"))
    assert "pip install" in text
