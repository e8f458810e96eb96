#!/usr/bin/env python
"""End-to-end speedup of mixed precision with loss scaling over float32.

Reads the JSON that ``benchmarks/overhead.py --json PATH`` writes and prints,
for each model measured in both precisions, the float32 bare-Adam step time,
the mixed-precision (float16 compute) step time with ``ls.dynamic`` and with
``ls.apply_gradients``, and the speedup over float32::

    python benchmarks/overhead.py --json results.json
    python benchmarks/speedup.py results.json [--out]

A variant's step time is its median per-round ratio to bare Adam times bare
Adam's median time in the same run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _harness/ is next to this script, run or imported
from _harness import cli, tables  # noqa: E402

BARE = "adam (bare)"
VARIANTS = ("ls.dynamic", "ls.dynamic + ls.apply_gradients")


def step_ms(table: dict[str, Any], variant: str) -> float:
    """Median step time of ``variant``: its median ratio to bare in the same
    rounds times bare's median time."""
    rows = {row["variant"]: row for row in table["rows"]}
    return rows[BARE]["step"]["median_ms"] * rows[variant]["step"]["median"]


def speedups(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (malloc run, model) with float32 and mixed tables that
    hold every variant of ``VARIANTS``."""
    out = []
    for run in results["runs"]:
        tables_by_key = {(t["model"], t["precision"]): t for t in run["tables"]}
        for model in sorted({m for m, _ in tables_by_key}):
            if (model, "f32") not in tables_by_key or (model, "mixed") not in tables_by_key:
                continue
            mixed = tables_by_key[model, "mixed"]
            if not set(VARIANTS) <= {row["variant"] for row in mixed["rows"]}:
                continue
            f32_ms = step_ms(tables_by_key[model, "f32"], BARE)
            row = {"header": run["header"], "model": model, "f32_ms": f32_ms}
            for variant in VARIANTS:
                mixed_ms = step_ms(mixed, variant)
                row[variant] = {"mixed_ms": mixed_ms, "speedup": f32_ms / mixed_ms}
            out.append(row)
    return out


HEADERS = ("model", "float32 step ms", *(f"mixed + {v} ms" for v in VARIANTS), "speedup")


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = []
    for header in dict.fromkeys(r["header"] for r in rows):
        cells = [
            [r["model"], f"{r['f32_ms']:.2f}", *(f"{r[v]['mixed_ms']:.2f}" for v in VARIANTS),
             f"{max(r[v]['speedup'] for v in VARIANTS):.2f}x"]
            for r in rows if r["header"] == header
        ]  # fmt: skip
        lines += [header, "", tables.markdown(HEADERS, cells), ""]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("results", metavar="RESULTS.json", help="what benchmarks/overhead.py --json wrote")
    cli.add_out(parser, "speedup")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    rows = speedups(results)
    if not rows:
        raise SystemExit(f"no model was measured in both f32 and mixed precision with {', '.join(VARIANTS)}")
    report = tables.Report()
    report.print(format_rows(rows))
    if args.out is not None:
        backend = results["runs"][0]["tables"][0]["backend"]
        report.save(args.out or tables.default_out("speedup", backend))
    return rows


if __name__ == "__main__":
    main()
