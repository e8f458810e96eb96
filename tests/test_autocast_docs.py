"""The guide "Automatic mixed precision" (docs/guides/autocast.md) lists the
three operation lists of ``ls.autocast`` in full: its tables hold exactly
the primitives of ``loss_scale._autocast.HALF``, ``FLOAT32`` and
``FOLLOW``, each once, so a primitive added to or moved between the lists
fails here until the page says so too. (The page's code blocks run in
tests/test_guides.py.)"""

from __future__ import annotations

import re

import pytest

from loss_scale._autocast import FLOAT32, FOLLOW, HALF
from tests._markdown import ROOT

GUIDE = ROOT / "docs" / "guides" / "autocast.md"
LISTS = {"HALF": HALF, "FLOAT32": FLOAT32, "FOLLOW": FOLLOW}


def listed(text: str, name: str) -> list[str]:
    """The primitives in the second column of the first table under the
    heading ``### `NAME`: ...`` of ``text``, in order, repeats kept."""
    heading = re.search(rf"^### `{name}`:.*$", text, flags=re.M)
    assert heading, f"no heading for the list {name}"
    section = text[heading.end() :]
    following = re.search(r"^#{1,3} ", section, flags=re.M)
    section = section[: following.start()] if following else section
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) > 2, f"no table under the heading of {name}"
    names = []
    for row in rows[2:]:  # the header and the |---| line first
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        names += re.findall(r"`([^`]+)`", cells[1])
    return names


@pytest.mark.parametrize("name", LISTS)
def test_the_guide_lists_each_primitive_once(name):
    names = listed(GUIDE.read_text(encoding="utf-8"), name)
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"{name}: listed twice on the page: {repeated}"
    assert set(names) == set(LISTS[name]), (
        f"{name}: on the page, not in the list: {sorted(set(names) - LISTS[name])}; "
        f"in the list, not on the page: {sorted(LISTS[name] - set(names))}"
    )


def test_the_lists_are_disjoint():
    assert not (HALF & FLOAT32) and not (HALF & FOLLOW) and not (FLOAT32 & FOLLOW)


def test_the_rules_table_names_the_three_lists():
    text = GUIDE.read_text(encoding="utf-8")
    rules = text[text.index("## The rules") : text.index("## The three lists")]
    for name in LISTS:
        assert f"(the list `{name}`" in rules, name


def test_a_page_that_drifts_from_the_lists_fails():
    text = GUIDE.read_text(encoding="utf-8")
    # A primitive dropped from a row, and one listed twice.
    dropped = text.replace("`pow`, `rsqrt`", "`pow`", 1)
    assert dropped != text and "rsqrt" not in listed(dropped, "FLOAT32")
    doubled = text.replace("| `dot_general` |", "| `dot_general`, `dot_general` |", 1)
    names = listed(doubled, "HALF")
    assert names.count("dot_general") == 2
    with pytest.raises(AssertionError, match="no heading for the list FOLLOW"):
        listed(text.replace("### `FOLLOW`:", "### Follow:"), "FOLLOW")
