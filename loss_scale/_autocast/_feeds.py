"""Which values feed a float32 operation: the consumer side of autocast's
rule.

A ``FOLLOW`` operation runs in its inputs' dtype, which is right for what
a half-precision value can hold, and wrong for what is about to be
reduced, exponentiated or normalised in float32: the square that a
variance sums (``x * x`` overflows float16 once ``|x| >= 256``), the
error an MSE squares, the mask added to logits before a softmax (a
``-1e9`` read in float16 becomes ``-inf``). The frameworks' own
half-precision layers and torch's autocast compute those in float32
(flax casts a norm's input up before its statistics, torch runs ``pow``,
the norms and ``mse_loss`` in float32). A trace of a float32 model
cannot show where such an upcast was written (in float32 it is a no-op),
so it is decided from the program instead: this module finds the values
a ``FLOAT32`` operation reads, directly or through ``FOLLOW`` operations,
and ``_rewrite`` runs in float32 those of their ``FOLLOW`` operations that
could take them out of the half range (a product or quotient that can
grow, or one that reads a float32 value together with a half one).

The walk back from a ``FLOAT32`` operation stops at products and
convolutions (``HALF``), at other ``FLOAT32`` operations, at operations
that run as declared and at bounded functions (``BOUNDED``: ``tanh(x)``
is at most 1 whatever ``x``), so it reaches from a statistic to the last
product and no further: the activations between two products stay in
half precision.

The analysis reads the program without evaluating it (``walk``,
``bodies``) and follows values into and out of every body (jitted calls,
``checkpoint``, ``custom_jvp``/``custom_vjp``, ``cond``, ``scan``,
``while``, ``shard_map``), loops' carries included, to a fixed point. A
body shared by several calls (one jitted function called twice) is one
jaxpr: what feeds float32 in one call counts in all of them.
"""

from __future__ import annotations

from typing import Any

from loss_scale._autocast._lists import BOUNDED, FLOAT32, FOLLOW
from loss_scale._jaxpr import bodies, is_dropped, is_literal, walk

# Operations a value passes through on its way to a float32 operation (a
# bounded function ends the way: its input cannot take its output, or a
# statistic of it, out of range).
_THROUGH = (FOLLOW - BOUNDED) | {"convert_element_type"}


def program_jaxprs(top: Any) -> list[Any]:
    """``top`` and every body inside it, each once."""
    found, seen, stack = [], set(), [top]
    while stack:
        jaxpr = stack.pop()
        if id(jaxpr) in seen:
            continue
        seen.add(id(jaxpr))
        found.append(jaxpr)
        for _, eqn in walk(jaxpr):
            stack.extend(body.jaxpr for body in bodies(eqn))
    return found


def feeds_float32(jaxpr: Any, readers: frozenset = FLOAT32) -> frozenset:
    """The variables of ``jaxpr`` (and of its bodies) whose values are read
    by a ``FLOAT32`` operation (one of ``readers``: ``SOFTMAX`` for the
    logits), directly or through ``FOLLOW`` operations.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> def rms(w, x):
      ...     h = x @ w
      ...     return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True))
      >>> jaxpr = jax.make_jaxpr(rms)(jnp.ones((3, 3)), jnp.ones((2, 3))).jaxpr
      >>> feeding = feeds_float32(jaxpr)
      >>> [e.primitive.name for e in jaxpr.eqns if any(v in feeding for v in e.outvars)]
      ['dot_general', 'mul', 'reduce_sum', 'broadcast_in_dim', 'div']
    """
    reach: set = set()
    jaxprs = program_jaxprs(jaxpr)

    def mark(variables: Any) -> bool:
        new = [v for v in variables if not is_literal(v) and not is_dropped(v) and v not in reach]
        reach.update(new)
        return bool(new)

    changed = True
    while changed:
        changed = False
        for each in jaxprs:
            for _, eqn in walk(each, reverse=True):
                name = eqn.primitive.name
                if name in readers:
                    changed |= mark(eqn.invars)
                elif name in _THROUGH:
                    if any(v in reach for v in eqn.outvars):
                        changed |= mark(eqn.invars)
                elif name not in BOUNDED and name not in FLOAT32:
                    changed |= _across(eqn, reach, mark)
    return frozenset(reach)


def _across(eqn: Any, reach: set, mark: Any) -> bool:
    """Marks what feeds float32 across a structured equation's boundary:
    a body's output whose equation output (or, for a carry, whose next
    iteration's input) feeds float32, and an operand whose body input
    does."""
    found = bodies(eqn)
    fed_operands = {
        source
        for body in found
        for source, var in zip(body.inputs, body.jaxpr.invars, strict=True)
        if source is not None and var in reach
    }
    changed = mark(eqn.invars[i] for i in sorted(fed_operands))
    for body in found:
        outs = [
            var
            for var, out, back in zip(body.jaxpr.outvars, body.outputs, body.feedback, strict=True)
            if (out is not None and eqn.outvars[out] in reach) or back in fed_operands
        ]
        changed |= mark(outs)
    return changed
