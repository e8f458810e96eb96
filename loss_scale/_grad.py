"""Gradients with a loss scale: scaling the loss, differentiating it, unscaling."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from loss_scale._find import find_state, state_argument
from loss_scale._segments import SegmentedGradient
from loss_scale._sharding import axis_names, varying_axes
from loss_scale._signatures import named_after, need_arguments, takes_first
from loss_scale._types import AxisName, PyTree
from loss_scale._unscale import unscale_dtype, unscale_tree


def get_scale(opt_state: PyTree) -> jax.Array:
    """The current loss scale (a float32 scalar) found in ``opt_state``.

    Examples:
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
    computations is still ``scale`` times larger. For custom gradient code:
    ``value_and_grad`` differentiates it for you.

    Args:
      loss: the loss, a scalar.
      opt_state: an optimizer state holding a loss-scale state (anywhere).

    Returns:
      ``loss * scale`` in the loss's dtype widened to at least float32; the
      scale is a constant to differentiation.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.static(optax.sgd(0.1), scale=8.0)
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> opt_state = tx.init(params)
      >>> loss_fn = lambda params: jnp.sum(params["w"] ** 2)
      >>> grads = jax.grad(lambda params: ls.scale_loss(loss_fn(params), opt_state))(params)
      >>> grads["w"]                                   # the gradients of loss * 8
      Array([16., 32.], dtype=float32)
      >>> ls.unscale(grads, opt_state)["w"]
      Array([2., 4.], dtype=float32)
    """
    scale = jax.lax.stop_gradient(get_scale(opt_state))
    loss = jnp.asarray(loss)
    return loss.astype(unscale_dtype(loss.dtype)) * scale


def unscale(grads: PyTree, opt_state: PyTree) -> PyTree:
    """Gradients divided by the current scale (in float32, each leaf keeping
    its dtype): what the wrapped optimizer sees, for logging gradient norms.

    Examples:
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
    axis_name: AxisName | None = None,
) -> Callable[..., tuple[Any, PyTree]]:
    """Like ``jax.value_and_grad``, differentiating ``fun(...) * scale``.

    ``argnums``, ``has_aux`` and ``allow_int`` mean what they mean in
    ``jax.value_and_grad`` (negative ``argnums`` count from the end of
    ``fun``'s own arguments), and the same misuse raises the same error: a
    loss that is not a real floating scalar, an aux output that is not a
    ``(loss, aux)`` pair.

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
        ``has_aux=True``.
      argnums: which positional arguments of ``fun`` to differentiate.
      has_aux: whether ``fun`` returns auxiliary data.
      allow_int: as in ``jax.grad``: integer inputs get ``float0`` gradients.
      axis_name: under ``shard_map`` or ``pmap``, with ``fun`` returning the
        loss of the local batch: the gradients become those of the mean of
        the local losses over this axis (data parallelism), on every replica.
        How they are averaged follows from the types: under ``shard_map`` with
        ``check_vma=True`` (JAX's default) the gradient of a replicated input
        is already summed over the axis by JAX, so the mean is taken of the
        loss before differentiating; under ``pmap`` and ``check_vma=False``
        the gradients are averaged with ``pmean``. The returned value is the
        local one.

    Returns:
      A function ``(opt_state, *args, **kwargs) -> (value, grads)`` where
      ``opt_state`` is any optimizer state holding a loss-scale state,
      ``value`` is ``fun``'s own (unscaled) output and ``grads`` are the
      gradients of ``loss * scale``, ready for ``tx.update``, which unscales
      them.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=4.0)
      >>> params = jnp.array(3.0)
      >>> opt_state = tx.init(params)
      >>> loss, grads = ls.value_and_grad(lambda p: p**2)(opt_state, params)
      >>> float(loss), float(grads)
      (9.0, 24.0)
    """

    call = "loss_scale.value_and_grad(fun)(opt_state, *args, **kwargs)"

    @named_after(fun)
    def wrapped(*args, **kwargs):
        need_arguments(args, ["opt_state"], call)
        opt_state, *args = args
        state = state_argument(opt_state, call)
        scaled, averaged = data_parallel_objective(fun, has_aux, state.scale, axis_name)
        # Boundaries (loss_scale.segment) in force where the optimizer has segments.
        segmented = SegmentedGradient.prepare(scaled, argnums, tuple(args), kwargs, state, allow_int=allow_int)
        if segmented is not None:
            grads, out = segmented.plain()
            return out, averaged(grads)
        grad_fn = jax.grad(scaled, argnums=argnums, has_aux=True, allow_int=allow_int)
        grads, out = grad_fn(*args, **kwargs)
        return out, averaged(grads)

    return takes_first(wrapped, ["opt_state"])


