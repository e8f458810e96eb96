"""Every page of the built documentation site reads at 1280 px, measured in a
real browser.

The site is built once (``tests/test_docs.py``'s ``built_site``), served on
127.0.0.1 and opened in headless Chromium, driven by selenium, at a
1280 px window. On every page, every table and every code block (the guides'
blocks, the API signatures, the notebooks' code cells and outputs) is
measured: its content's width (``scrollWidth``: a block that scrolls
horizontally inside its own box is clipped content) against the room the
page's text column leaves it, from its left edge to the column's right edge.
One wider than that by more than 10% is reported, with its page, kind and
both widths. The sidebar is checked too: the site's name is not repeated
as the first entry of the navigation. Each check is shown to fail on a page
with its defect planted (for the widths, the stylesheet rules that once
caused them).

Chromium and chromedriver are Debian's (``apt-get install chromium
chromium-driver``), given to selenium by path: no browser or driver is
downloaded at run time.
"""

from __future__ import annotations

import functools
import http.server
import pathlib
import shutil
import threading
from urllib.parse import urljoin

import pytest

from tests.test_docs import SITE_NAME, built_site

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser checks need selenium: pip install selenium")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WIDTH = 1280
# How much wider than its room a table or code block may be: a scrollbar's
# or a border's worth, not a column.
TOLERANCE = 1.10

# The room of each table and code block, and its content's width, as the
# browser laid them out. The column is the article's content box; an element
# indented in it (a notebook cell after its prompt, a block in a list) has the
# room from its own left edge to the column's right edge. An element's width
# is the widest of its box and its own and its code's scrollWidth: a block
# that overflows visibly and one that scrolls inside itself are both wider
# than what can be read in place. Elements not displayed (a collapsed
# details) have no box and are left out.
MEASURE = """
const article = document.querySelector("article.md-content__inner");
const style = getComputedStyle(article);
const box = article.getBoundingClientRect();
const left = box.left + parseFloat(style.paddingLeft);
const right = box.right - parseFloat(style.paddingRight);
const kind = (el) => {
  if (el.tagName === "TABLE") return "table";
  if (el.closest(".doc-signature")) return "signature";
  if (el.closest(".jp-CodeCell .jp-InputArea")) return "notebook code cell";
  if (el.closest(".jp-MarkdownCell")) return "code block of a notebook's Markdown cell";
  if (el.closest(".jp-OutputArea")) return "notebook output";
  return "code block";
};
const found = [];
for (const el of article.querySelectorAll("table, pre")) {
  const rect = el.getBoundingClientRect();
  if (rect.width === 0 && rect.height === 0) continue;
  const widths = [rect.width, el.scrollWidth, ...Array.from(el.querySelectorAll("code"), (c) => c.scrollWidth)];
  found.push({
    kind: kind(el),
    width: Math.round(Math.max(...widths)),
    column: Math.round(right - Math.max(rect.left, left)),
    text: el.textContent.trim().replace(/\\s+/g, " ").slice(0, 60),
  });
}
return {column: Math.round(right - left), elements: found};
"""

# The first entries of the primary sidebar: its title and its first links.
SIDEBAR = """
const nav = document.querySelector(".md-sidebar--primary nav.md-nav--primary");
const shown = (el) => el && el.getClientRects().length > 0 && getComputedStyle(el).visibility !== "hidden";
const items = [];
for (const el of nav.querySelectorAll(".md-nav__title, .md-nav__link")) {
  if (shown(el) && el.innerText.trim()) items.push(el.innerText.trim().split("\\n")[0]);
  if (items.length === 3) break;
}
return items;
"""

# The stylesheet rules that made the pages unreadable at 1280 px: each
# signature of the "API at a glance" table on one line, and the notebooks'
# code kept to its lines, as mkdocs-jupyter renders it.
OLD_RULES = """
const style = document.createElement("style");
style.textContent = `
  .md-typeset td:first-child code { white-space: nowrap !important; }
  .jupyter-wrapper .jp-InputArea pre, .jupyter-wrapper .jp-InputArea pre code {
    white-space: pre !important; overflow-wrap: normal !important; }
`;
document.head.appendChild(style);
"""

# A line of code longer than any column, added to a notebook's first code cell.
LONG_LINE = """
document.querySelector(".jp-CodeCell .jp-InputArea pre").append("\\nsizes = [" + "1024, ".repeat(60) + "]");
"""


