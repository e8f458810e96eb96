"""``apply_gradients``: the update and ``optax.apply_updates`` in one step."""

from __future__ import annotations

from typing import Any

import optax

from loss_scale._update import LossScaleTransformation


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """``tx.update`` and ``optax.apply_updates`` in one, the addition made
    before the skip keeps or drops it.

    The result equals ``updates, opt_state = tx.update(grads, opt_state,
    params); optax.apply_updates(params, updates)``. When ``tx`` is a
    loss-scaling transformation itself (``dynamic``, ``static``, ``no_op``
    or a preset), the new params are chosen against the old ones where they
    are computed: XLA fuses the update into the write of the params as it
    does for a bare optimizer, and no updates buffer is ever needed (where
    the inner update keeps a ``lax.cond``, the addition happens inside it,
    and a skipped step writes nothing). Any other ``tx`` (a chain around
    the loss-scaling transformation, say) takes the two-step path.

    Args:
      tx: the optimizer.
      grads: gradients of ``loss * scale``.
      opt_state: ``tx``'s state.
      params: the parameters.
      **extra_args: passed on to ``tx.update``.

    Returns:
      ``(new_params, new_opt_state)``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.5), initial_scale=4.0)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> params, state = ls.apply_gradients(tx, {"w": jnp.array([4.0, 8.0])}, state, params)
      >>> params["w"]
      Array([0.5, 0. ], dtype=float32)
    """
    if isinstance(tx, LossScaleTransformation):
        return tx.apply_gradients(grads, opt_state, params, **extra_args)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state
