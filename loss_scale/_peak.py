"""``value_grad_and_peak``: the scaled gradients and, every few steps, the
largest value of the whole backward pass.

The measurement reuses ``range_report``'s zero probes (``_probe.py``): the
loss function's jaxpr is evaluated with a zero added to every floating value
on a path from the differentiated arguments to the loss (the values whose
cotangent ``jax.grad`` forms; data-only values are evaluated plainly), and
one backward pass differentiates with respect to the parameters and the
probes together. The gradient with respect to a probe
is exactly the cotangent that reaches its value, in the value's dtype; the
largest magnitude over the cotangents of the compute dtype is the backward
peak. A ``jax.lax.cond`` on the step count chooses between that evaluation
and ``value_and_grad``'s plain one, so steps that do not measure do not pay
for it (outside ``vmap``, which turns the ``cond`` into a select).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from loss_scale import _validate as validate
from loss_scale._check import largest_magnitude
from loss_scale._find import state_argument
from loss_scale._grad import data_parallel_objective
from loss_scale._probe import Evaluator, on_paths
from loss_scale._segments import SegmentedGradient
from loss_scale._sharding import axis_names, vary_along, varying_axes
from loss_scale._signatures import named_after, over_leaves
from loss_scale._types import AxisName, PyTree


def value_grad_and_peak(
    fun: Callable[..., Any],
    every: int = 16,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    axis_name: AxisName | None = None,
    compute_dtype: Any = "float16",
) -> Callable[..., tuple[Any, PyTree, jax.Array]]:
    """Like ``value_and_grad``, also returning the largest value of the
    backward pass every ``every`` steps, for ``loss_scale.predictive``.

    The values that overflow in a float16 backward pass are often not the
    parameter gradients but intermediate ones (of the logits, of an
    activation), larger by a factor that depends on the model. On a measuring
    step this function returns ``backward_peak``, the largest magnitude of any
    cotangent of dtype ``compute_dtype`` in the backward pass of ``loss *
    scale`` (the gradients of the differentiated arguments of that dtype
    included; ``inf`` if one is not finite). Passed on as
    ``tx.update(grads, opt_state, params, backward_peak=peak)``, it lets
    ``predictive`` set its headroom from the measured amplification instead
    of learning it by overflowing; the other rules ignore it.

    A step measures when the ``good_steps`` of the loss-scale state in
    ``opt_state`` is a multiple of ``every``: the first step, the step after
    an overflow (``good_steps`` restarts at 0), and every ``every`` clean
    steps in a row after that. Other steps return ``backward_peak`` 0 and
    cost what ``value_and_grad`` costs (one ``jax.lax.cond`` picks the
    evaluation; under ``vmap`` both run). A measuring step evaluates the loss
    function equation by equation with a zero added to every floating
    intermediate whose cotangent ``jax.grad`` forms (one that depends on the
    differentiated arguments and reaches the loss, not only the aux output;
    data, ``stop_gradient``'ed values and a ``while_loop`` or
    ``pure_callback`` on data are evaluated as ``jax.grad`` evaluates them),
    as ``range_report`` does, and reduces each such cotangent to its largest
    magnitude: one backward pass, plus a read of every cotangent. Jitted functions and ``jax.checkpoint`` are evaluated
    inside (a checkpointed function's activations are then kept on measuring
    steps); ``custom_jvp``/``custom_vjp`` functions and control flow
    (``scan``, ``while_loop``, ``cond``) are bound whole: only their outputs
    on such a path are measured, so a peak inside them is missed: the rule then learns the rest from an
    overflow, as without a measurement.

    With measured peaks, start ``predictive`` at a scale that cannot overflow
    (``initial_scale=1.0``): the first step measures, and the scale moves to
    the measured target right after it.

    Args:
      fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with
        ``has_aux=True``.
      every: measure on steps whose ``good_steps`` is a multiple of it, >= 1.
      argnums: which positional arguments of ``fun`` to differentiate, as in
        ``value_and_grad``.
      has_aux: whether ``fun`` returns auxiliary data.
      axis_name: as in ``value_and_grad`` (the gradients of the mean loss
        over the axis). The peak is the largest over this axis and every
        ``shard_map`` axis the backward pass's values vary along, the same on
        every replica.
      compute_dtype: the dtype whose values can overflow: only intermediates
        of this dtype count (float16's largest value is 65504).

    Returns:
      A function ``(opt_state, *args, **kwargs) -> (value, grads,
      backward_peak)``: ``value`` and ``grads`` as ``value_and_grad``
      gives them (``fun``'s own output; gradients of ``loss * scale``;
      compiled inside the ``lax.cond`` even when called eagerly, a program
      of its own: equal to ``jax.jit(value_and_grad(...))``'s within
      rounding, and bit for bit only where XLA computes both alike, which a
      CPU with AVX512-FP16 need not for float16),
      and ``backward_peak`` a float32 scalar, 0 on a step that does not
      measure.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> def loss_fn(w, x):  # a float16 intermediate 64x larger than the gradient
      ...     h = (x.astype(jnp.float16) @ w.astype(jnp.float16)) / 64
      ...     return jnp.mean(h.astype(jnp.float32))
      >>> tx = ls.predictive(optax.sgd(0.1), initial_scale=1.0)
      >>> w, x = jnp.ones((4, 1)), jnp.ones((8, 4))
      >>> opt_state = tx.init(w)
      >>> loss, grads, peak = ls.value_grad_and_peak(loss_fn)(opt_state, w, x)
      >>> float(peak), float(grads.max())  # the cotangent of h / 64 is 1/8
      (0.125, 0.015625)
      >>> _, opt_state = tx.update(grads, opt_state, w, backward_peak=peak)
      >>> int(opt_state.headroom), float(opt_state.scale)  # 3 binades measured + 1
      (4, 131072.0)
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {type(fun).__name__}")
    every = validate.count("every", every)
    dtype = validate.floating_dtype("compute_dtype", compute_dtype)
    validate.axis_name("axis_name", axis_name)

    @named_after(fun)
    def wrapped(opt_state: PyTree, *args, **kwargs):
        state = state_argument(opt_state, "loss_scale.value_grad_and_peak(fun)(opt_state, *args, **kwargs)")
        scaled, averaged = data_parallel_objective(fun, has_aux, state.scale, axis_name)
        skip = jax.lax.stop_gradient(state.good_steps) % every != 0
        # Boundaries (loss_scale.segment) in force where the optimizer has
        # segments: each segment measured on its own.
        segmented = SegmentedGradient.prepare(scaled, argnums, args, kwargs, state, compute_dtype=dtype)
        if segmented is not None:

            def plain_segments():
                grads, out = segmented.plain()
                return out, averaged(grads), segmented.unmeasured_peaks()

            def measured_segments():
                grads, out, peaks = segmented.measured(axis_name)
                return out, averaged(grads), peaks

            return jax.lax.cond(skip, plain_segments, measured_segments)

        def plain():
            grads, out = jax.grad(scaled, argnums=argnums, has_aux=True)(*args, **kwargs)
            return out, averaged(grads), jnp.zeros((), jnp.float32)

        def measured():
            grads, out, peak = _grad_and_peak(scaled, argnums, args, kwargs, dtype)
            # The largest over axis_name and every shard_map axis the backward
            # pass's values vary along: one peak for the whole pass, the same on
            # every replica (and of the plain branch's type).
            axes = set(varying_axes(jax.typeof(peak)))
            if axis_name is not None:
                axes |= axis_names(axis_name)
            if axes:
                peak = jax.lax.pmax(peak, tuple(sorted(axes, key=str)))
            return out, averaged(grads), peak

        # lax.cond traces its first branch first: the plain one, so that a
        # misuse raises jax.grad's own error.
        return jax.lax.cond(skip, plain, measured)

    return wrapped


def _grad_and_peak(
    scaled: Callable[..., tuple[jax.Array, Any]],
    argnums: int | Sequence[int],
    args: tuple,
    kwargs: dict,
    dtype: jnp.dtype,
) -> tuple[PyTree, Any, jax.Array]:
    """``(grads, out, peak)``: ``jax.grad(scaled, argnums, has_aux=True)``'s
    gradients and output, from one backward pass that also differentiates
    with respect to a zero probe on every floating intermediate, and the
    largest cotangent magnitude of dtype ``dtype``. ``argnums`` were checked
    by the plain evaluation, traced first."""
    of_leaves, leaves, tree = over_leaves(scaled, argnums, args, kwargs)
    closed, out_shapes = jax.make_jaxpr(of_leaves, return_shape=True)(leaves)
    out_tree = jax.tree.structure(out_shapes)
    # The scaled loss is the first output; only the values jax.grad forms a
    # cotangent for (on a path from the leaves to it) are probed.
    paths = on_paths(closed, leaves, [True] * len(leaves), loss=0)
    probes = [vary_along(jnp.zeros(s.shape, s.dtype), s.varying) for s in paths.sites]

    def probed(probes, leaves):
        flat = Evaluator(probes, paths.probed).run(closed, leaves)
        return jax.tree.unflatten(out_tree, flat)

    (at_probes, at_leaves), out = jax.grad(probed, argnums=(0, 1), has_aux=True)(probes, leaves)
    grads = tuple(jax.tree.unflatten(tree, at_leaves))
    if isinstance(argnums, int):
        (grads,) = grads
    peaks = [largest_magnitude(ct) for ct in [*at_probes, *at_leaves] if ct.dtype == dtype]
    peak = functools.reduce(jnp.maximum, peaks, jnp.zeros((), jnp.float32))
    return grads, out, peak
