"""Every ```python block of the README runs as written, each in a fresh
interpreter, and what the README says about itself holds: the line count
in its heading, the printed result, the times it states."""

import re

import pytest

from tests._markdown import GUIDES, ROOT, check_block, python_blocks, run_block

README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
BLOCKS = python_blocks(README_PATH)
GETTING_STARTED = (ROOT / "docs" / "guides" / "getting_started.md").read_text()
CONTRIBUTING = (ROOT / "docs" / "guides" / "contributing.md").read_text()


def test_the_readme_is_short_and_has_its_example():
    assert len(README.splitlines()) < 300
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{i}-{b.id}" for i, b in enumerate(BLOCKS)])
def test_readme_block_runs_as_written(block, tmp_path):
    check_block(block, tmp_path)


def test_the_example_has_as_many_lines_as_its_heading_says():
    heading = re.search(r"^## A training step in (\d+) lines\n\n```python\n(.*?)^```", README, flags=re.S | re.M)
    assert heading, "the README's example and its heading"
    assert int(heading.group(1)) == len(heading.group(2).splitlines())


def test_the_example_prints_what_the_readme_says(tmp_path):
    (block,) = [b for b in BLOCKS if "A training step in" in b.heading]
    printed = re.search(r"It prints `([^`]+)`", README).group(1)
    run = run_block(block, tmp_path)
    assert run.stdout.strip() == printed
    # The guide that explains it shows the same code and output.
    (guide,) = [b for b in python_blocks(ROOT / "docs" / "guides" / "getting_started.md") if b.code == block.code]
    assert guide.output.strip() == printed


def _quickstart_time(text: str) -> str:
    found = re.findall(r"(\d+ to \d+ s) on 2 CPU cores", text)
    assert found, "no time for the quickstart"
    return found[0]


def test_every_page_gives_the_quickstart_the_same_time():
    # One measured range (examples/quickstart.py, /usr/bin/time, idle and
    # loaded), the same in the script's --help, the README and the guide.
    usage = (ROOT / "examples" / "quickstart.py").read_text()
    usage = re.search(r"python examples/quickstart.py +# (.*)", usage).group(1)
    times = {_quickstart_time(usage), _quickstart_time(README), _quickstart_time(GETTING_STARTED)}
    assert len(times) == 1, times


def test_the_readme_and_the_contributing_guide_give_the_suite_the_same_time():
    phrase = re.compile(r"about (\d+) minutes on 2 CPU\s+cores with AVX-512,\s+(?:and\s+)?up\s+to\s+(\d+)")
    readme = phrase.findall(README)
    assert readme and set(readme) == set(phrase.findall(CONTRIBUTING)), (readme, phrase.findall(CONTRIBUTING))


def test_the_readme_links_every_guide():
    linked = set(re.findall(r"\]\(docs/guides/(\w+)\.md", README))
    assert linked == {p.stem for p in GUIDES}
