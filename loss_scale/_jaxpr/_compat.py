"""What differs between the jax versions the package declares (0.8.0 to
0.12.x) when a jaxpr is evaluated equation by equation, in one place.

Equation parameters are jax's private structure: any module that needs one
whose name or meaning changed between releases reads it through a function
here (``scan_params``), never from ``eqn.params`` itself. The differences
absorbed so far:

* ``scan`` (0.11): ``num_consts`` and ``num_carry`` gave way to ``ft_in``
  and ``ft_out``, flat trees of the operands' three groups (consts, carry,
  xs) and the outputs' two (carry, ys).
* ``ClosedJaxpr`` (0.11): an alias of ``Jaxpr``, which holds its own
  consts; ``closed_parts`` answers both forms alike.
* ``get_bind_params`` (0.9): the params alone, not ``(subfuns, params)``.
* ``DropVar`` and ``get_opaque_trace_state`` (0.9): exported by
  ``jax.extend.core``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex


def is_literal(var: Any) -> bool:
    """Whether an equation's operand is a constant written into the jaxpr."""
    return isinstance(var, jex.Literal)


def is_dropped(var: Any) -> bool:
    """Whether an equation's output is one nobody reads (``_``).
    ``jax.extend.core`` exports ``DropVar`` only from jax 0.9; the class has
    that name in every declared version."""
    return type(var).__name__ == "DropVar"


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn``'s primitive applied to ``invals`` as ``jax.core.eval_jaxpr``
    does it, always as a list of outputs.

    Before jax 0.9 ``get_bind_params`` returns ``(subfuns, params)`` (the
    sub-functions a call primitive takes first); from 0.9 on, the params
    alone. The equation's context (``eqn.ctx``: its ``jax.named_scope``
    and compute type) is re-entered so that a bound equation keeps them."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):
        subfuns, params = params
    with at_source(eqn), eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def is_closed(body: Any) -> bool:
    """Whether a parameter is a ``ClosedJaxpr`` (which also answers a
    ``Jaxpr``'s ``eqns``, ``invars`` and ``constvars``: tested first)."""
    return isinstance(body, jex.ClosedJaxpr)


def at_source(eqn: Any) -> contextlib.AbstractContextManager:
    """A context in which the equations bound carry ``eqn``'s place in the
    user's code (its traceback and name stack, after the caller's), as
    ``jax.core.eval_jaxpr`` gives them: a rewritten program's errors and
    reports then point at the user's line, not at the interpreter. The
    helper is private to jax in every declared version; without it the
    equations carry the interpreter's place."""
    try:
        from jax._src import source_info_util
    except ImportError:  # pragma: no cover - moved in a later jax
        return contextlib.nullcontext()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def trace_state() -> Any:
    """A token of the trace values are being built in now: two tokens compare
    equal (``==``; they are not hashable) only within one trace. A value
    made in a loop body's trace must not be used outside it (JAX raises an
    ``UnexpectedTracerError``), so a cache of values made while tracing keys
    them by it. ``jax.extend.core`` has the function from jax 0.9 on,
    ``jax.core`` before (deprecated there since)."""
    import jax.extend.core as extend_core

    getter = getattr(extend_core, "get_opaque_trace_state", None)
    if getter is None:  # pragma: no cover - jax 0.8
        getter = jax.core.get_opaque_trace_state
    return getter(convention="loss_scale")


def closed_parts(body: Any) -> tuple[Any, list[Any]]:
    """``(open jaxpr, consts)`` of a parameter that holds a jaxpr: a
    ``ClosedJaxpr`` (``jit``, ``cond`` branches, ``scan``; a jitted
    function's may hold consts) or an open ``Jaxpr`` (``checkpoint``,
    ``shard_map``)."""
    if is_closed(body):
        return body.jaxpr, list(body.consts)
    return body, []


@dataclasses.dataclass(frozen=True)
class ScanParams:
    """A ``scan`` equation's parameters, as every declared jax version has them.

    Attributes:
      jaxpr: the body (``closed_parts`` splits it); its inputs are the
        consts, the carry and one slice of each xs, in that order, and its
        outputs the new carry, then one slice of each ys.
      num_consts: how many operands are constants of the body.
      num_carry: how many operands (after the consts) and outputs (first)
        are the carry.
      length: the number of iterations.
      reverse: whether the iterations run from the last slice to the first.
      unroll: as ``lax.scan`` takes it.
      options: further keywords ``lax.scan`` takes to rebuild the equation
        as it was (``_split_transpose`` where the version has it).
    """

    jaxpr: Any
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool
    options: Mapping[str, Any]


def scan_params(params: Mapping[str, Any]) -> ScanParams:
    """The parameters of a ``scan`` equation (``eqn.params``)."""
    if "num_consts" in params:  # jax 0.8 to 0.10
        num_consts, num_carry = params["num_consts"], params["num_carry"]
    else:  # jax 0.11 on: the operands' groups as flat trees
        consts, carry, _ = params["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    options = {"_split_transpose": params["_split_transpose"]} if "_split_transpose" in params else {}
    return ScanParams(
        jaxpr=params["jaxpr"],
        num_consts=num_consts,
        num_carry=num_carry,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
        options=options,
    )


def has_effects(eqn: Any) -> bool:
    """Whether binding ``eqn`` does something besides computing its outputs
    (a callback, a print, an ordered effect's token)."""
    return bool(eqn.effects)


def trace_closed(fn: Any, avals: Sequence[Any]) -> Any:
    """The ``ClosedJaxpr`` of ``fn`` on abstract values ``avals`` (with
    their weak types and ``shard_map`` varying axes: ``jax.make_jaxpr``
    takes an abstract value as it is, in every declared version)."""
    return jax.make_jaxpr(fn)(*avals)


def sub_jaxprs(params: Any) -> list[Any]:
    """The open jaxprs among an equation's parameters (a call's ``jaxpr``,
    a ``cond``'s ``branches``), for walks that only read the structure."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if is_closed(item):
                found.append(item.jaxpr)
            elif hasattr(item, "eqns"):
                found.append(item)
    return found


def walk(jaxpr: Any, reverse: bool = False) -> Iterator[tuple[int, Any]]:
    """``(index, equation)`` for each equation of the open ``jaxpr`` itself
    (not those of its bodies: ``sub_jaxprs``/``structure_of`` give them),
    first to last, or last to first with ``reverse``: for a client that
    reads the program without evaluating it, such as a backward pass over
    it (the cotangents flow from the last equation to the first), or one
    that finds which equation made a value."""
    order = range(len(jaxpr.eqns) - 1, -1, -1) if reverse else range(len(jaxpr.eqns))
    for index in order:
        yield index, jaxpr.eqns[index]


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of the open ``jaxpr`` and of the jaxprs its
    equations hold, at any depth (for questions about the whole program:
    does it hold control flow?)."""
    stack = [jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            yield eqn
            stack.extend(sub_jaxprs(eqn.params))