def data_parallel_objective(
    fun: Callable[..., Any], has_aux: bool, scale: jax.Array, axis_name: AxisName | None
) -> tuple[Callable[..., tuple[jax.Array, Any]], Callable[[PyTree], PyTree]]:
    """What ``value_and_grad`` (and ``value_grad_and_peak``) differentiate,
    and what they do to the gradients after: ``(scaled, averaged)``.

    ``scaled`` is ``scaled_objective`` of ``fun`` at ``scale`` (held
    constant), averaging the loss over ``axis_name`` where JAX types values
    along it; ``averaged`` takes the ``pmean`` of the gradients where it
    does not (``pmap``, ``check_vma=False``), and is the identity otherwise.
    """
    scale = jax.lax.stop_gradient(scale)
    typed = axis_name is not None and _typed(axis_name)
    scaled = scaled_objective(fun, has_aux, scale, axis_name if typed else None)

    def averaged(grads: PyTree) -> PyTree:
        if axis_name is not None and not typed:
            return jax.lax.pmean(grads, axis_name)
        return grads

    return scaled, averaged


def scaled_objective(
    fun: Callable[..., Any], has_aux: bool, scale: jax.Array, mean_over: AxisName | None = None
) -> Callable[..., tuple[jax.Array, Any]]:
    """``(*args, **kwargs) -> (loss * scale, fun's output)``, the function
    that ``value_and_grad`` (and its flax and Equinox versions) differentiate
    with ``has_aux=True``.

    The loss is checked as ``jax.grad`` checks it (a real floating scalar,
    and a ``(loss, aux)`` pair with ``has_aux``) and scaled in at least
    float32, so that a large scale cannot overflow a float16 loss; the
    cotangent that flows back into float16 computations is still ``scale``
    times larger. With ``mean_over`` (an axis JAX types values along), a loss
    that varies along it is averaged over it before differentiating.
    """

    def scaled(*args, **kwargs):
        out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                raise TypeError(
                    "expected function with aux output to return a two-element tuple, "
                    f"but got type {type(out)} with value {out!r}"
                )
            loss, aux = out
            out = (loss, aux)
        else:
            loss = out
        target = _checked_loss(loss) * scale
        if mean_over is not None and _varies(target, mean_over):
            target = jax.lax.pmean(target, mean_over)
        return target, out

    return scaled


def _checked_loss(loss: Any) -> jax.Array:
    """``loss`` in at least float32, after ``jax.grad``'s own checks (a
    scalar of a real floating dtype), with its messages: the cast to float32
    would otherwise turn an integer loss into zero gradients."""
    if loss is None:
        raise TypeError("Gradient only defined for scalar-output functions. Output was None.")
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise _grad_error(loss.shape, loss.dtype)
    return loss.astype(unscale_dtype(loss.dtype))


def _grad_error(shape: tuple[int, ...], dtype: Any) -> TypeError:
    """The error ``jax.grad`` raises for a function whose output has this
    shape and dtype, taken from ``jax.grad`` itself (abstractly: nothing
    runs), so that its wording and hints are those of the jax installed."""
    try:
        jax.eval_shape(jax.grad(lambda _: jnp.zeros(shape, dtype)), jnp.float32(0))
    except TypeError as error:
        return TypeError(str(error))
    return TypeError(f"loss of shape {shape} and dtype {dtype} is not a real floating scalar")  # pragma: no cover


def _typed(axis_name: AxisName) -> bool:
    """Whether JAX types values as varying or invariant along ``axis_name``
    (``shard_map`` with ``check_vma=True``, JAX's default), and so
    differentiates a varying loss with respect to an invariant (replicated)
    input by summing over the axis: a ``pmean`` of such a gradient changes
    nothing. There the loss is averaged before differentiating, and the
    gradients of the mean come out of JAX's own transpose, for replicated
    and sharded inputs alike; a loss that is invariant already (averaged by
    the user) needs nothing. Without that typing (``pmap``,
    ``check_vma=False``) even ``axis_index`` is not varying, and the
    gradients, which are then local, are averaged with ``pmean``."""
    return axis_names(axis_name) <= varying_axes(jax.typeof(jax.lax.axis_index(axis_name)))


def _varies(x: jax.Array, axis_name: AxisName) -> bool:
    return bool(axis_names(axis_name) & varying_axes(jax.typeof(x)))
