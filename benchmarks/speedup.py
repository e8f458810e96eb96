"""End-to-end speedup of mixed precision with loss scaling over float32.

Reads the JSON that ``benchmarks/overhead.py --json PATH`` writes and prints,
for each model measured in both precisions, the float32 bare-Adam step time,
the mixed-precision (float16 compute) step time with ``ls.dynamic`` and with
``ls.apply_gradients``, and the speedup over float32::

    python benchmarks/overhead.py --json results.json
    python benchmarks/speedup.py results.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

VARIANTS = ("ls.dynamic", "ls.dynamic + ls.apply_gradients")


def step_ms(table: dict[str, Any], variant: str) -> float:
    """Median step time of ``variant``: its median ratio to bare in the same
    rounds times bare's median time."""
    rows = {row["variant"]: row for row in table["rows"]}
    bare_ms = rows["adam (bare)"]["step"]["median_ms"]
    return bare_ms * rows[variant]["step"]["median"]


def speedups(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (malloc run, model) with float32 and mixed tables."""
    out = []
    for run in results["runs"]:
        tables = {(t["model"], t["precision"]): t for t in run["tables"]}
        for model in sorted({m for m, _ in tables}):
            if (model, "f32") not in tables or (model, "mixed") not in tables:
                continue
            f32_ms = step_ms(tables[model, "f32"], "adam (bare)")
            row = {"header": run["header"], "model": model, "f32_ms": f32_ms}
            for variant in VARIANTS:
                mixed_ms = step_ms(tables[model, "mixed"], variant)
                row[variant] = {"mixed_ms": mixed_ms, "speedup": f32_ms / mixed_ms}
            out.append(row)
    return out


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = []
    for header in dict.fromkeys(r["header"] for r in rows):
        lines += [
            header,
            "",
            "| model | float32 step ms | mixed + " + " ms | mixed + ".join(VARIANTS) + " ms | speedup |",
        ]
        lines.append("|---|---|" + "---|" * len(VARIANTS) + "---|")
        for r in (r for r in rows if r["header"] == header):
            cells = [f"{r[v]['mixed_ms']:.2f}" for v in VARIANTS]
            best = max(r[v]["speedup"] for v in VARIANTS)
            lines.append(f"| {r['model']} | {r['f32_ms']:.2f} | " + " | ".join(cells) + f" | {best:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        raise SystemExit("usage: python benchmarks/speedup.py RESULTS.json")
    with open(argv[0]) as f:
        rows = speedups(json.load(f))
    if not rows:
        raise SystemExit("no model was measured in both f32 and mixed precision")
    print(format_rows(rows))
    return rows


if __name__ == "__main__":
    main()
