"""Every ```python block of the guides (docs/guides/*.md) runs as written,
each in a fresh interpreter; a block followed by a ```text block prints
exactly that text."""

import pathlib

import pytest

from tests._markdown import GUIDES, Block, check_block, python_blocks

pytest.importorskip("flax")
pytest.importorskip("equinox")
pytest.importorskip("orbax.checkpoint")

BLOCKS = [block for guide in GUIDES for block in python_blocks(guide)]


def test_the_guides_have_their_examples():
    pages = {block.path.stem for block in BLOCKS}
    assert {"getting_started", "update_rule", "frameworks", "distributed", "debugging", "migration"} <= pages
    assert len(BLOCKS) >= 15, len(BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{i}-{b.id}" for i, b in enumerate(BLOCKS)])
def test_guide_block_runs_as_written(block, tmp_path):
    check_block(block, tmp_path)


def test_a_block_that_prints_something_else_fails(tmp_path):
    block = Block(pathlib.Path("planted.md"), 'print("4.0 True 0")\n', "8.0 False 1\n", "planted")
    with pytest.raises(AssertionError, match="the page says"):
        check_block(block, tmp_path)
    with pytest.raises(AssertionError, match="a fragment"):
        check_block(Block(pathlib.Path("planted.md"), "x = 1\n...\n", None, "planted"), tmp_path)
