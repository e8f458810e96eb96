"""What a skipped step keeps, and how it is skipped without a branch.

A skipped step returns the inner optimizer's state as it was
(``kept_inner_state``), and zero updates or the params as they were. The
reference is one ``lax.cond`` around the inner update (``reference``);
``apply_or_skip`` takes it, or a faster form that equals it in values, in
derivatives and in what it computes:

* **a concrete decision** (an eager step): the taken or the skipped branch
  alone, chosen in Python; nothing else runs.
* **the select path** (traced, where the inner update has no effects and
  no ``while_loop``/``cond``/``scan``, and every operation that reads a
  gradient is one the path knows). A ``lax.cond`` makes XLA
  materialize every operand of the conditional: the gradients, in float32,
  before the update reads them (in a float16 backward pass, the float32 copy
  of every weight gradient that a bare step never writes). Without the
  branch XLA fuses the gradients' producer into the update as it does for a
  bare optimizer. The update then runs on every step and the old values are
  kept with ``lax.select`` (exact: the old bits) where the step is skipped.
  Each new state leaf is selected where the jaxpr produces it, and its
  consumers read the selected value: selecting only the outputs would leave
  every consumer (Adam's parameter update reads the new moments) recomputing
  the new value from the old buffer, which XLA:CPU does in a second pass.

  On a skipped step that discarded computation reads zeros for the
  gradients and old values where new ones would be (Adam's bias correction
  reads the old count, 0 before the first applied step; adafactor's
  normalisation its zero moments; a preconditioner a zero matrix), which an
  optimizer's formulas never see. So every operation that reads such a
  value is either known to be finite, with finite derivatives, on every
  finite operand (``FINITE``: sums, products, maxima, ``exp``, ``tanh``,
  reshapes, sorts, cumulative sums, ...), or is one that is not but reads,
  where the step is skipped, a value on which it is (a division, ``sqrt``,
  ``rsqrt``, ``log``, ``pow``, ...: ``GUARDED``, which reads
  ``select(go, x, 1)``, fused into the same loop), or is a call entered to
  do the same inside it (``jit``, ``checkpoint``). Any other operation
  (a linear solve, a factorisation, an eigendecomposition, a host callback,
  a function with a custom derivative rule, a primitive not listed) sends
  the step to the ``lax.cond``: a skipped step computes nothing non-finite
  that its inputs do not force, and ``jax_debug_nans`` sees nothing. The
  values of a taken step are untouched (the guard selects ``x`` itself
  there).

  Its derivatives are the reference's: the select path is a
  ``jax.custom_jvp`` function, differentiated through its guarded
  evaluation in a form without a branch (so that it stays differentiable
  under ``vmap``, where JAX cannot transpose a ``lax.cond`` that carries
  tangents: jax-ml/jax#22011). Only the perturbed inputs carry tangents,
  and the consumers of a selected state value read its new value's
  tangent (that of the bare update, a symbolic zero included), so a taken
  step differentiates exactly as the bare optimizer; the outputs are
  selected once more, so a skipped step has derivative 0 with respect to
  the gradients, the learning rate and the params, and 1 with respect to
  the kept state. Its cotangents reach the discarded computation only
  through a ``select`` (as zeros), and every partial derivative there is
  finite, by the rule above.

Where the inner update has effects (callbacks, prints) or control flow
(``while_loop``, ``cond``, ``scan``: a line search, ``optax.MultiSteps``),
running it on a skipped step would be observable or costly, and a traced
update keeps the ``lax.cond``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale._jaxpr import NO_LABELS, Equation, Frame, Hooks, Interpreter, Mode, equations, is_literal, structure_of
from loss_scale._jaxpr._structured import CUSTOM_RULES
from loss_scale._sharding import match_varying
from loss_scale._trees import first_difference
from loss_scale._unscale import is_float_leaf

# Primitives whose cost or behaviour on a skipped step's inputs is not that
# of a few elementwise passes.
_CONTROL_FLOW = frozenset({"while", "cond", "scan"})

# Operations that can give a non-finite result (or derivative) on finite
# operands, with the operands that decide it and a value on which both are
# finite: a division by zero, the square root or logarithm of a negative
# number or of zero, a power of zero with a negative exponent, a pole.
GUARDED: Mapping[str, tuple[tuple[int, ...], float]] = {
    "div": ((1,), 1.0),
    "rem": ((1,), 1.0),
    "sqrt": ((0,), 1.0),
    "rsqrt": ((0,), 1.0),
    "cbrt": ((0,), 1.0),
    "log": ((0,), 1.0),
    "log1p": ((0,), 0.0),
    "pow": ((0, 1), 1.0),
    "tan": ((0,), 0.0),
    "atan2": ((0, 1), 1.0),
    "acos": ((0,), 0.0),
    "asin": ((0,), 0.0),
    "acosh": ((0,), 2.0),
    "atanh": ((0,), 0.0),
    "erf_inv": ((0,), 0.0),
    "lgamma": ((0,), 1.0),
    "digamma": ((0,), 1.0),
    "bitcast_convert_type": ((0,), 1.0),  # integer bits can be an infinity's or a NaN's
}

# Operations whose results and partial derivatives are finite on every
# finite operand (an overflow aside, which a bare step meets the same way):
# arithmetic without poles, comparisons and bit operations, the data
# movement of arrays, reductions, sorts and cumulative ops, products,
# collectives, and the integer arithmetic of PRNG keys. ``integer_pow``
# with a negative exponent is guarded (``_SelectPath.equation``).
FINITE = frozenset(
    """
    abs add add_any and argmax argmin asinh atan ceil clamp clz complex conj cos cosh erf erfc exp exp2
    expm1 floor imag integer_pow is_finite logistic max min mul mulhi ne neg nextafter not or population_count
    real reduce_precision round select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh
    square stop_gradient sub tanh xor eq ge gt le lt convert_element_type copy
    broadcast_in_dim concatenate dynamic_slice dynamic_update_slice gather iota pad reshape rev scatter
    scatter-add scatter-sub scatter-mul scatter-min scatter-max slice split squeeze transpose
    reduce_and reduce_max reduce_min reduce_or reduce_prod reduce_sum reduce_xor
    cumlogsumexp cummax cummin cumprod cumsum sort top_k dot_general conv_general_dilated
    optimization_barrier sharding_constraint device_put pvary psum pmax pmin all_gather all_to_all ppermute
    axis_index random_bits random_fold_in random_seed random_split random_unwrap random_wrap threefry2x32
    """.split()  # noqa: SIM905 - a table of names, read as words
)


class _Unknown(Exception):
    """An operation the select path cannot keep finite on a skipped step
    reads a gradient (or a value computed from one): the step takes the
    ``lax.cond`` instead."""


def runs_unconditionally(closed: jax.extend.core.ClosedJaxpr) -> bool:
    """Whether the jaxpr may run on every step, its result selected away on
    skipped ones: no effects, and no control flow at any depth."""
    if closed.effects:
        return False
    return not any(eqn.primitive.name in _CONTROL_FLOW for eqn in equations(closed.jaxpr))


def select(go: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``go``, else ``old``, for one array of any dtype (typed
    PRNG keys included); a ``float0`` leaf holds nothing and is ``new``."""
    if not hasattr(new, "dtype"):  # a literal of the jaxpr: a Python scalar
        new = jnp.asarray(new, old.dtype)
    if new.dtype == jax.dtypes.float0:
        return new
    return jax.lax.select(go, new, old)


