"""The rewrite behind ``autocast``: a client of the jaxpr engine that
evaluates a float32 program with each operation in the dtype its list
(``_lists``) gives it.

Values change dtype, never shape: the environment holds, for a variable
declared float32, either a float32 value or one in the half dtype. Every
operation decides its inputs' dtypes from what it is, casts them where it
reads them (so a float32 parameter stays float32 and its gradient, the
transpose of the cast, is float32), and binds. Bodies are rebuilt
(``Mode.REBUILD``), so control flow stays control flow, a checkpoint
keeps its policy and a ``custom_jvp``/``custom_vjp`` keeps its rule; where
a body's signature must not change (a loop's carries, a branch's outputs,
a custom rule's primal inputs and outputs) the values are cast back to
their declared dtypes at its boundary.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from loss_scale._autocast._feeds import feeds_float32, program_jaxprs
from loss_scale._autocast._lists import (
    BEYOND_HALF,
    FLOAT32,
    FLOAT32_RESULT,
    FOLLOW,
    FULL_PRECISION_SCOPE,
    GROWING,
    HALF,
    SOFTMAX,
)
from loss_scale._autocast._softmax import Softmax, find_softmaxes, half_softmax
from loss_scale._jaxpr import (
    CUSTOM_RULES,
    NO_LABELS,
    Equation,
    Frame,
    Hooks,
    Interpreter,
    Labels,
    Mode,
    bind,
    equations,
    is_literal,
    structure_of,
)
from loss_scale._jaxpr._compat import at_source, trace_state
from loss_scale._jaxpr._structured import scope_part

_F32 = np.dtype(np.float32)
_PINNED: Labels = frozenset({FLOAT32_RESULT})
_BEYOND: Labels = frozenset({BEYOND_HALF})

# Bodies whose inputs and outputs keep their declared dtypes: a loop's
# carries and a branch's outputs must have one type whatever the
# iteration or branch, and a custom rule reads and returns the declared
# types. A jitted call, a checkpoint and a shard_map are traced again
# around whatever dtypes reach them.
_AT_DECLARED = frozenset({"cond", "scan", "while"}) | CUSTOM_RULES


def _float32(dtype: Any) -> bool:
    # ``==`` rather than ``np.dtype(...)``: a PRNG key's dtype is not a
    # NumPy one.
    return dtype is not None and dtype == _F32


# Calls entered: their equations join the caller's (XLA inlines them
# anyway), so a constant passed in (a mask's fill value) stays a constant
# the rewrite can see. Other bodies are rebuilt, to keep what the primitive
# holds besides its body: a checkpoint's policy, a custom rule, a loop.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


def _declared_f32(var: Any) -> bool:
    return _float32(getattr(var.aval, "dtype", None))


def _dtype(x: Any) -> Any:
    return getattr(x, "dtype", None)


def _convert_to(x: Any, dtype: np.dtype) -> Any:
    current = _dtype(x)
    if current is None or current == dtype:
        return x
    return lax.convert_element_type(x, dtype)


def _literal_magnitude(var: Any) -> float | None:
    if not is_literal(var) or np.size(var.val) != 1:
        return None
    return float(np.abs(np.asarray(var.val, dtype=np.float64)))


def grows(eqn: Any) -> bool:
    """Whether ``eqn``, a ``FOLLOW`` operation, can compute a value larger
    than its inputs: a product or quotient (``GROWING``), except a product
    by a literal of magnitude at most 1 and a quotient by one of at least 1
    (``x * 0.5``, ``x / n``), and ``integer_pow`` by 1."""
    name = eqn.primitive.name
    if name not in GROWING:
        return False
    if name == "integer_pow":
        return eqn.params["y"] != 1
    if name == "mul":
        return not any((m := _literal_magnitude(v)) is not None and m <= 1 for v in eqn.invars)
    if name == "div":
        m = _literal_magnitude(eqn.invars[1])
        return m is None or m < 1
    return True


def _returning(eqn: Any, dtype: np.dtype) -> Any:
    """A product equation that returns ``dtype`` (its accumulation type)."""
    if eqn.params.get("preferred_element_type") is None:
        return eqn
    return eqn.replace(params={**eqn.params, "preferred_element_type": dtype})


def accumulated(eqn: Any, half: np.dtype) -> Callable[[Any, Any], Any]:
    """The product ``eqn`` of two half-precision operands returning its
    float32 accumulation, with the derivative of the same product cast to
    float32 after it: the products of its forward and backward passes run
    in half precision, as a hand-cast model's ``(a @ b).astype(float32)``
    does, while its value never overflows the half range."""
    wide, narrow = _returning(eqn, _F32), _returning(eqn, half)

    @jax.custom_jvp
    def product(a: Any, b: Any) -> Any:
        return _convert_to(bind(wide, [a, b])[0], _F32)

    def tangent(primals: Any, tangents: Any) -> tuple[Any, Any]:
        (a, b), (ta, tb) = primals, tangents
        terms = []
        if not isinstance(ta, SymbolicZero):
            terms.append(bind(narrow, [ta, b])[0])
        if not isinstance(tb, SymbolicZero):
            terms.append(bind(narrow, [a, tb])[0])
        return product(a, b), _convert_to(functools.reduce(operator.add, terms), _F32)

    product.defjvp(tangent, symbolic_zeros=True)
    return product


def _as_array(var: Any, x: Any) -> Any:
    return x if isinstance(x, jax.Array) else jnp.asarray(x, var.aval.dtype)


def as_declared(variables: Sequence[Any], values: Sequence[Any]) -> list[Any]:
    """``values`` cast back to the dtypes their variables are declared with."""
    return [_convert_to(x, _F32) if _declared_f32(v) else x for v, x in zip(variables, values, strict=True)]


def in_full_precision(eqn: Any, frame: Frame) -> bool:
    """Whether ``eqn`` is called inside ``full_precision`` (its scope, or
    that of a call around it)."""
    return FULL_PRECISION_SCOPE in frame.scope or FULL_PRECISION_SCOPE in str(eqn.source_info.name_stack)


class Autocast(Hooks):
    """The hooks: each equation in its list's dtype, bodies rebuilt.

    Labels mark the float32 values computed in float32 on purpose
    (``FLOAT32_RESULT``): the outputs of the ``FLOAT32`` list, of
    ``full_precision`` calls, of the growing ``FOLLOW`` operations that feed
    a ``FLOAT32`` one (``feeding``, from ``_feeds.feeds_float32``) and of
    the products a softmax reads (``logits``, from the same with
    ``SOFTMAX``), and what ``FOLLOW`` operations compute from them; and the
    constants beyond the half range (``BEYOND_HALF``) with what moves or
    combines them."""

    def __init__(
        self,
        dtype: np.dtype,
        feeding: frozenset = frozenset(),
        logits: frozenset = frozenset(),
        softmaxes: dict[Any, Softmax] | None = None,
    ):
        self.dtype = np.dtype(dtype)
        self.largest = float(jnp.finfo(self.dtype).max)
        self.feeding, self.logits = feeding, logits
        self.softmaxes = softmaxes or {}
        # Each traced value cast to a dtype once per trace, however many
        # operations read it: (id of the value, dtype) -> [(trace, the value,
        # its cast)]. The value is kept so that its id is not reused; the
        # trace, because a cast made inside a loop body's trace is a value of
        # that trace only (a weight read inside a scan and after it).
        self._casts: dict[tuple[int, Any], list[tuple[Any, Any, Any]]] = {}

    def cast_inputs(self, eqn: Any, invals: Sequence[Any], dtype: np.dtype) -> list[Any]:
        """``eqn``'s declared-float32 inputs cast to ``dtype``, the casts
        placed at ``eqn``'s line of the user's code (for errors and
        ``range_report``)."""
        with at_source(eqn):
            return [self._cast(x, dtype) if _declared_f32(v) else x for v, x in zip(eqn.invars, invals, strict=True)]

    def _cast(self, x: Any, dtype: np.dtype) -> Any:
        if not isinstance(x, jax.core.Tracer) or _dtype(x) == dtype:
            return _convert_to(x, dtype)
        made = self._casts.setdefault((id(x), dtype), [])
        now = trace_state()
        for trace, _, cast in made:
            if trace == now:
                return cast
        cast = _convert_to(x, dtype)
        made.append((now, x, cast))
        return cast

    def _beyond_half(self, x: Any) -> bool:
        """Whether ``x``, a value known while tracing, holds a finite value
        beyond the half dtype's range (cast down, it would become an
        infinity)."""
        if isinstance(x, jax.core.Tracer) or not _float32(_dtype(x) or np.result_type(x)):
            return False
        magnitude = np.abs(np.asarray(x, dtype=np.float32))
        return bool(np.any(np.isfinite(magnitude) & (magnitude > self.largest)))

    def const_labels(self, value: Any) -> Labels:
        return _BEYOND if self._beyond_half(value) else NO_LABELS

    def _wide(self, eqn: Any, labels: Sequence[Labels]) -> bool:
        """Whether ``eqn`` reads a value beyond the half range: a constant
        (a literal, a closed-over array) or what was computed from one.
        Arguments are never looked at, eagerly or under ``jit``: what is
        decided does not depend on how the function is called."""
        return any(_declared_f32(v) and BEYOND_HALF in tag for v, tag in zip(eqn.invars, labels, strict=True))

    def _feeds(self, eqn: Any) -> bool:
        return any(v in self.feeding for v in eqn.outvars)

    def _logits(self, eqn: Any) -> bool:
        return any(v in self.logits for v in eqn.outvars)

    def mode(self, eqn: Any, labels: Sequence[Labels], frame: Frame) -> Mode:
        del labels
        if in_full_precision(eqn, frame):
            return Mode.KEEP
        if eqn.primitive.name in _CALLS:
            return Mode.ENTER
        return Mode.REBUILD

    def rebuild_with_effects(self, eqn: Any, frame: Frame) -> bool:
        # A body that prints or calls back is rewritten like any other; its
        # effects are traced again in their order.
        del eqn, frame
        return True

    def _half_softmax(self, eqn: Any, frame: Frame) -> Softmax | None:
        """The softmax ``eqn`` ends, where its result is read in half
        precision (``_softmax``), outside ``full_precision``."""
        if in_full_precision(eqn, frame):
            return None
        return self.softmaxes.get(eqn.outvars[0]) if eqn.outvars else None

    def propagate(self, eqn: Any, labels: Sequence[Labels], frame: Frame) -> list[Labels]:
        name = eqn.primitive.name
        if self._half_softmax(eqn, frame) is not None:
            return [NO_LABELS]
        if in_full_precision(eqn, frame) or name in FLOAT32:
            return [_PINNED] * len(eqn.outvars)
        floating = NO_LABELS.union(*(tag for v, tag in zip(eqn.invars, labels, strict=True) if _declared_f32(v)))
        if self._wide(eqn, labels):
            floating = floating | _BEYOND | (_PINNED if name in HALF else NO_LABELS)
        elif name in HALF:
            return [_PINNED if self._logits(eqn) else NO_LABELS] * len(eqn.outvars)
        if name in FOLLOW and self._feeds(eqn) and grows(eqn):
            floating = floating | _PINNED
        return [floating] * len(eqn.outvars)

    def outputs(self, jaxpr: Any, outs: list[Any], frame: Frame) -> list[Any]:
        if not frame.within:
            # A literal output (a constant the function returns) as an array
            # of its declared dtype, as ``jax.jit`` returns it.
            outs = [_as_array(v, x) for v, x in zip(jaxpr.outvars, outs, strict=True)]
        if not frame.within or frame.within[-1][0] in _AT_DECLARED:
            return as_declared(jaxpr.outvars, outs)
        return outs

    def equation(
        self, equation: Equation, invals: list[Any], bind_default: Callable[[list[Any]], list[Any]]
    ) -> list[Any]:
        eqn = equation.eqn
        name = eqn.primitive.name
        softmax = self._half_softmax(eqn, equation.frame)
        if softmax is not None:
            # Probabilities read in half precision: kept in half precision
            # for the backward pass, as the hand-cast model keeps them
            # (``_softmax``).
            with at_source(eqn):
                return [half_softmax(equation.read(softmax.x), softmax.axes, self.dtype)]
        if equation.mode is Mode.ENTER:
            # The call's equations join the caller's under its name (as
            # ``jit(log_softmax)``), so errors and ``range_report`` still say
            # where they come from.
            with at_source(eqn), jax.named_scope(scope_part(eqn)):
                return bind_default(invals)
        if equation.mode is Mode.REBUILD:
            if name in _AT_DECLARED:
                invals = self.cast_inputs(eqn, invals, _F32)
            return bind_default(invals)
        if structure_of(eqn) is not None or in_full_precision(eqn, equation.frame):
            return self._declared(eqn, invals)
        if name in HALF:
            if self._wide(eqn, equation.labels):
                return self._declared(eqn, invals)
            return self._half(eqn, invals)
        if name in FLOAT32:
            return bind(eqn, self.cast_inputs(eqn, invals, _F32))
        if name == "convert_element_type":
            return self._convert(eqn, invals)
        if name in FOLLOW:
            return self._follow(equation, invals)
        return self._declared(eqn, invals)

    def _declared(self, eqn: Any, invals: list[Any]) -> list[Any]:
        return bind(eqn, self.cast_inputs(eqn, invals, _F32))

    def _half(self, eqn: Any, invals: list[Any]) -> list[Any]:
        floating = [v for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
        if not floating or not all(_declared_f32(v) for v in floating):
            return self._declared(eqn, invals)
        vals = self.cast_inputs(eqn, invals, self.dtype)
        # A product whose result a softmax reads (attention's logits, a
        # classifier's) returns float32, accumulated from half operands, as
        # ``jax.nn.dot_product_attention`` computes its logits: half
        # precision would cap them at the half range for nothing, since the
        # softmax casts them up.
        if self._logits(eqn):
            with at_source(eqn):
                return [accumulated(eqn, self.dtype)(*vals)]
        return [_convert_to(x, self.dtype) for x in bind(_returning(eqn, self.dtype), vals)]

    def _convert(self, eqn: Any, invals: list[Any]) -> list[Any]:
        (var,), (x,) = eqn.invars, invals
        if _dtype(x) != var.aval.dtype and _float32(eqn.params["new_dtype"]):
            # A float32 value converted to float32 (a weak type made strong):
            # it stays in the dtype it has.
            return [x]
        return bind(eqn, [x])

    def _follow(self, equation: Equation, invals: list[Any]) -> list[Any]:
        eqn = equation.eqn
        reads_half = any(_declared_f32(v) and _dtype(x) == self.dtype for v, x in zip(eqn.invars, invals, strict=True))
        if not reads_half:
            return bind(eqn, invals)
        labelled = zip(eqn.invars, equation.labels, strict=True)
        pinned = any(_declared_f32(v) and FLOAT32_RESULT in tag for v, tag in labelled)
        in_float32 = pinned or self._wide(eqn, equation.labels)
        if not in_float32:
            # What a statistic or a loss reads is computed in float32 where
            # half precision could take it out of range (a product, a
            # square); what a softmax reads, also where it reads a float32
            # argument, parameter or result with a half value (a mask added
            # to logits).
            in_float32 = (self._feeds(eqn) and grows(eqn)) or (
                self._logits(eqn)
                and any(
                    _declared_f32(v) and not is_literal(v) and _dtype(x) == _F32
                    for v, x in zip(eqn.invars, invals, strict=True)
                )
            )
        return bind(eqn, self.cast_inputs(eqn, invals, _F32 if in_float32 else self.dtype))


def has_products(closed: Any) -> bool:
    """Whether ``closed`` computes a product or a convolution (outside
    ``full_precision``), anything to run in half precision: a program
    without one is left as it is (the function called itself, so its
    results are its own, bit for bit)."""
    return any(
        eqn.primitive.name in HALF and FULL_PRECISION_SCOPE not in str(eqn.source_info.name_stack)
        for eqn in equations(closed.jaxpr)
    )


def rewrite(closed: Any, args: Sequence[Any], dtype: np.dtype) -> list[Any]:
    """The outputs of ``closed`` on ``args`` with each operation in the
    dtype its list gives it (``dtype`` the half precision)."""
    feeding, logits = feeds_float32(closed.jaxpr), feeds_float32(closed.jaxpr, SOFTMAX)
    jaxprs = program_jaxprs(closed.jaxpr)
    softmaxes = find_softmaxes(jaxprs, feeding)
    return Interpreter(Autocast(dtype, feeding, logits, softmaxes)).run(closed, args)
