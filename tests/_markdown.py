"""The ```python blocks of the README and the guides, and running one as
written in a fresh interpreter.

A block followed by a ```text block is an example with its output: the
test compares what the block prints with that text."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))

_FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```[ \t]*\n", flags=re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    code: str
    output: str | None  # the ```text block right after it, if any
    heading: str  # the heading above it

    @property
    def id(self) -> str:
        heading = re.sub(r"\W+", "_", self.heading).strip("_").lower()
        return f"{self.path.stem}-{heading}"


def python_blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of the Markdown file at ``path``, in order."""
    text = path.read_text(encoding="utf-8")
    fences = list(_FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        if fence["lang"] != "python":
            continue
        after = fences[i + 1] if i + 1 < len(fences) else None
        output = None
        if after is not None and after["lang"] == "text" and not text[fence.end() : after.start()].strip():
            output = after["body"]
        headings = re.findall(r"^#+ (.*)$", text[: fence.start()], flags=re.M)
        blocks.append(Block(path, fence["body"], output, headings[-1] if headings else path.stem))
    return blocks


def run_block(block: Block, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Runs ``block`` as written, in a fresh interpreter in ``cwd``, with the
    repository on the path (the distributed block makes its own virtual CPU
    devices, so the tests' ``XLA_FLAGS`` are left out)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", block.code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def check_block(block: Block, cwd: pathlib.Path) -> None:
    """The block is complete, runs without an error or a warning, and prints
    its output block when it has one."""
    assert not re.search(r"^\s*\.\.\.\s*$", block.code, flags=re.M), "a fragment: '...' stands for missing code"
    run = run_block(block, cwd)
    assert run.returncode == 0, f"--- stdout\n{run.stdout}\n--- stderr\n{run.stderr[-4000:]}"
    assert "Warning" not in run.stderr, run.stderr[-4000:]
    if block.output is not None:
        assert run.stdout == block.output, f"printed:\n{run.stdout}\nthe page says:\n{block.output}"
