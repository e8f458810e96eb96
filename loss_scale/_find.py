"""Finding the loss-scale state in whatever optimizer state a user holds,
and saying what was passed instead when there is none."""

from __future__ import annotations

from typing import Any

import jax

from loss_scale._state import LossScaleState
from loss_scale._types import PyTree

# Every way to build a loss-scaling transformation, for the messages that
# ask for one.
FACTORIES = (
    "loss_scale.dynamic, loss_scale.static, loss_scale.no_op, loss_scale.predictive, loss_scale.for_dtype, "
    "loss_scale.Policy.loss_scaling or a preset (loss_scale.presets.torch, keras, deepspeed, megatron, apex, "
    "flax, jmp, cerebras)"
)


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


def find_state(opt_state: PyTree) -> LossScaleState:
    """The ``LossScaleState`` inside a (possibly nested) optimizer state.

    Searches any pytree: ``optax.chain`` tuples, ``optax.MultiSteps`` and
    ``optax.inject_hyperparams`` states, a flax ``TrainState`` or its
    ``opt_state``, an ``nnx.Optimizer``'s state.

    Args:
      opt_state: an optimizer state that contains exactly one loss-scale state.

    Returns:
      The loss-scale state.

    Raises:
      ValueError: when there is none, or more than one (two loss-scaling
        transformations in one optimizer, e.g. siblings in an
        ``optax.chain``, would each divide the gradients by their scale: wrap
        the whole optimizer once).

    Examples:
      >>> import optax, jax.numpy as jnp, loss_scale as ls
      >>> tx = optax.chain(optax.clip(1.0), ls.dynamic(optax.sgd(0.1)))
      >>> ls.find_state(tx.init(jnp.zeros(3))).good_steps
      Array(0, dtype=int32)
    """
    if _is_state(opt_state):
        return opt_state
    found = [
        (path, x) for path, x in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state)[0] if _is_state(x)
    ]
    if not found:
        raise ValueError(
            "no LossScaleState found in what was passed: expected the optimizer state (opt_state = "
            f"tx.init(params), with tx built by {FACTORIES}), got {describe(opt_state)}"
        )
    if len(found) > 1:
        raise ValueError(
            f"the optimizer state holds {len(found)} loss-scaling states (at "
            f"{', '.join(jax.tree_util.keystr(path) or 'the top' for path, _ in found)}): the optimizer has "
            f"{len(found)} loss-scaling transformations (siblings in an optax.chain or an optax.multi_transform), "
            "and each divides the gradients by its own scale, while the loss is multiplied by one. Wrap the "
            "whole optimizer once instead, e.g. ls.dynamic(optax.chain(optax.clip_by_global_norm(1.0), "
            "optax.adam(1e-3))), not optax.chain(ls.dynamic(...), ls.dynamic(...))"
        )
    return found[0][1]


def state_argument(
    opt_state: PyTree, call: str, expected: str = "the optimizer state (opt_state = tx.init(params))"
) -> LossScaleState:
    """``find_state(opt_state)`` for the first argument of ``call``, whose
    error says that the first argument must be ``expected``: forgetting it
    (``value_and_grad(fun)(params, x)``) is the commonest slip."""
    try:
        return find_state(opt_state)
    except ValueError:
        if _has_optimizer_state(opt_state):
            raise
    raise ValueError(
        f"{call}: the first argument must be {expected}, of an optimizer built with {FACTORIES}; "
        f"got {describe(opt_state)}"
    ) from None


def describe(tree: Any) -> str:
    """A short description of what was passed where an optimizer state was
    expected: ``"a dict of 2 arrays (float32), which looks like parameters, a
    model or a batch"``, ``"an optimizer state that has no loss-scale state
    (ScaleByAdamState, EmptyState)"``."""
    if tree is None:
        return "None"
    kind = type(tree).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if _has_optimizer_state(tree):
        parts = sorted({type(x).__name__ for x in jax.tree.leaves(tree, is_leaf=_is_named_tuple) if _is_named_tuple(x)})
        return (
            f"{article} {kind}: an optimizer state that has no loss-scale state ({', '.join(parts)}); wrap the "
            "optimizer, tx = loss_scale.dynamic(tx), and make the state with the wrapped tx.init(params)"
        )
    leaves = jax.tree.leaves(tree)
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        dtype = str(tree.dtype)
        article = "an" if dtype[0] in "aeiou" else "a"
        return f"{article} {dtype} array of shape {tuple(tree.shape)}, which looks like a parameter or a batch"
    dtypes = sorted({str(x.dtype) for x in leaves if hasattr(x, "dtype")})
    arrays = sum(hasattr(x, "dtype") for x in leaves)
    if not arrays:
        return f"{article} {kind}"
    return (
        f"{article} {kind} of {arrays} array{'s' if arrays > 1 else ''} ({', '.join(dtypes)}), "
        "which looks like parameters, a model or a batch"
    )


def _is_named_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _has_optimizer_state(tree: Any) -> bool:
    """Whether ``tree`` holds an optax state (a NamedTuple: ``EmptyState``,
    ``ScaleByAdamState``...), as parameters and batches do not."""
    return any(_is_named_tuple(x) for x in jax.tree.leaves(tree, is_leaf=_is_named_tuple))