def apply_or_skip(
    go: jax.Array,
    traced: jax.extend.core.ClosedJaxpr,
    taken: Callable[[Sequence[Any]], list[Any]],
    kept: Callable[[Sequence[Any]], list[Any]],
    num_grads: int,
    args: Sequence[Any],
) -> list[Any]:
    """``taken(args)`` where ``go``, else ``kept(args)``.

    ``args`` are the flat leaves of the gradients (the first ``num_grads``),
    the inner state and the params; ``taken`` is the applied step (whose
    jaxpr is ``traced``) and ``kept`` the skipped step's outputs, leaf for
    leaf. Equal to ``reference`` in values and derivatives (see the module
    docstring for the forms it takes); an eager step calls ``taken`` itself,
    so that it computes what the bare optimizer computes, op for op."""
    consts, args = list(traced.consts), list(args)
    decided = _concrete(go)
    if decided is not None:
        return list(taken(args)) if decided else list(kept(args))
    if not runs_unconditionally(traced):
        return reference(go, traced.jaxpr, kept, num_grads, consts, args)

    def select_path(go, consts, args, derivatives):
        zeroed = _zero_gradients(go, args, num_grads)
        old = dict(enumerate(kept(args)))
        return _evaluate_selecting(traced.jaxpr, consts, zeroed, go, old, num_grads, derivatives)

    @jax.custom_jvp
    def branch_free(go, consts, args):
        return select_path(go, consts, args, derivatives=False)

    def branch_free_jvp(primals, tangents):
        # Only the perturbed inputs carry tangents, so that the rest stay
        # symbolic zeros as in a bare update (an instantiated zero tangent
        # meets an infinite partial derivative, sqrt's at 0, and gives
        # 0 * inf = nan).
        flat_primals, treedef = jax.tree.flatten(primals)
        flat_tangents = jax.tree.leaves(tangents, is_leaf=_is_symbolic_zero)
        perturbed = [not _is_symbolic_zero(t) for t in flat_tangents]

        def of_perturbed(*values):
            values = iter(values)
            full = [next(values) if p else x for x, p in zip(flat_primals, perturbed, strict=True)]
            return select_path(*jax.tree.unflatten(treedef, full), derivatives=True)

        return jax.jvp(
            of_perturbed,
            [x for x, p in zip(flat_primals, perturbed, strict=True) if p],
            [t for t, p in zip(flat_tangents, perturbed, strict=True) if p],
        )

    branch_free.defjvp(branch_free_jvp, symbolic_zeros=True)
    try:
        return branch_free(go, consts, args)
    except _Unknown:
        # Raised while the select path was traced, before anything of it
        # was kept; the same decision holds for its derivative rule.
        return reference(go, traced.jaxpr, kept, num_grads, consts, args)


