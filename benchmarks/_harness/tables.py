"""Markdown tables, number formats, and the report a script prints and can
save under ``benchmarks/results/``."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; cells are ``str()``'d."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row of {len(row)} cells under {len(headers)} headers: {row}")
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def parse_markdown(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``text``, as header -> cell
    (for tests and for reading saved results back)."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and i + 1 < len(lines)
                 and lines[i + 1].startswith("|---"))  # fmt: skip
    headers = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(headers, (cell.strip() for cell in line.strip("|").split("|")), strict=True)))
    return rows


def ratio(stats: dict[str, float]) -> str:
    """``median [CI low, CI high]`` of a ``timing.ratio_stats``."""
    return f"{stats['median']:.2f} [{stats['ci_low']:.2f}, {stats['ci_high']:.2f}]"


def mib(memory: dict[str, float] | None, base: dict[str, float] | None, key: str) -> str:
    """A memory figure in MiB with its difference to ``base``."""
    if memory is None:
        return "n/a"
    text = f"{memory[key]:.1f}"
    if base is not None:
        text += f" ({memory[key] - base[key]:+.1f})"
    return text


def seconds(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def times(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.2f}x"


def default_out(script: str, backend: str) -> pathlib.Path:
    """``benchmarks/results/<script>_<backend>.txt``."""
    return RESULTS / f"{script}_{backend}.txt"


class Report:
    """Prints as it goes and keeps what it printed, to save it afterwards."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def print(self, text: str = "") -> None:
        self.parts.append(text)
        print(text, flush=True)

    @property
    def text(self) -> str:
        return "\n".join(self.parts) + "\n"

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.text)
        print(f"(written to {path})", flush=True)
        return path
