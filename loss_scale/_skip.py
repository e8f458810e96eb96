"""What a skipped step keeps, and how it is skipped without a branch.

A skipped step returns the inner optimizer's state as it was
(``kept_inner_state``), and zero updates or the params as they were. The
reference is one ``lax.cond`` around the inner update (``reference``);
``apply_or_skip`` takes it, or a faster form that equals it in values, in
derivatives and in what it computes:

* **a concrete decision** (an eager step): the taken or the skipped branch
  alone, chosen in Python; nothing else runs.
* **the select path** (traced, where the inner update has no effects and
  no ``while_loop``/``cond``/``scan``). A ``lax.cond`` makes XLA
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
  normalisation its zero moments), which an optimizer's formulas never see.
  So every operation that is not finite on every finite input (a division,
  ``sqrt``, ``rsqrt``, ``log``, ``pow``, ...: ``GUARDED``) and reads such a
  value reads, where the step is skipped, a value on which it is finite
  (``select(go, x, 1)``, fused into the same loop): a skipped step computes
  nothing non-finite that its inputs do not force, and ``jax_debug_nans``
  sees nothing. Nested calls (``jit``, ``custom_jvp``/``custom_vjp``
  functions, ``checkpoint``) are entered for this, and the values of a taken
  step are untouched (the guard selects ``x`` itself there).

  Its derivatives are the reference's: the select path is a
  ``jax.custom_jvp`` function whose JVP rule is the JVP of the ``lax.cond``
  (``jax.grad``, ``jax.jvp``, ``jax.vjp`` through an update differentiate
  the reference, whose skipped branch has derivative 0 with respect to the
  gradients, the learning rate and the params, and 1 with respect to the
  kept state).

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
from loss_scale._sharding import match_varying
from loss_scale._trees import first_difference
from loss_scale._unscale import is_float_leaf

# Primitives whose cost or behaviour on a skipped step's inputs is not that
# of a few elementwise passes.
_CONTROL_FLOW = frozenset({"while", "cond", "scan"})

# Operations that can give a non-finite result on finite operands, with the
# operands that decide it and a value on which they are finite: a division
# by zero, the square root or logarithm of a negative number or of zero, a
# power of zero with a negative exponent.
GUARDED: Mapping[str, tuple[tuple[int, ...], float]] = {
    "div": ((1,), 1.0),
    "rem": ((1,), 1.0),
    "sqrt": ((0,), 1.0),
    "rsqrt": ((0,), 1.0),
    "log": ((0,), 1.0),
    "log1p": ((0,), 0.0),
    "pow": ((0, 1), 1.0),
    "acos": ((0,), 0.0),
    "asin": ((0,), 0.0),
    "acosh": ((0,), 1.0),
    "atanh": ((0,), 0.0),
    "erf_inv": ((0,), 0.0),
    "lgamma": ((0,), 1.0),
    "digamma": ((0,), 1.0),
}


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

    @jax.custom_jvp
    def branch_free(go, consts, args):
        zeroed = _zero_gradients(go, args, num_grads)
        old = dict(enumerate(kept(args)))
        return _evaluate_selecting(traced.jaxpr, consts, zeroed, go, old, num_suspect=num_grads)

    def branch_free_jvp(primals, tangents):
        # Only the perturbed inputs carry tangents into the reference, so
        # that the rest stay symbolic zeros there as in a bare update (an
        # instantiated zero tangent meets an infinite partial derivative,
        # sqrt's at 0, and gives 0 * inf = nan).
        flat_primals, treedef = jax.tree.flatten(primals)
        flat_tangents = jax.tree.leaves(tangents, is_leaf=_is_symbolic_zero)
        perturbed = [not _is_symbolic_zero(t) for t in flat_tangents]

        def of_perturbed(*values):
            values = iter(values)
            full = [next(values) if p else x for x, p in zip(flat_primals, perturbed, strict=True)]
            go, consts, args = jax.tree.unflatten(treedef, full)
            return reference(go, traced.jaxpr, kept, num_grads, consts, args)

        return jax.jvp(
            of_perturbed,
            [x for x, p in zip(flat_primals, perturbed, strict=True) if p],
            [t for t, p in zip(flat_tangents, perturbed, strict=True) if p],
        )

    branch_free.defjvp(branch_free_jvp, symbolic_zeros=True)
    return branch_free(go, consts, args)


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
    safe value there instead (``_SelectPath``, the hooks of the package's
    jaxpr interpreter)."""
    chosen: dict[Any, Any] = {}
    for index, var in enumerate(jaxpr.outvars):
        if index in old and not is_literal(var):
            chosen.setdefault(var, old[index])
    hooks = _SelectPath(go, chosen)
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
    a safe value where its operand is suspect and the step is skipped, and
    the top-level results that are new state values are selected against
    the old ones where they are produced (and are suspect from then on)."""

    def __init__(self, go: jax.Array, chosen: Mapping[Any, Any]):
        self.go, self.chosen = go, chosen
        self.selected: set[Any] = set()

    def mode(self, eqn: Any, labels: Sequence[Any], frame: Frame) -> Mode:
        del frame
        # Calls (jit, checkpoint, custom_jvp/custom_vjp: those the engine
        # can enter) that read a suspect value are entered, to guard the
        # operations inside; the values are the call's and the derivatives
        # the reference's, so a custom rule is not needed here.
        structure = structure_of(eqn)
        if structure is not None and Mode.ENTER in structure.modes and any(label >= _SUSPECT for label in labels):
            return Mode.ENTER
        return Mode.KEEP

    def equation(self, equation: Equation, invals: list[Any], bind: Any) -> list[Any]:
        eqn, suspects = equation.eqn, [label >= _SUSPECT for label in equation.labels]
        name = eqn.primitive.name
        if name in GUARDED and any(suspects):
            positions, safe = GUARDED[name]
            invals = [_guard(self.go, v, safe) if i in positions and suspects[i] else v for i, v in enumerate(invals)]
        if name == "integer_pow" and eqn.params["y"] < 0 and suspects[0]:
            invals = [_guard(self.go, invals[0], 1.0)]
        outs = bind(invals)
        if equation.frame.depth == 0:
            for i, var in enumerate(eqn.outvars):
                if var in self.chosen:
                    self.selected.add(var)
                    outs[i] = select(self.go, outs[i], self.chosen[var])
        return outs

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