def reference(
    go: jax.Array,
    jaxpr: jax.extend.core.Jaxpr,
    kept: Callable[[Sequence[Any]], list[Any]],
    num_grads: int,
    consts: Sequence[Any],
    args: Sequence[Any],
) -> list[Any]:
    """The skip as one ``lax.cond``: ``jaxpr`` evaluated where ``go``,
    ``kept(args)`` where not. The taken branch reads the gradients zeroed
    where the step is skipped, which changes nothing where ``lax.cond`` is a
    branch and keeps a ``vmap``-ped one (both branches run, and a selection)
    from differentiating through non-finite gradients."""

    def taken(consts, args):
        return jax.core.eval_jaxpr(jaxpr, consts, *_zero_gradients(go, args, num_grads))

    def skipped(consts, args):
        del consts
        return list(kept(args))

    return jax.lax.cond(go, taken, skipped, list(consts), list(args))


def _is_symbolic_zero(x: Any) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


def _concrete(go: Any) -> bool | None:
    """``go`` as a Python bool where it is known while tracing (an eager
    step, or an eager ``jax.grad``), else None."""
    try:
        return bool(go)
    except jax.errors.ConcretizationTypeError:
        return None
    except RuntimeError:  # an array spread over other processes' devices
        return None


def _zero_gradients(go: jax.Array, args: Sequence[Any], num_grads: int) -> list[Any]:
    """``args`` with its first ``num_grads`` floating leaves zeroed where
    ``go`` is False, so that nothing computed from them there is
    non-finite."""

    def zeroed(g):
        return _select(go, g, 0) if is_float_leaf(g) else g

    return [zeroed(g) for g in args[:num_grads]] + list(args[num_grads:])


