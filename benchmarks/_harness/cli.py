"""The scripts' command lines: one parser style, one ``--out`` flag."""

from __future__ import annotations

import argparse


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the epilog's lines; shows an option's default where it has one
    worth showing (not ``None`` or ``False``, and not already in its help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` (the script's
    docstring), with its ``Usage::`` section, if any, as the epilog."""
    first = doc.split("\n\n")[0]
    usage = doc.partition("Usage::")[2].split("\n\nFrom Python")[0]
    return argparse.ArgumentParser(
        description=first,
        epilog="examples:" + usage.rstrip() if usage else None,
        formatter_class=lambda prog: _Formatter(prog, max_help_position=32, width=100),
        allow_abbrev=False,
    )


def add_out(parser: argparse.ArgumentParser, script: str) -> None:
    """``--out [PATH]``: save what the script printed (``args.out`` is
    ``None`` without the flag, ``""`` for the default path)."""
    parser.add_argument(
        "--out",
        metavar="PATH",
        nargs="?",
        const="",
        help=f"also write the printed tables to PATH; alone: benchmarks/results/{script}_<backend>.txt",
    )


def split(text: str) -> list[str]:
    """A comma-separated list."""
    return [item for item in text.split(",") if item]
