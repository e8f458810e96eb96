"""Moving an existing optimizer state under a loss-scaling transformation."""

from __future__ import annotations

import jax
import optax

from loss_scale._state import LossScaleState


def wrap_opt_state(
    tx: optax.GradientTransformation, inner_opt_state: optax.OptState, params: optax.Params
) -> LossScaleState:
    """A loss-scaled optimizer state that keeps an existing inner state.

    For resuming from a checkpoint saved with a plain optax optimizer: Adam's
    moments and step count (and the learning-rate schedule that reads it)
    carry on, while the scale and its counters start fresh.

    Args:
      tx: the loss-scaling transformation, e.g. ``ls.dynamic(optax.adam(lr))``
        wrapping the same optimizer that produced ``inner_opt_state``.
      inner_opt_state: the plain optimizer's state.
      params: the parameters (only their structure and shapes are used).

    Returns:
      ``tx.init(params)`` with its ``inner_state`` replaced.

    Raises:
      ValueError: when ``inner_opt_state`` does not have the structure, shapes
        and dtypes of the state the wrapped optimizer makes.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> params = {"w": jnp.ones(3)}
      >>> old = optax.adam(1e-3).init(params)
      >>> state = ls.wrap_opt_state(ls.dynamic(optax.adam(1e-3)), old, params)
      >>> int(state.inner_state[0].count), float(state.scale)
      (0, 32768.0)
    """
    fresh = jax.eval_shape(tx.init, params)
    if not isinstance(fresh, LossScaleState):
        raise ValueError(f"tx must be a loss-scaling transformation (its init returns {type(fresh).__name__})")
    expected = jax.tree.structure(fresh.inner_state)
    got = jax.tree.structure(inner_opt_state)
    if expected != got:
        raise ValueError(f"the inner state's structure {got} is not the wrapped optimizer's {expected}")
    for want, have in zip(jax.tree.leaves(fresh.inner_state), jax.tree.leaves(inner_opt_state), strict=True):
        if want.shape != have.shape or want.dtype != have.dtype:
            raise ValueError(f"inner state leaf {have.dtype}{have.shape} where {want.dtype}{want.shape} is expected")
    return tx.init(params)._replace(inner_state=inner_opt_state)