def _evaluate_selecting(
    jaxpr: jax.extend.core.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    go: jax.Array,
    old: Mapping[int, Any],
    num_suspect: int,
    derivatives: bool = False,
) -> list[Any]:
    """Evaluates ``jaxpr`` and returns its outputs, output ``i`` (for each
    ``i`` in ``old``) as ``select(go, new, old[i])``, selected where an
    equation produces it so that every later equation reads the selected
    value (the module docstring says why), and once more on the way out
    where that did not already choose against ``old[i]`` (one value returned
    as two state leaves, an input or a literal returned as it is).

    The first ``num_suspect`` inputs (the zeroed gradients) and every
    selected value hold, on a skipped step, what the update's formulas never
    read; every ``GUARDED`` operation on a value computed from them reads a
    safe value there instead, and an operation neither ``GUARDED`` nor
    ``FINITE`` raises ``_Unknown`` (``_SelectPath``, the hooks of the
    package's jaxpr interpreter).

    With ``derivatives`` (the form the select path is differentiated in),
    the consumers of a selected value read ``select(go, new,
    stop_gradient(old))``, whose tangent is the new value's (a symbolic zero
    where the bare update's is one), and every output is selected on the
    way out, which gives it the old value's tangent where the step is
    skipped; the values are the same."""
    chosen: dict[Any, Any] = {}
    for index, var in enumerate(jaxpr.outvars):
        if index in old and not is_literal(var):
            chosen.setdefault(var, old[index])
    hooks = _SelectPath(go, chosen, derivatives)
    labels = [_SUSPECT] * num_suspect + [NO_LABELS] * (len(jaxpr.invars) - num_suspect)
    outs, _ = Interpreter(hooks).evaluate(jaxpr, consts, args, labels, Frame())
    outputs = []
    for index, (var, value) in enumerate(zip(jaxpr.outvars, outs, strict=True)):
        literal = is_literal(var)
        if index in old and (literal or var not in hooks.selected or chosen[var] is not old[index]):
            value = select(go, value, old[index])
        outputs.append(value)
    return outputs


# The label of a value that holds, on a skipped step, what the update's
# formulas never read: a zeroed gradient, a selected-back state value, or
# anything computed from one.
_SUSPECT = frozenset({"suspect"})


class _SelectPath(Hooks):
    """The select path's hooks: calls that read a suspect value are entered
    (to guard what their bodies compute), every ``GUARDED`` operation reads
    a safe value where its operand is suspect and the step is skipped, any
    operation on a suspect value that is neither ``GUARDED`` nor ``FINITE``
    raises ``_Unknown``, and the top-level results that are new state
    values are selected against the old ones where they are produced (and
    are suspect from then on)."""

    def __init__(self, go: jax.Array, chosen: Mapping[Any, Any], derivatives: bool = False):
        self.go, self.chosen, self.derivatives = go, chosen, derivatives
        self.selected: set[Any] = set()

    def mode(self, eqn: Any, labels: Sequence[Any], frame: Frame) -> Mode:
        del frame
        if not any(label >= _SUSPECT for label in labels):
            return Mode.KEEP
        # Calls (jit, checkpoint: those the engine can enter, but for
        # custom derivative rules) that read a suspect value are entered, to
        # guard the operations inside; anything else on a suspect value
        # (control flow, a custom rule, a custom_linear_solve) is unknown.
        structure = structure_of(eqn)
        if structure is not None and Mode.ENTER in structure.modes and eqn.primitive.name not in CUSTOM_RULES:
            return Mode.ENTER
        raise _Unknown(eqn.primitive.name)

    def equation(self, equation: Equation, invals: list[Any], bind: Any) -> list[Any]:
        eqn, suspects = equation.eqn, [label >= _SUSPECT for label in equation.labels]
        name = eqn.primitive.name
        # (A structured equation on a suspect value is entered, or ``mode`` raised.)
        if any(suspects) and equation.mode is Mode.KEEP:
            if name in GUARDED:
                positions, safe = GUARDED[name]
                invals = [
                    _guard(self.go, v, safe) if i in positions and suspects[i] else v for i, v in enumerate(invals)
                ]
            elif name == "integer_pow" and eqn.params["y"] < 0:
                invals = [_guard(self.go, invals[0], 1.0)]
            elif name not in FINITE:
                raise _Unknown(name)
        outs = bind(invals)
        if equation.frame.depth == 0:
            for i, var in enumerate(eqn.outvars):
                if var in self.chosen:
                    outs[i] = self._select(outs[i], var)
        return outs

    def _select(self, new: Any, var: Any) -> Any:
        """A new state value as its consumers read it (module docstring)."""
        if self.derivatives:
            return select(self.go, new, jax.lax.stop_gradient(self.chosen[var]))
        self.selected.add(var)
        return select(self.go, new, self.chosen[var])

    def relabel(self, equation: Equation, labels: list[Any]) -> list[Any]:
        if equation.frame.depth == 0:
            return [
                _SUSPECT | label if var in self.chosen else label
                for var, label in zip(equation.eqn.outvars, labels, strict=True)
            ]
        return labels


