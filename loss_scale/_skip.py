"""What a skipped step keeps, and how it is skipped without a branch.

A skipped step returns the inner optimizer's state as it was
(``kept_inner_state``), and zero updates or the params as they were.

A ``lax.cond`` around the inner update makes XLA materialize every operand
of the conditional: the gradients, in float32, before the update reads them
(in a float16 backward pass, the float32 copy of every weight gradient that
a bare step never writes, often transposed to the layout the branch wants).
Without the branch, XLA fuses the gradients' producer into the update as it
does for a bare optimizer. The step then computes the update on every step
and keeps the old values where it must not apply it, with ``lax.select``
(exact: the old bits). Selecting only the outputs would leave every
consumer of a new state leaf (Adam's parameter update reads the new
moments) recomputing it from the old buffer, which XLA then copies before
overwriting it in place; so each new state leaf is selected where the
jaxpr produces it, and its consumers read the selected value, which equals
the new one whenever the step is applied and is discarded whenever it is
not.

Where the inner update has effects (callbacks, prints) or control flow
(``while_loop``, ``cond``, ``scan``: a line search, ``optax.MultiSteps``),
running it on a skipped step would be observable or costly, and the update
keeps the ``lax.cond``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale._sharding import match_varying
from loss_scale._trees import first_difference

# Primitives whose cost or behaviour on a skipped step's inputs is not that
# of a few elementwise passes.
_CONTROL_FLOW = frozenset({"while", "cond", "scan"})


def runs_unconditionally(closed: jax.extend.core.ClosedJaxpr) -> bool:
    """Whether the jaxpr may run on every step, its result selected away on
    skipped ones: no effects, and no control flow at any depth."""
    if closed.effects:
        return False
    stack = [closed.jaxpr]
    while stack:
        jaxpr = stack.pop()
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _CONTROL_FLOW:
                return False
            stack.extend(sub_jaxprs(eqn.params))
    return True


def sub_jaxprs(params: Mapping[str, Any]) -> list[Any]:
    """The jaxprs among an equation's parameters (a call's ``jaxpr``, a
    ``cond``'s ``branches``), open or closed."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "eqns"):
                found.append(item)
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item.jaxpr)
    return found


def select(go: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``go``, else ``old``, for one array of any dtype (typed
    PRNG keys included); a ``float0`` leaf holds nothing and is ``new``."""
    if not hasattr(new, "dtype"):  # a literal of the jaxpr: a Python scalar
        new = jnp.asarray(new, old.dtype)
    if new.dtype == jax.dtypes.float0:
        return new
    return jax.lax.select(go, new, old)


def run_selecting(
    closed: jax.extend.core.ClosedJaxpr, go: jax.Array, old: Mapping[int, Any], args: Sequence[Any]
) -> list[Any]:
    """Evaluates ``closed`` on ``args`` and returns its outputs, output ``i``
    (for each ``i`` in ``old``) as ``select(go, new, old[i])``.

    Each such output is selected where an equation produces it, so that
    every later equation reads the selected value (see the module
    docstring), and once more on the way out where that did not already
    choose against ``old[i]`` (one value returned as two state leaves, an
    input or a literal returned as it is). Only the top-level equations are rebound,
    each with its own parameters as ``jax.core.eval_jaxpr`` does; an output
    of a nested call (``pjit``) is selected where that call returns it."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}

    def read(var: Any) -> Any:
        return var.val if isinstance(var, jax.extend.core.Literal) else env[var]

    chosen: dict[Any, Any] = {}
    for index, var in enumerate(jaxpr.outvars):
        if index in old and not isinstance(var, jax.extend.core.Literal):
            chosen.setdefault(var, old[index])
    for var, value in [*zip(jaxpr.constvars, closed.consts, strict=True), *zip(jaxpr.invars, args, strict=True)]:
        env[var] = value
    for eqn in jaxpr.eqns:
        bind_params, subfuns = eqn.primitive.get_bind_params(eqn.params), ()
        if isinstance(bind_params, tuple):  # jax < 0.9 returns (subfuns, params)
            subfuns, bind_params = bind_params
        results = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **bind_params)
        if not eqn.primitive.multiple_results:
            results = [results]
        for var, value in zip(eqn.outvars, results, strict=True):
            # (An unused output, a DropVar, is never read back.)
            env[var] = select(go, value, chosen[var]) if var in chosen else value
    outputs = []
    for index, var in enumerate(jaxpr.outvars):
        value = read(var)
        literal = isinstance(var, jax.extend.core.Literal)
        if index in old and (literal or chosen.get(var) is not old[index]):
            value = select(go, value, old[index])
        outputs.append(value)
    return outputs


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
