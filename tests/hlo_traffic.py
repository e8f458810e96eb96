"""Counts how often compiled XLA programs read and write large buffers.

A proxy for memory traffic that does not depend on timing: in the optimized
HLO text, every instruction that runs as its own kernel (a fusion, a
reduction, a copy, a custom call) reads its operands and writes its result.
Counting those of at least ``min_elements`` elements tells how many full
passes over parameter-sized buffers a step makes.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Instructions that move no data of their own.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "conditional", "while", "call", "after-all"}

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_ARRAY_SHAPE = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    elements: int | None  # None for tuples
    dims: tuple[int, ...]  # () for tuples and scalars
    operands: list[str]
    attributes: str


@dataclasses.dataclass
class Traffic:
    reads: int = 0
    writes: int = 0
    reads_of: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def passes(self) -> int:
        return self.reads + self.writes


def _matching(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text!r}")


def _parse_instruction(line: str) -> Instruction | None:
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    if not line.startswith("%") or " = " not in line:
        return None
    name, rest = line[1:].split(" = ", 1)
    dims: tuple[int, ...] = ()
    if rest.startswith("("):
        end = _matching(rest, 0)
        elements, rest = None, rest[end + 1 :].lstrip()
    else:
        shape, rest = rest.split(" ", 1)
        match = _ARRAY_SHAPE.match(shape)
        dims = tuple(int(d) for d in match.group(1).split(",") if d) if match else ()
        elements = math.prod(dims) if match else None
    opcode = rest[: rest.index("(")]
    start = rest.index("(")
    end = _matching(rest, start)
    return Instruction(name, opcode, elements, dims, _NAME.findall(rest[start : end + 1]), rest[end + 1 :])


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations by name, and the name of the entry computation."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    return computations, entry


def _traffic(instructions: list[Instruction], min_elements: int, watch: set[str]) -> Traffic:
    sizes = {i.name: i.elements for i in instructions}
    traffic = Traffic()
    for ins in instructions:
        if ins.opcode in _FREE:
            continue
        for operand in ins.operands:
            if (sizes.get(operand) or 0) >= min_elements:
                traffic.reads += 1
                if operand in watch:
                    traffic.reads_of[operand] = traffic.reads_of.get(operand, 0) + 1
        if (ins.elements or 0) >= min_elements:
            traffic.writes += 1
    return traffic


def branches(hlo_text: str) -> list[str]:
    """Names of the branch computations of the entry's (single) conditional,
    in index order (for a ``lax.cond``: false branch first)."""
    computations, entry = parse(hlo_text)
    conditionals = [i for i in computations[entry] if i.opcode == "conditional"]
    if len(conditionals) != 1:
        raise ValueError(f"expected one conditional in the entry computation, found {len(conditionals)}")
    match = re.search(r"branch_computations=\{([^}]*)\}", conditionals[0].attributes)
    if match:
        return _NAME.findall(match.group(1))
    true_branch = re.search(r"true_computation=%([\w.\-]+)", conditionals[0].attributes).group(1)
    false_branch = re.search(r"false_computation=%([\w.\-]+)", conditionals[0].attributes).group(1)
    return [false_branch, true_branch]


def traffic(hlo_text: str, min_elements: int, branch: str | None = None) -> Traffic:
    """Large-buffer reads and writes of the entry computation, plus those of
    ``branch`` (a branch computation of its conditional) when given.

    ``reads_of`` counts the entry's reads of each entry parameter."""
    computations, entry = parse(hlo_text)
    params = {i.name for i in computations[entry] if i.opcode == "parameter"}
    total = _traffic(computations[entry], min_elements, params)
    if branch is not None:
        inner = _traffic(computations[branch], min_elements, set())
        total.reads += inner.reads
        total.writes += inner.writes
    return total


def flattened_transposed_reads(hlo_text: str, min_elements: int) -> list[str]:
    """The kernels of the entry computation that reshape a transposed large
    array to other dimensions (other than by adding or dropping dimensions
    of size 1): fusions in whose computation a ``transpose`` of at least
    ``min_elements`` elements, through layout copies and elementwise ops,
    reaches a ``bitcast`` or ``reshape`` that merges or splits dimensions.

    Such a kernel reads its operand in the logical row-major order of the
    new shape, a row apart per element of a buffer that XLA keeps
    transposed in memory (on XLA:CPU, the float16 weight gradient of a dot
    is one): about 10 times dearer than a read in memory order."""
    computations, entry = parse(hlo_text)
    found = []
    for ins in computations[entry]:
        if ins.opcode != "fusion":
            continue
        called = re.search(r"calls=%([\w.\-]+)", ins.attributes)
        body = computations.get(called.group(1), []) if called else []
        transposed: set[str] = set()
        for inner in body:
            large = (inner.elements or 0) >= min_elements
            if inner.opcode == "transpose" and large:
                transposed.add(inner.name)
            elif inner.opcode in ("bitcast", "reshape") and large and any(o in transposed for o in inner.operands):
                before = next(i for i in body if i.name in inner.operands and i.name in transposed)
                if [d for d in inner.dims if d != 1] != [d for d in before.dims if d != 1]:
                    found.append(ins.name)
                    break
                transposed.add(inner.name)
            elif large and any(o in transposed for o in inner.operands):
                transposed.add(inner.name)
    return found
