"""The documentation site builds in strict mode, and the built HTML holds up.

The strict build fails on a broken cross-reference, a docstring that does not
match its signature, a missing page or a link to a missing anchor in a
Markdown page. The checks of the built HTML (``site_problems``) catch what
the build does not see: a link or anchor that does not resolve in a rendered
notebook, a navigation title that differs from its page's title (a title cut
at inline code), a sidebar whose first entry repeats its title (the site's
name), an API entry for a dunder or a NamedTuple internal, a public
name that the search cannot find, a duplicated heading, and reST's ``::``
left in a rendered docstring. Each check is shown to fail on a site with
that defect planted.
"""

from __future__ import annotations

import html.parser
import json
import os
import pathlib
import posixpath
import re
import shutil
import subprocess
import sys
from urllib.parse import unquote, urlsplit

import pytest

ROOT = pathlib.Path(__file__).parents[1]
pytest.importorskip("mkdocs")

SITE_NAME = re.search(r"^site_name: (.+)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)[1].strip()
# The home page's title is the README's, the site's name, which the sidebar
# already shows as its title: the navigation names it this instead.
HOME_ENTRY = "Home"

# Dunder methods that may have an entry, when documented: the protocols a
# user calls through syntax.
PROTOCOL_METHODS = {"__call__", "__getattr__", "__getitem__", "__iter__", "__len__", "__contains__"}


def build(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        cwd=root,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "", "HOME": str(site.parent)},
        timeout=300,
    )


def public_identifiers() -> list[str]:
    """Every public name: ``loss_scale.__all__``, the presets, and the flax
    and Equinox modules' ``__all__``."""
    import loss_scale
    import loss_scale.equinox
    import loss_scale.flax
    import loss_scale.presets

    return [
        f"{module.__name__}.{name}"
        for module in (loss_scale, loss_scale.presets, loss_scale.flax, loss_scale.equinox)
        for name in module.__all__
        if name != "presets"
    ]