def _guard(go: jax.Array, value: Any, safe: float) -> Any:
    """``value`` where ``go``, else ``safe`` (an operand on which a
    ``GUARDED`` operation is finite)."""
    if not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.inexact):
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.integer):
            return _select(go, value, 1)
        return value
    return _select(go, value, safe)


def _select(go: jax.Array, value: jax.Array, fill: float) -> jax.Array:
    """``value`` where the scalar ``go``, else ``fill``: a ``select`` bound
    directly (``jnp.where`` is a jitted function, and the guards call it
    thousands of times while tracing a large update)."""
    return jax.lax.select(go, value, jax.lax.full(value.shape, fill, value.dtype))


def kept_inner_state(before: optax.OptState, after: optax.OptState) -> optax.OptState:
    """The inner state a skipped step returns: ``before``, typed as the inner
    update's result ``after`` (``ShapeDtypeStruct`` leaves) so that both
    branches of the ``lax.cond`` agree.

    An inner update may widen a state leaf: ``optax.adam`` initialises its
    moments in the params' dtype and promotes them when the gradients are
    wider (bfloat16 params, float32 gradients). The skipped step returns the
    old values in the wider dtype, which is exact. A change that would lose
    values (a narrowing, a shape or structure change, a typed PRNG key that
    changes implementation) raises a TypeError. A leaf whose type the update
    keeps (a typed key, ``float0``) is returned as it is.
    """
    paths_before, treedef_before = jax.tree_util.tree_flatten_with_path(before)
    leaves_after, treedef_after = jax.tree.flatten(after)
    if treedef_before != treedef_after:
        raise TypeError(
            "the inner optimizer's update changes the structure of its state (after the update against before "
            f"it, {first_difference(after, before, compare_types=False)}); a skipped step could not return it unchanged"
        )
    kept = []
    for (path, old), new in zip(paths_before, leaves_after, strict=True):
        # A Python number in the state (a custom optimizer's count, say) is
        # an array of its JAX type once traced, as in plain optax under jit.
        old = jnp.asarray(old)
        if old.shape != new.shape or not _widens_exactly(old.dtype, new.dtype):
            raise TypeError(
                f"the inner optimizer's update changes state leaf {jax.tree_util.keystr(path)} from "
                f"{old.dtype}{old.shape} to {new.dtype}{new.shape}; a skipped step could "
                "not return it unchanged in the new type. Initialise it with the dtype it will keep (for "
                "example, pass params of that dtype to init)"
            )
        if old.dtype != new.dtype:
            old = old.astype(new.dtype)
        kept.append(match_varying(old, new))
    return jax.tree.unflatten(treedef_after, kept)


def _widens_exactly(old: np.dtype, new: np.dtype) -> bool:
    """Whether every value of dtype ``old`` is a value of ``new``; extended
    dtypes (typed PRNG keys), which ``np.can_cast`` cannot read, only match
    themselves."""
    if old == new:
        return True
    if jax.dtypes.issubdtype(old, jax.dtypes.extended) or jax.dtypes.issubdtype(new, jax.dtypes.extended):
        return False
    return bool(np.can_cast(old, new, casting="safe"))
