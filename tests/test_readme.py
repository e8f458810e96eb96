"""Every ```python block of the README runs as written, each in a fresh
interpreter (the distributed one makes its own virtual CPU devices)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def _name(block: str) -> str:
    """A test id from the block's position in the README: the heading above it."""
    before = README[: README.index(block)]
    heading = re.findall(r"^#+ (.*)$", before, flags=re.M)[-1]
    return re.sub(r"\W+", "_", heading).strip("_").lower()


def test_the_readme_has_its_examples():
    assert len(BLOCKS) >= 8, len(BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{i}-{_name(b)}" for i, b in enumerate(BLOCKS)])
def test_readme_block_runs_as_written(block, tmp_path):
    assert not re.search(r"^\s*\.\.\.\s*$", block, flags=re.M), "a fragment: '...' stands for missing code"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"--- stdout\n{run.stdout}\n--- stderr\n{run.stderr[-4000:]}"
    assert "Warning" not in run.stderr, run.stderr[-4000:]


def test_the_quickstart_prints_what_it_says():
    quickstart = next(b for b in BLOCKS if "tx = ls.dynamic(optax.adam(1e-3))  # wraps" in b)
    run = subprocess.run([sys.executable, "-c", quickstart], capture_output=True, text=True, timeout=300)
    loss, scale, skipped = run.stdout.split()
    assert float(loss) == 1.0 and float(scale) == 32768.0 and int(skipped) == 0