def _install_hint() -> str:
    return (
        "the browser checks need Debian's chromium and chromedriver "
        "(apt-get update && apt-get install -y chromium chromium-driver)"
    )


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The built site's address on 127.0.0.1, and the site."""
    site = built_site(tmp_path_factory)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", site
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (pathlib.Path(CHROMIUM).is_file() and pathlib.Path(CHROMEDRIVER).is_file()):
        pytest.skip(_install_hint())
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={WIDTH},900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
        # Nothing but the local server: no request leaves the machine (the
        # theme's web fonts are not fetched; the system's fonts stand in).
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def page_urls(site: pathlib.Path) -> list[str]:
    """The site path of every page (``api/`` for ``api/index.html``)."""
    return sorted(
        p.parent.relative_to(site).as_posix() + "/" if p.parent != site else ""
        for p in site.rglob("index.html")
        if not p.relative_to(site).parts[0].startswith(("assets", "search"))
    )


def open_page(driver, base: str, url: str, plant: str = "") -> None:
    driver.get(urljoin(base, url))
    if plant:
        driver.execute_script(plant)
    # The layout after the fonts settle (the fallback ones, with no network).
    driver.execute_async_script("const done = arguments[0]; document.fonts.ready.then(() => done());")


def offenders(measured: dict, url: str) -> list[str]:
    where = url or "/"
    return [
        f"{where}: a {e['kind']} {e['width']} px wide in a {e['column']} px column ({e['text']!r})"
        for e in measured["elements"]
        if e["width"] > TOLERANCE * e["column"]
    ]


def widest(measured: dict) -> str:
    """The page's widest element against its room, for the failure's summary."""
    if not measured["elements"]:
        return "no table or code block"
    e = max(measured["elements"], key=lambda e: e["width"] / e["column"])
    return f"widest: a {e['kind']} {e['width']} px in {e['column']} px"


def test_every_table_and_code_block_fits_its_column_at_1280_px(browser, served):
    base, site = served
    urls = page_urls(site)
    assert {"", "api/", "guides/segments/", "notebooks/05_per_segment_scaling/"} <= set(urls)
    problems, summary = [], []
    for url in urls:
        open_page(browser, base, url)
        measured = browser.execute_script(MEASURE)
        problems += offenders(measured, url)
        summary.append(f"{url or '/'}: {widest(measured)} (column {measured['column']} px)")
    assert not problems, "\n".join(problems + ["", "per page:"] + summary)


def test_the_api_at_a_glance_table_reads_at_1280_px(browser, served, tmp_path_factory):
    """The page that had the widest table: its table fits, and its screenshot
    is kept with the test's files to look at."""
    base, _ = served
    open_page(browser, base, "api/")
    measured = browser.execute_script(MEASURE)
    tables = [e for e in measured["elements"] if e["kind"] == "table"]
    assert tables and all(e["width"] <= e["column"] for e in tables), tables
    browser.save_screenshot(str(tmp_path_factory.mktemp("screenshots") / "api_at_a_glance.png"))


def test_a_page_wider_than_its_column_fails(browser, served):
    base, _ = served
    open_page(browser, base, "api/", plant=OLD_RULES)
    problems = offenders(browser.execute_script(MEASURE), "api/")
    assert any(p.startswith("api/: a table ") for p in problems), problems
    notebook = "notebooks/05_per_segment_scaling/"
    # The site's stylesheet wraps a long line of a cell; without its rule the
    # line runs past the column.
    open_page(browser, base, notebook, plant=LONG_LINE)
    assert offenders(browser.execute_script(MEASURE), notebook) == []
    open_page(browser, base, notebook, plant=LONG_LINE + OLD_RULES)
    problems = offenders(browser.execute_script(MEASURE), notebook)
    assert [p for p in problems if p.startswith(f"{notebook}: a notebook code cell ")], problems


def test_the_sidebar_does_not_repeat_the_site_name(browser, served):
    """Material titles the sidebar with the site's name; the home page's
    entry, named by its title (the README's, the same name), read it
    twice."""
    base, _ = served
    open_page(browser, base, "")
    items = browser.execute_script(SIDEBAR)
    assert items[0] == SITE_NAME and items[1] != SITE_NAME, items
    # The home page's entry (its link, and the label that opens its table
    # of contents) named by its title again.
    rename = f"""
    for (const el of document.querySelectorAll(".md-nav--primary .md-nav__item--active > .md-nav__link .md-ellipsis"))
      el.textContent = {SITE_NAME!r};
    """
    open_page(browser, base, "", plant=rename)
    assert browser.execute_script(SIDEBAR)[:2] == [SITE_NAME, SITE_NAME]
