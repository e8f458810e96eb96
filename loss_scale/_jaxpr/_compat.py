"""What differs between the jax versions the package declares (0.8.0 to
0.10.x) when a jaxpr is evaluated equation by equation, in one place."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def closed_parts(body: Any) -> tuple[Any, list[Any]]:
    """``(open jaxpr, consts)`` of a parameter that holds a jaxpr: a
    ``ClosedJaxpr`` (``jit``, ``cond`` branches, ``scan``) or an open
    ``Jaxpr`` (``checkpoint``, ``shard_map``)."""
    if hasattr(body, "eqns"):
        return body, []
    return body.jaxpr, list(body.consts)


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
            if hasattr(item, "eqns"):
                found.append(item)
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item.jaxpr)
    return found


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of the open ``jaxpr`` and of the jaxprs its
    equations hold, at any depth (for questions about the whole program:
    does it hold control flow?)."""
    stack = [jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            yield eqn
            stack.extend(sub_jaxprs(eqn.params))
