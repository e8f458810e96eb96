"""What an optimized XLA program runs: its kernels and the bytes each reads
and writes, from the HLO text of a compiled executable
(``jax.jit(f).lower(...).compile().as_text()``).

A kernel is an instruction that runs on its own (a fusion, a library call
such as a cuBLAS product, a copy, a reduction that XLA left unfused) in a
computation that runs instruction by instruction: the entry computation,
the branches of a conditional and the body and condition of a while loop.
Parameters, tuples, bitcasts and the control instructions themselves move
no data. A kernel reads each of its operands once and writes its result:
the bytes of their shapes, a proxy for memory traffic that needs no timer
and no hardware counter. On a GPU every kernel is also a launch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterable

# Instructions that run no kernel of their own.
FREE = frozenset(
    {
        "parameter",
        "constant",
        "tuple",
        "get-tuple-element",
        "bitcast",
        "conditional",
        "while",
        "call",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
    }
)
# Attributes that name computations run instruction by instruction.
_RUN = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)|false_computation=%?([\w.\-]+)"
                  r"|condition=%?([\w.\-]+)|body=%?([\w.\-]+)|to_apply=%?([\w.\-]+))")  # fmt: skip
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|f8e4m3|f8e5m2fnuz|f8e4m3fnuz|bf16|f16"
                    r"|f32|f64|c64|c128)\[([\d,]*)\]")  # fmt: skip
_NAME = re.compile(r"%([\w.\-]+)")
_BITS = {"pred": 8, "c64": 64, "c128": 128}


def dump_path(directory: str, *parts: str) -> str:
    """The file in ``directory`` for one executable's optimized HLO: ``parts``
    (model, precision, variant, kind) joined by ``_``, each with every run of
    characters other than letters, digits and ``_`` made one ``_``."""
    name = "_".join(re.sub(r"\W+", "_", part).strip("_") for part in parts)
    return os.path.join(directory, f"{name}.hlo.txt")


def _bytes(shape: str) -> int:
    """The bytes of a shape's arrays (a tuple's summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def _matching(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text!r}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    result_bytes: int
    operands: tuple[str, ...]
    attributes: str


def _instruction(line: str) -> Instruction | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    if " = " not in line or not (line.startswith("%") or re.match(r"[\w.\-]+ = ", line)):
        return None
    name, rest = line.lstrip("%").split(" = ", 1)
    if rest.startswith("("):  # a tuple shape
        end = _matching(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    if "(" not in rest:
        return None
    opcode = rest[: rest.index("(")]
    start = rest.index("(")
    end = _matching(rest, start)
    return Instruction(name, opcode, _bytes(shape), tuple(_NAME.findall(rest[start : end + 1])), rest[end + 1 :])


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The computations of an HLO module by name, and its entry's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        match = _COMPUTATION.match(line.strip())
        if match:
            current = match.group(2)
            computations[current] = []
            if match.group(1):
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
                continue
            instruction = _instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    return computations, entry


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernels of a program and their traffic.

    Attributes:
      count: how many kernels run (a conditional's branches all counted).
      read_bytes, written_bytes: over all of them.
      by_opcode: the count of each opcode (``fusion``, ``custom-call``...).
      large: the kernels that read or write at least ``min_bytes``, as
        ``(name, opcode, read, written)``.
    """

    count: int
    read_bytes: int
    written_bytes: int
    by_opcode: dict[str, int]
    large: list[tuple[str, str, int, int]]


def _run_computations(computations: dict[str, list[Instruction]], entry: str) -> Iterable[str]:
    """The entry and every computation it runs instruction by instruction
    (branches, loop bodies and conditions, called computations), not the
    fused ones (a fusion is one kernel)."""
    seen, stack = set(), [entry]
    while stack:
        name = stack.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        yield name
        for instruction in computations[name]:
            if instruction.opcode in ("conditional", "while", "call"):
                for groups in _RUN.findall(instruction.attributes):
                    for group in groups:
                        stack.extend(n.strip().lstrip("%") for n in group.split(",") if n.strip())


def kernels(text: str, min_bytes: int = 1 << 20) -> Kernels:
    """The kernels of the compiled program ``text`` and their traffic."""
    computations, entry = parse(text)
    count = read = written = 0
    by_opcode: dict[str, int] = {}
    large = []
    for name in _run_computations(computations, entry):
        sizes = {i.name: i.result_bytes for i in computations[name]}
        for instruction in computations[name]:
            if instruction.opcode in FREE:
                continue
            reads = sum(sizes.get(operand, 0) for operand in dict.fromkeys(instruction.operands))
            count += 1
            read += reads
            written += instruction.result_bytes
            by_opcode[instruction.opcode] = by_opcode.get(instruction.opcode, 0) + 1
            if max(reads, instruction.result_bytes) >= min_bytes:
                large.append((instruction.name, instruction.opcode, reads, instruction.result_bytes))
    return Kernels(count, read, written, by_opcode, large)
