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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from loss_scale._autocast._lists import FLOAT32, FLOAT32_RESULT, FOLLOW, FULL_PRECISION_SCOPE, HALF
from loss_scale._jaxpr import (
    NO_LABELS,
    Equation,
    Frame,
    Hooks,
    Interpreter,
    Labels,
    Mode,
    bind,
    equations,
    structure_of,
)
from loss_scale._jaxpr._compat import at_source
from loss_scale._jaxpr._structured import scope_part

_F32 = np.dtype(np.float32)
_PINNED: Labels = frozenset({FLOAT32_RESULT})

# Bodies whose inputs and outputs keep their declared dtypes: a loop's
# carries and a branch's outputs must have one type whatever the
# iteration or branch, and a custom rule reads and returns the declared
# types. A jitted call, a checkpoint and a shard_map are traced again
# around whatever dtypes reach them.
_AT_DECLARED = frozenset({"cond", "scan", "while", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


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
    (``FLOAT32_RESULT``): the outputs of the ``FLOAT32`` list and of
    ``full_precision`` calls, and what ``FOLLOW`` operations compute from
    them in float32."""

    def __init__(self, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.largest = float(jnp.finfo(self.dtype).max)
        # Each traced value cast to a dtype once, however many operations
        # read it: (id of the value, dtype) -> (the value, its cast). Only
        # tracers, which live in one trace; the value is kept so that its id
        # is not reused.
        self._casts: dict[tuple[int, Any], tuple[Any, Any]] = {}

    def cast_inputs(self, eqn: Any, invals: Sequence[Any], dtype: np.dtype) -> list[Any]:
        """``eqn``'s declared-float32 inputs cast to ``dtype``, the casts
        placed at ``eqn``'s line of the user's code (for errors and
        ``range_report``)."""
        with at_source(eqn):
            return [self._cast(x, dtype) if _declared_f32(v) else x for v, x in zip(eqn.invars, invals, strict=True)]

    def _cast(self, x: Any, dtype: np.dtype) -> Any:
        if not isinstance(x, jax.core.Tracer):
            return _convert_to(x, dtype)
        key = (id(x), dtype)
        if key not in self._casts:
            self._casts[key] = (x, _convert_to(x, dtype))
        return self._casts[key][1]

    def _too_wide(self, x: Any) -> bool:
        """Whether ``x`` is a constant (known while tracing) with a finite
        value beyond the half dtype's range, e.g. ``jnp.finfo(jnp.float32).min``
        as a mask: cast down, it would become an infinity."""
        if isinstance(x, jax.core.Tracer) or _dtype(x) is None:
            return False
        magnitude = np.abs(np.asarray(x, dtype=np.float32))
        return bool(np.any(np.isfinite(magnitude) & (magnitude > self.largest)))

    def mode(self, eqn: Any, labels: Sequence[Labels], frame: Frame) -> Mode:
        del labels
        if in_full_precision(eqn, frame):
            return Mode.KEEP
        if eqn.primitive.name in _CALLS:
            return Mode.ENTER
        return Mode.REBUILD

    def propagate(self, eqn: Any, labels: Sequence[Labels], frame: Frame) -> list[Labels]:
        name = eqn.primitive.name
        if in_full_precision(eqn, frame) or name in FLOAT32:
            return [_PINNED] * len(eqn.outvars)
        if name in HALF:
            return [NO_LABELS] * len(eqn.outvars)
        floating = [tag for v, tag in zip(eqn.invars, labels, strict=True) if _declared_f32(v)]
        return [NO_LABELS.union(*floating)] * len(eqn.outvars)

    def relabel(self, equation: Equation, labels: list[Labels]) -> list[Labels]:
        # A constant beyond the half range (a mask's fill, float32's minimum
        # or -1e9) and what moves it (a broadcast, a reshape) are float32
        # results too: an operation that reads one with a half value runs
        # in float32 rather than turn the constant into an infinity.
        eqn = equation.eqn
        if (eqn.primitive.name in FOLLOW or eqn.primitive.name == "convert_element_type") and any(
            _declared_f32(v) and self._too_wide(equation.read(v)) for v in eqn.invars
        ):
            return [_PINNED] * len(labels)
        return labels

    def outputs(self, jaxpr: Any, outs: list[Any], frame: Frame) -> list[Any]:
        if not frame.within or frame.within[-1][0] in _AT_DECLARED:
            return as_declared(jaxpr.outvars, outs)
        return outs

    def equation(
        self, equation: Equation, invals: list[Any], bind_default: Callable[[list[Any]], list[Any]]
    ) -> list[Any]:
        eqn = equation.eqn
        name = eqn.primitive.name
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
        params = dict(eqn.params)
        if params.get("preferred_element_type") is not None:
            params["preferred_element_type"] = self.dtype
        return bind(eqn.replace(params=params), vals)

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
        pinned = any(
            _declared_f32(v) and (FLOAT32_RESULT in tag or self._too_wide(x))
            for v, x, tag in zip(eqn.invars, invals, equation.labels, strict=True)
        )
        dtype = _F32 if pinned else self.dtype
        return bind(eqn, self.cast_inputs(eqn, invals, dtype))


def rewrite(closed: Any, args: Sequence[Any], dtype: np.dtype) -> list[Any]:
    """The outputs of ``closed`` on ``args`` with each operation in the
    dtype its list gives it (``dtype`` the half precision). A program
    without a product or convolution has nothing to compute in half
    precision: it is evaluated as it is (its calls compiled as they were,
    so its results are the function's own, bit for bit)."""
    if any(eqn.primitive.name in HALF for eqn in equations(closed.jaxpr)):
        return Interpreter(Autocast(dtype)).run(closed, args)
    return Interpreter().run(closed, args)
