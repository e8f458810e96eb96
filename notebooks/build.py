#!/usr/bin/env python
"""Builds the committed notebooks from their percent-format sources, and runs them.

The sources are the ``NN_name.py`` files in this folder (jupytext's percent
format: ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell of
``# ``-prefixed lines); edit those, lint them with ruff like any Python file,
then write and execute the ``.ipynb`` files, which are committed with their
outputs so that they render on GitHub and on the documentation site::

    pip install -e ".[notebooks]"
    python notebooks/build.py                 # every notebook, executed
    python notebooks/build.py 02              # the ones whose name contains "02"
    python notebooks/build.py --no-execute    # the cells only, without outputs

``tests/test_notebooks.py`` checks that each ``.ipynb`` has the cells of its
source, and executes it again.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Sequence

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def sources() -> list[pathlib.Path]:
    """The notebook sources, ``NN_name.py``, in order."""
    return sorted(HERE.glob("[0-9][0-9]_*.py"))


def read(source: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook of a percent-format source, without outputs, with the
    metadata Jupyter and Colab need (the kernel) and stable cell ids."""
    nb = jupytext.read(source)
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}, "colab": {"provenance": []}}
    for i, cell in enumerate(nb.cells):
        cell.metadata = {}
        cell["id"] = f"cell-{i:02d}"  # stable ids keep the diffs of a rebuild small
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Runs every cell in a fresh ``python3`` kernel whose working directory is
    this folder (the setup cell finds ``../examples`` from there); raises on the
    first cell that fails."""
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(HERE)}}
    )
    return client.execute()


def build(source: pathlib.Path, run: bool = True) -> float:
    """Writes ``source``'s ``.ipynb`` next to it (executed when ``run``); returns the seconds it took."""
    start = time.perf_counter()
    nb = read(source)
    if run:
        execute(nb)
    nbformat.write(nb, source.with_suffix(".ipynb"))
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="build only the notebooks whose name contains one of these")
    parser.add_argument("--no-execute", action="store_true", help="write the cells without running them")
    args = parser.parse_args(argv)
    chosen = [s for s in sources() if not args.names or any(name in s.name for name in args.names)]
    if not chosen:
        parser.error(f"no notebook source matches {args.names}")
    for source in chosen:
        seconds = build(source, run=not args.no_execute)
        print(f"{source.with_suffix('.ipynb').name}: {'written' if args.no_execute else 'executed'} in {seconds:.0f} s")


if __name__ == "__main__":
    main()
