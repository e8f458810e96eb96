"""Gradients with a loss scale: finding the state, scaling, unscaling."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from loss_scale._state import LossScaleState
from loss_scale._tree import compute_dtype, unscale_tree
from loss_scale._types import PyTree


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
      ValueError: when there is none, or more than one.

    Example:
      >>> import optax, jax.numpy as jnp, loss_scale as ls
      >>> tx = optax.chain(optax.clip(1.0), ls.dynamic(optax.sgd(0.1)))
      >>> ls.find_state(tx.init(jnp.zeros(3))).good_steps
      Array(0, dtype=int32)
    """
    if _is_state(opt_state):
        return opt_state
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
    if not found:
        raise ValueError(
            "no LossScaleState found in the given optimizer state "
            f"(a {type(opt_state).__name__}); build the optimizer with "
            "loss_scale.dynamic, loss_scale.static or loss_scale.no_op"
        )
    if len(found) > 1:
        raise ValueError(
            f"found {len(found)} LossScaleStates in the given optimizer state; "
            "pass the part of the state that holds the one you mean"
        )
    return found[0]


def get_scale(opt_state: PyTree) -> jax.Array:
    """The current loss scale (a float32 scalar) found in ``opt_state``.

    Example:
      >>> import optax, jax.numpy as jnp, loss_scale as ls
      >>> tx = ls.dynamic(optax.adam(1e-3), initial_scale=1024.0)
      >>> float(ls.get_scale(tx.init({"w": jnp.zeros(2)})))
      1024.0
    """
    return find_state(opt_state).scale


def scale_loss(loss: jax.Array, opt_state: PyTree) -> jax.Array:
    """``loss * scale``, computed in at least float32.

    Scaling in float32 keeps a large scale from overflowing a float16 loss
    in the forward pass; the cotangent that flows back into float16
    computations is still ``scale`` times larger.
    """
    scale = jax.lax.stop_gradient(get_scale(opt_state))
    loss = jnp.asarray(loss)
    return loss.astype(compute_dtype(loss.dtype)) * scale


def unscale(grads: PyTree, opt_state: PyTree) -> PyTree:
    """Gradients divided by the current scale (in float32, each leaf keeping
    its dtype): what the wrapped optimizer sees, for logging gradient norms.

    Example:
      >>> import optax, jax.numpy as jnp, loss_scale as ls
      >>> tx = ls.static(optax.sgd(0.1), scale=8.0)
      >>> ls.unscale({"w": jnp.array([16.0])}, tx.init({"w": jnp.zeros(1)}))
      {'w': Array([2.], dtype=float32)}
    """
    return unscale_tree(grads, get_scale(opt_state))


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    allow_int: bool = False,
    *,
    axis_name: Hashable | None = None,
) -> Callable[..., tuple[Any, PyTree]]:
    """Like ``jax.value_and_grad``, differentiating ``fun(...) * scale``.

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
        ``has_aux=True``.
      argnums: which positional arguments of ``fun`` to differentiate.
      has_aux: whether ``fun`` returns auxiliary data.
      allow_int: as in ``jax.grad``: integer inputs get ``float0`` gradients.
      axis_name: under ``shard_map`` or ``pmap``, average the gradients over
        this axis (data parallelism). The returned value is the local one.

    Returns:
      A function ``(opt_state, *args, **kwargs) -> (value, grads)`` where
      ``opt_state`` is any optimizer state holding a loss-scale state,
      ``value`` is ``fun``'s own (unscaled) output and ``grads`` are the
      gradients of ``loss * scale``, ready for ``tx.update``, which unscales
      them.

    Example:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=4.0)
      >>> params = jnp.array(3.0)
      >>> opt_state = tx.init(params)
      >>> loss, grads = ls.value_and_grad(lambda p: p**2)(opt_state, params)
      >>> float(loss), float(grads)
      (9.0, 24.0)
    """

    def scaled(scale, *args, **kwargs):
        out = fun(*args, **kwargs)
        loss = out[0] if has_aux else out
        loss = jnp.asarray(loss)
        scaled_loss = loss.astype(compute_dtype(loss.dtype)) * scale
        return scaled_loss, out

    shifted = (argnums + 1,) if isinstance(argnums, int) else tuple(a + 1 for a in argnums)
    grad_fn = jax.grad(
        scaled, argnums=shifted[0] if isinstance(argnums, int) else shifted, has_aux=True, allow_int=allow_int
    )

    @functools.wraps(fun)
    def wrapped(opt_state: PyTree, *args, **kwargs):
        scale = jax.lax.stop_gradient(get_scale(opt_state))
        grads, out = grad_fn(scale, *args, **kwargs)
        if axis_name is not None:
            grads = jax.lax.pmean(grads, axis_name)
        return out, grads

    return wrapped
