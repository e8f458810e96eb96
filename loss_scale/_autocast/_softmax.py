"""Softmaxes whose probabilities are read in half precision: autocast
computes them in float32 and keeps them for the backward pass in half
precision, as a hand-cast model's float16 softmax keeps them.

An attention's probabilities are the largest arrays of a transformer's
step (batch x heads x seq x seq). Run operation by operation, a softmax
of half-precision logits runs in float32 (``exp``, the sum and the
maximum are on the ``FLOAT32`` list), and the backward pass of ``exp`` and
of the division reads their float32 results: JAX keeps a float32 copy of
the probabilities per layer, twice the bytes of the model's own float16
mode, and the gap grows with the square of the sequence length. So a
softmax (``jax.nn.softmax``, inline or as its ``custom_jvp``, or the same
operations written out) whose result only half-precision operations read
(no ``FLOAT32`` operation, no output of its jaxpr) becomes one operation,
``half_softmax``: float32 inside its kernels, its result in half
precision, and a derivative computed from that half-precision result,
which is what JAX keeps, in half precision as the hand-cast model's
(``y * g - y * sum(y * g)``, the sum in float32).

The pattern, in every form JAX writes it::

    m = reduce_max(x, axes)         # then, optionally: max(initial, m)
    e = exp(x - stop_gradient?(broadcast(m)))
    y = e / broadcast(reduce_sum(e, axes))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._jaxpr import is_literal, walk

_F32 = np.dtype(np.float32)
# Operations that move a reduced value back to its input's shape, or hide
# it from the derivative, without changing it.
_MOVES = frozenset({"broadcast_in_dim", "reshape", "stop_gradient", "expand_dims"})


class Softmax(NamedTuple):
    """A softmax found in a program: its input variable and its axes."""

    x: Any
    axes: tuple[int, ...]


def _past_moves(var: Any, made_by: dict[Any, Any]) -> Any:
    """The equation that made ``var``, looking through moves."""
    eqn = made_by.get(var)
    while eqn is not None and eqn.primitive.name in _MOVES:
        eqn = made_by.get(eqn.invars[0])
    return eqn


def _source(var: Any, made_by: dict[Any, Any]) -> Any:
    """The equation that made ``var``, looking through moves and a
    ``max(initial, .)`` (the guard ``jax.nn.softmax`` puts on its maximum:
    a softmax is the same whatever it subtracts)."""
    eqn = _past_moves(var, made_by)
    if eqn is None or eqn.primitive.name != "max":
        return eqn
    peaks = [
        made
        for v in eqn.invars
        if not is_literal(v) and (made := _past_moves(v, made_by)) is not None and made.primitive.name == "reduce_max"
    ]
    return peaks[0] if len(peaks) == 1 else eqn


def _match(div: Any, made_by: dict[Any, Any]) -> Softmax | None:
    """The softmax that division ``div`` ends, if it ends one."""
    numerator, denominator = div.invars
    if is_literal(numerator) or is_literal(denominator):
        return None
    exp = made_by.get(numerator)
    total = _source(denominator, made_by)
    if exp is None or exp.primitive.name != "exp" or total is None or total.primitive.name != "reduce_sum":
        return None
    sub = made_by.get(exp.invars[0])
    if total.invars[0] is not numerator or sub is None or sub.primitive.name != "sub":
        return None
    x, shift = sub.invars
    peak = None if is_literal(shift) else _source(shift, made_by)
    if peak is None or peak.primitive.name != "reduce_max" or peak.invars[0] is not x:
        return None
    axes = tuple(peak.params["axes"])
    if tuple(total.params["axes"]) != axes or is_literal(x):
        return None
    return Softmax(x, axes)


def _body_softmax(eqn: Any) -> Softmax | None:
    """The softmax of a ``custom_jvp`` call whose body is one (as
    ``jax.nn.softmax`` is from jax 0.11), in terms of the call's operands."""
    closed = eqn.params.get("call_jaxpr")
    if closed is None:
        return None
    body = getattr(closed, "jaxpr", closed)
    made_by = {v: e for _, e in walk(body) for v in e.outvars}
    if len(body.outvars) != 1 or not made_by:
        return None
    last = made_by.get(body.outvars[0])
    found = None if last is None or last.primitive.name != "div" else _match(last, made_by)
    # Its input is one of the call's operands (jax 0.10's has a second: the
    # maximum's initial value).
    index = next((i for i, v in enumerate(body.invars) if found is not None and v is found.x), None)
    if index is None:
        return None
    return Softmax(eqn.invars[index], found.axes)


def find_softmaxes(jaxprs: Sequence[Any], exclude: frozenset) -> dict[Any, Softmax]:
    """The softmaxes of ``jaxprs`` (a program and its bodies) whose result
    is read in half precision: keyed by the result's variable, none whose
    result is in ``exclude`` (what a ``FLOAT32`` operation reads) or is an
    output of its jaxpr."""
    found: dict[Any, Softmax] = {}
    for jaxpr in jaxprs:
        made_by = {v: e for _, e in walk(jaxpr) for v in e.outvars}
        returned = {v for v in jaxpr.outvars if not is_literal(v)}
        for _, eqn in walk(jaxpr):
            name = eqn.primitive.name
            if name == "div":
                softmax = _match(eqn, made_by)
            elif name == "custom_jvp_call":
                softmax = _body_softmax(eqn)
            else:
                continue
            out = eqn.outvars[0]
            if softmax is not None and out not in exclude and out not in returned:
                found[out] = softmax
    return found


def half_softmax(x: jax.Array, axes: tuple[int, ...], dtype: Any) -> jax.Array:
    """``softmax(x)`` over ``axes`` computed in float32, returned in
    ``dtype``; its derivative reads that result (the one array the backward
    pass keeps), runs in ``dtype`` with its sum in float32, and returns
    ``x``'s dtype.

    Examples:
      >>> import jax.numpy as jnp
      >>> y = half_softmax(jnp.array([[0.0, 1.0, 2.0]], jnp.float16), (1,), jnp.float16)
      >>> y.dtype, [round(float(v), 3) for v in y[0]]
      (dtype('float16'), [0.09, 0.245, 0.665])
    """
    dtype, x_dtype = np.dtype(dtype), x.dtype

    def forward(x: jax.Array) -> jax.Array:
        x32 = x.astype(_F32)
        shifted = x32 - jax.lax.stop_gradient(jnp.max(x32, axis=axes, keepdims=True))
        e = jnp.exp(shifted)
        return (e / jnp.sum(e, axis=axes, keepdims=True)).astype(dtype)

    @jax.custom_vjp
    def softmax(x: jax.Array) -> jax.Array:
        return forward(x)

    def fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = forward(x)
        return y, y

    def bwd(y: jax.Array, g: jax.Array) -> tuple[jax.Array]:
        # In half precision, as the hand-cast model's derivative runs, but
        # written so that nothing overflows: |y * g| <= |g|, the sum of
        # those products is taken in float32 and is at most max|g|, and
        # y * g - y * sum, equal to y * (g - sum), is at most max|g| / 2
        # (where g - sum, multiplied by a zero probability, could be an
        # infinity and make a NaN).
        g = g.astype(dtype)
        total = jnp.sum(y * g, axis=axes, keepdims=True, dtype=_F32).astype(dtype)
        dx = y * g - y * total
        return (dx.astype(x_dtype),)

    softmax.defvjp(fwd, bwd)
    return softmax(x)