class Page(html.parser.HTMLParser):
    """What the checks read from one built page."""

    VOID = {"area", "br", "col", "hr", "img", "input", "link", "meta", "source", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.nav: list[tuple[str, str]] = []  # (href, text) of the site navigation's links to pages
        self.headings: list[tuple[str, str]] = []  # (tag, id)
        self.entries: list[str] = []  # the ids of the API entries (mkdocstrings' headings)
        self.h1 = ""
        self.title = ""
        self.paragraphs: list[str] = []
        self.sidebar: tuple[str, str] | None = None  # the primary sidebar's title and first entry
        self._open: list[str] = []  # the elements whose text is being collected: h1, title, p, nav
        self._text: dict[str, list[str]] = {}
        self._nav_href = ""
        self._hidden = 0  # depth inside a heading's permalink (its text is not the heading's)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "a" and attrs.get("href") is not None:
            self.links.append(attrs["href"])
            if "md-nav__link" in classes and not attrs["href"].startswith("#"):
                self._nav_href = attrs["href"]
                self._text["nav"] = []
        if re.fullmatch(r"h[1-6]", tag) and attrs.get("id"):
            self.headings.append((tag, attrs["id"]))
            if "doc-heading" in classes:
                self.entries.append(attrs["id"])
        if tag in self.VOID:
            return
        if self._hidden or {"headerlink", "anchor-link"} & set(classes):
            self._hidden += 1
        if tag in ("h1", "title", "p") and tag not in self._text:
            self._text[tag] = []

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if self._hidden:
            self._hidden -= 1
            return
        if tag == "a" and self._nav_href:
            self.nav.append((self._nav_href, " ".join("".join(self._text.pop("nav")).split())))
            self._nav_href = ""
        if tag in ("h1", "title", "p") and tag in self._text:
            text = " ".join("".join(self._text.pop(tag)).split())
            if tag == "h1":
                self.h1 = self.h1 or text
            elif tag == "title":
                self.title = text
            else:
                self.paragraphs.append(text)

    def handle_data(self, data):
        if not self._hidden:
            for parts in self._text.values():
                parts.append(data)


def read_site(site: pathlib.Path) -> dict[str, Page]:
    """``{url path: Page}`` of every built page (``api/state/`` for
    ``api/state/index.html``)."""
    pages = {}
    for path in sorted(site.rglob("*.html")):
        relative = path.relative_to(site).as_posix()
        url = relative[: -len("index.html")] if relative.endswith("index.html") else relative
        page, content = Page(), path.read_text(encoding="utf-8")
        page.feed(content)
        page.sidebar = sidebar_head(content)
        pages[url] = page
    return pages


def _target(url: str, href: str) -> tuple[str, str] | None:
    """The site path and anchor an internal link points to, or ``None`` for
    an external one."""
    parts = urlsplit(href)
    if parts.scheme or parts.netloc or href.startswith("//"):
        return None
    path = posixpath.normpath(posixpath.join(posixpath.dirname(url) or ".", unquote(parts.path))) if parts.path else url
    path = "" if path == "." else path
    if parts.path.endswith("/") and path:
        path += "/"
    return path, unquote(parts.fragment)


def repeated_headings(headings: list[tuple[str, str]]) -> list[str]:
    """The ids of headings that repeat a sibling's text: Markdown's table of
    contents makes the second ``name_1`` (a changelog's "Added" under each
    version is not a repeat)."""
    repeated, parents, seen = [], [], set()
    for tag, id_ in headings:
        level = int(tag[1])
        parents = [(lvl, i) for lvl, i in parents if lvl < level]
        base = re.sub(r"_\d+$", "", id_)
        key = (parents[-1][1] if parents else "", level, base)
        if key in seen:
            repeated.append(base)
        seen.add(key)
        parents.append((level, id_))
    return repeated


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def sidebar_head(content: str) -> tuple[str, str] | None:
    """The primary sidebar's title and the text of its first entry, in a
    page's HTML, or ``None`` when the page has no such sidebar."""
    start = content.find('<nav class="md-nav md-nav--primary')
    if start < 0:
        return None
    # The sidebar's first label is its title, its first link (or label, for
    # the page being read) its first entry.
    title = re.compile(r'<label class="md-nav__title"[^>]*>(.*?)</label>', re.S).search(content, start)
    entry = re.compile(r'class="md-nav__link[^"]*"[^>]*>(.*?)</(?:a|label)>', re.S).search(content, start)
    if title is None or entry is None:
        return None
    return _text(title[1]), _text(entry[1])


def site_problems(site: pathlib.Path) -> list[str]:
    """What is wrong with the built site at ``site``, one line each."""
    pages = read_site(site)
    problems = []
    for url, page in pages.items():
        if url == "404.html":
            continue
        where = url or "/"
        for href in page.links:
            target = _target(url, href)
            if target is None:
                continue
            path, anchor = target
            if path in pages or (path + "/") in pages:
                linked = pages.get(path) or pages[path + "/"]
                if anchor and anchor not in linked.ids:
                    problems.append(f"{where}: the link {href!r} points to an anchor that does not exist")
            elif not (site / path).is_file() and not (site / path / "index.html").is_file():
                problems.append(f"{where}: the link {href!r} points to nothing")
        for href, text in page.nav:
            target = _target(url, href)
            if target is None or target[0] not in pages:
                continue
            if not target[0]:
                if text != HOME_ENTRY:
                    problems.append(f"{where}: the navigation names the home page {text!r}, not {HOME_ENTRY!r}")
                continue
            h1, name = pages[target[0]].h1, target[0]
            if text != h1:
                problems.append(f"{where}: the navigation names {name} {text!r}, its title is {h1!r}")
        if page.sidebar and page.sidebar[0] == page.sidebar[1]:
            problems.append(f"{where}: the sidebar's first entry repeats its title {page.sidebar[0]!r}")
        if page.title and page.h1 and url and page.title != f"{page.h1} - {SITE_NAME}":
            problems.append(f"{where}: the window title {page.title!r} is not the page's title {page.h1!r}")
        for entry in page.entries:
            name = entry.rpartition(".")[2]
            if name.startswith("__") and name not in PROTOCOL_METHODS:
                problems.append(f"{where}: an API entry for {entry}")
        for heading in repeated_headings(page.headings):
            problems.append(f"{where}: the heading {heading!r} appears twice in the same section")
        for paragraph in page.paragraphs:
            if paragraph.endswith("::"):
                problems.append(f"{where}: reST's '::' left in {paragraph[-80:]!r}")
    index = json.loads((site / "search" / "search_index.json").read_text())
    located = {doc["location"].rpartition("#")[2]: doc for doc in index["docs"]}
    for identifier in public_identifiers():
        if identifier not in located:
            problems.append(f"the search does not find {identifier}")
    for identifier, doc in located.items():
        name = identifier.rpartition(".")[2]
        if name in PROTOCOL_METHODS and not doc["text"].strip():
            problems.append(f"an undocumented entry for {identifier}")
    return problems


def built_site(tmp_path_factory) -> pathlib.Path:
    """The site built once for the whole test run: this file's checks and the
    browser's (``tests/test_docs_browser.py``) read the same build. Under
    pytest-xdist the workers share it through their common temporary
    directory, the first to get the lock building it."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    site, done = base / "docs-site" / "site", base / "docs-site" / "built"
    with open(base / "docs-site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            result = build(ROOT, site)
            assert result.returncode == 0, result.stderr[-3000:]
            done.touch()
    return site


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    return built_site(tmp_path_factory)


def test_the_site_builds_in_strict_mode(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    assert {"api/transformations/index.html", "notebooks/02_train_with_flax/index.html"} <= pages
    assert {f"guides/{p.stem}/index.html" for p in (ROOT / "docs" / "guides").glob("*.md")} <= pages
    # The keyword options are documented on each factory (attached at import time).
    html_text = (site / "api" / "transformations" / "index.html").read_text()
    assert "max_consecutive_skips" in html_text and "track_underflow" in html_text


def test_the_built_html_has_no_broken_link_and_no_internals(site):
    assert site_problems(site) == []


def test_signatures_are_formatted(site):
    """The formatter (ruff) splits long signatures: no line of a rendered
    signature is longer than the configured line length, give or take."""
    text = (site / "api" / "transformations" / "index.html").read_text()
    signatures = re.findall(r'<div class="doc-signature highlight"><pre>(.*?)</pre>', text, flags=re.S)
    assert signatures
    lines = [re.sub(r"<[^>]+>", "", line) for sig in signatures for line in sig.splitlines()]
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)


def test_fields_are_documented_as_fields(site):
    text = (site / "api" / "state" / "index.html").read_text()
    assert 'id="loss_scale.StepRecord.grad_max"' in text
    assert "Alias for field number" not in text and "_tuplegetter" not in text
    assert "the largest unscaled gradient magnitude" in text


def test_code_spans_link_to_the_api(site):
    text = (site / "guides" / "debugging" / "index.html").read_text()
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="[^"]*#loss_scale\.metrics"', text)


def _copy(site: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    planted = tmp_path / "planted"
    shutil.copytree(site, planted)
    return planted


def _edit(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_the_html_checks_fail_on_planted_defects(site, tmp_path):
    planted = _copy(site, tmp_path)
    guide = planted / "guides" / "debugging" / "index.html"
    _edit(guide, "<p>", '<p><a href="../update_rule/#nowhere">x</a> <a href="../../nowhere/">y</a> ')
    state = planted / "api" / "state" / "index.html"
    _edit(state, 'id="loss_scale.StepRecord.grad_max"', 'id="loss_scale.StepRecord.__annotations__"')
    _edit(state, "</article>", "<p>Run it as::</p></article>")
    search = planted / "search" / "search_index.json"
    docs = json.loads(search.read_text())
    docs["docs"] = [d for d in docs["docs"] if not d["location"].endswith("#loss_scale.scale_loss")]
    search.write_text(json.dumps(docs))
    problems = "\n".join(site_problems(planted))
    assert "'../update_rule/#nowhere' points to an anchor that does not exist" in problems
    assert "'../../nowhere/' points to nothing" in problems
    assert "an API entry for loss_scale.StepRecord.__annotations__" in problems
    assert "reST's '::' left in 'Run it as::'" in problems
    assert "the search does not find loss_scale.scale_loss" in problems


def test_a_nav_title_that_differs_from_the_page_fails(site, tmp_path):
    planted = _copy(site, tmp_path)
    pages = read_site(site)
    href, text = next((h, t) for h, t in pages[""].nav if "update_rule" in h)
    index = planted / "index.html"
    content = index.read_text()
    cut = text.rsplit(" ", 1)[0]  # a title cut at its last word, as at inline code
    new = re.sub(
        rf'(<a href="{re.escape(href)}" class="md-nav__link">\s*<span class="md-ellipsis">\s*){re.escape(text)}',
        rf"\g<1>{cut}",
        content,
        count=1,
    )
    assert new != content
    index.write_text(new)
    assert "/: the navigation names guides/update_rule/ " + f"{cut!r}, its title is {text!r}" in site_problems(planted)


def test_a_sidebar_that_repeats_its_title_fails(site, tmp_path):
    """The home page named by its title in the navigation: the sidebar's
    title (the site's name) and its first entry read the same."""
    planted = _copy(site, tmp_path)
    assert read_site(site)[""].sidebar == (SITE_NAME, HOME_ENTRY)
    path = planted / "guides" / "debugging" / "index.html"
    text = path.read_text()
    new = re.sub(rf"(<span class=\"md-ellipsis\">\s*){HOME_ENTRY}\b", rf"\g<1>{SITE_NAME}", text, count=1)
    assert new != text
    path.write_text(new)
    assert f"guides/debugging/: the sidebar's first entry repeats its title {SITE_NAME!r}" in site_problems(planted)


def test_a_duplicated_heading_fails(site, tmp_path):
    planted = _copy(site, tmp_path)
    page = read_site(site)["guides/debugging/"]
    tag, first = page.headings[1]
    path = planted / "guides" / "debugging" / "index.html"
    text = path.read_text()
    end = text.index(f"</{tag}>", text.index(f'id="{first}"')) + len(f"</{tag}>")
    path.write_text(text[:end] + f'<{tag} id="{first}_1">x</{tag}>' + text[end:])  # the same heading again
    assert f"guides/debugging/: the heading {first!r} appears twice in the same section" in site_problems(planted)


def test_a_broken_reference_or_anchor_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv*", "site", ".cache", "*.egg-info"))
    page = copy / "docs" / "api" / "gradients.md"
    page.write_text(page.read_text() + "\nSee [the nowhere function][loss_scale.nowhere].\n")
    guide = copy / "docs" / "guides" / "debugging.md"
    guide.write_text(guide.read_text() + "\nSee [the rule](update_rule.md#no-such-section).\n")
    result = build(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "loss_scale.nowhere" in result.stderr and "no-such-section" in result.stderr
