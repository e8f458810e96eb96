"""Only the jaxpr engine (``loss_scale/_jaxpr/``) walks jaxprs: no other
module of the package reads a jaxpr's equations (``.eqns``), binds an
equation's primitive (``eqn.primitive.bind``) or asks for its bind
parameters (``get_bind_params``). The probes, the segment analysis and
evaluation, the skip's select path and ``autocast`` are hook sets of the
engine's ``Interpreter`` or ask it for the structure (``equations``,
``walk``, ``sub_jaxprs``), so entering a call, rebuilding control flow and
the differences between jax versions live in one place. Also: no module of
the package is longer than 450 lines.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "loss_scale"
ENGINE = PACKAGE / "_jaxpr"
MAX_LINES = 450


def walks(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every place ``source`` walks or binds a jaxpr
    itself: an attribute ``.eqns`` or ``.get_bind_params``, or a call of
    ``<something>.primitive.bind``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("eqns", "get_bind_params"):
            found.append((node.lineno, f".{node.attr}"))
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "bind"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "primitive"
        ):
            found.append((node.lineno, ".primitive.bind"))
    return found


def modules_outside_the_engine() -> list[pathlib.Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if ENGINE not in p.parents]


def test_only_the_engine_walks_jaxprs():
    problems = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in modules_outside_the_engine()
        for line, what in walks(path.read_text())
    ]
    assert not problems, "walk or bind jaxprs through loss_scale._jaxpr instead:\n" + "\n".join(problems)


def test_the_engine_itself_is_seen_walking():
    # The check looks at the right files and finds what it must.
    assert any(walks(path.read_text()) for path in ENGINE.rglob("*.py"))


@pytest.mark.parametrize(
    "source, expected",
    [
        ("for eqn in jaxpr.eqns:\n    pass\n", [(1, ".eqns")]),
        ("outs = eqn.primitive.bind(*invals, **params)\n", [(1, ".primitive.bind")]),
        ("params = eqn.primitive.get_bind_params(eqn.params)\n", [(1, ".get_bind_params")]),
        ("from loss_scale._jaxpr import bind\nouts = bind(eqn, invals)\n", []),
        ("# a comment about .eqns\nx = 'jaxpr.eqns'\n", []),
    ],
)
def test_the_check_finds_what_it_must(source, expected):
    assert walks(source) == expected


def test_no_module_is_longer_than_450_lines():
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them, one concept per module): {long}"


# Equation parameters whose names changed between the jax versions the
# package declares (scan's, in jax 0.11): read only through _jaxpr/_compat.py.
VERSIONED_PARAMETERS = ("num_consts", "num_carry", "ft_in", "ft_out")


def versioned_reads(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` for every string constant of ``source`` that names a
    versioned parameter (a ``params["num_consts"]`` or ``.get("ft_in")``)."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and node.value in VERSIONED_PARAMETERS
    ]


def test_versioned_parameters_are_read_in_one_place():
    compat = ENGINE / "_compat.py"
    problems = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != compat
        for line, name in versioned_reads(path.read_text())
    ]
    assert not problems, "read these through loss_scale._jaxpr.scan_params:\n" + "\n".join(problems)
    assert {name for _, name in versioned_reads(compat.read_text())} >= {"num_consts", "ft_in"}
