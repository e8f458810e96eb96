"""The state of ``ls.low_precision``, and where the half-precision
parameters' moments are in the inner optimizer's state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loss_scale._low_precision._rounding import is_half


class LowPrecisionState(NamedTuple):
    """State of ``loss_scale.low_precision``.

    A NamedTuple of arrays (no settings: those stay in the transformation),
    so ``jax.tree`` functions, optax's tree utilities and checkpointers see
    its fields, and ``optax.tree_utils.tree_get(opt_state, "mu")`` finds the
    inner optimizer's moments in ``inner_state``.

    Attributes:
      compensation: with ``rounding="kahan"``, a tree of the params'
        structure holding, for each bfloat16 or float16 parameter, an array
        of its shape and dtype: what rounding the last update to the
        parameter's dtype lost, added back at the next. ``None`` in the
        place of every other parameter (and everywhere for the other
        roundings).
      key: uint32[2], the raw key data of a threefry key (``jax.random.
        wrap_key_data(key, impl="threefry2x32")`` makes it a key again):
        where the random bits of stochastic rounding come from. Made from
        ``seed``, advanced on every step, the same on every device.
      inner_state: the inner optimizer's own state (its NamedTuples, e.g.
        ``ScaleByAdamState``), with the moments of the half-precision
        parameters stored in ``state_dtype`` when one was given.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.low_precision(optax.adam(1e-3), state_dtype=jnp.bfloat16)
      >>> state = tx.init({"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(1)})
      >>> state.compensation
      {'b': None, 'w': Array([0, 0, 0], dtype=bfloat16)}
      >>> optax.tree_utils.tree_get(state, "mu")["w"].dtype, state.key.dtype
      (dtype(bfloat16), dtype('uint32'))
    """

    compensation: Any
    key: jax.Array
    inner_state: optax.OptState

    # The fields whose float16 arrays are there by design (a compensation
    # buffer holds a rounding error, never a moment): loss-scaling
    # transformations' Float16StateWarning does not count them.
    _float16_by_design = ("compensation",)


def moment_owners(inner_state: optax.OptState, params_treedef: Any, param_leaves: list[Any]) -> list[int | None]:
    """For each leaf of ``inner_state`` (in ``jax.tree.leaves`` order), the
    index of the half-precision parameter whose moment it is, else None.

    A moment is a floating leaf of the parameter's shape at the
    parameter's place in a subtree with the params' structure (optax's
    ``mu``, ``nu``, ``trace``, ``acc_grads``...): a float32 parameter's
    moments are never counted, even where a half-precision parameter has
    the same shape, and statistics of other shapes (adafactor's factored
    rows and columns, a count) stay as the inner optimizer keeps them.
    """

    def params_shaped(node: Any) -> bool:
        return jax.tree.structure(node) == params_treedef

    owners: list[int | None] = []
    for chunk in jax.tree.leaves(inner_state, is_leaf=params_shaped):
        if not params_shaped(chunk):
            owners.append(None)
            continue
        for index, (leaf, param) in enumerate(zip(params_treedef.flatten_up_to(chunk), param_leaves, strict=True)):
            moment = (
                is_half(param)
                and hasattr(leaf, "dtype")
                and jnp.issubdtype(leaf.dtype, jnp.floating)
                and leaf.shape == param.shape
            )
            owners.append(index if moment else None)
    return owners


def check_compensation(compensation: Any, params: Any, kahan: bool) -> list[Any]:
    """The compensation buffers, one per parameter leaf (None where there is
    none), after checking that they are the ones this transformation's init
    makes for ``params``; a ValueError naming the first that is not."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    try:
        buffers = treedef.flatten_up_to(compensation)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "the state's compensation does not have the params' structure "
            f"({error}): the state was made for other params. Make it with tx.init(params)."
        ) from None
    for (path, param), buffer in zip(paths, buffers, strict=True):
        wanted = kahan and is_half(param)
        have = getattr(buffer, "shape", None), getattr(buffer, "dtype", None)
        if (wanted and have != (param.shape, param.dtype)) or (not wanted and buffer is not None):
            expected = f"a {param.dtype}{list(param.shape)} buffer" if wanted else "None"
            found = "None" if buffer is None else f"{have[1]}{list(have[0] or ())}"
            where = jax.tree_util.keystr(path) or "the params"
            if buffer is not None and not is_half(param) and kahan:
                raise ValueError(
                    f"the parameter {where} is {param.dtype} but its compensation is {found}: a half-precision "
                    "parameter came back wider, because the updates were added without casting back to its dtype "
                    "(eqx.apply_updates does that). Apply them with optax.apply_updates, ls.apply_gradients or "
                    "loss_scale.equinox.apply_gradients, which cast."
                )
            raise ValueError(
                f"the state's compensation for {where} is {found} where this transformation keeps {expected}: the "
                "state was made by a low_precision with another rounding, or for other params. Make it with "
                "tx.init(params)."
            )
    return buffers
