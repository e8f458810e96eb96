"""Loss scaling with Equinox: scaled filtered gradients of an ``eqx.Module``,
and the update applied to the model's inexact arrays.

An optional module: it imports equinox, which the core package never does.
The optimizer state is a plain optax state, so ``loss_scale.get_scale``,
``loss_scale.find_state`` and ``loss_scale.metrics`` read it as they are:

```python
import equinox as eqx
from loss_scale import equinox as lsq

tx = ls.dynamic(optax.adamw(1e-3))
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

@eqx.filter_jit
def train_step(model, opt_state, x, y):
    loss, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, x, y)  # grads of loss * scale
    model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)      # unscale, check, skip or apply
    return model, opt_state, loss
```

For mixed precision keep the model's arrays float32 and cast them inside the
loss function (``ls.Policy.cast_to_compute(model)`` casts only floating
arrays, so an ``eqx.Module``'s other fields pass through).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax

from loss_scale._find import state_argument as _state_argument
from loss_scale._fused import apply_gradients as _apply_gradients
from loss_scale._grad import scaled_objective
from loss_scale._segments import SegmentedGradient as _SegmentedGradient
from loss_scale._signatures import named_after as _named_after
from loss_scale._signatures import need_arguments as _need_arguments
from loss_scale._signatures import takes_first as _takes_first
from loss_scale._types import PyTree

__all__ = ["apply_gradients", "filter_value_and_grad"]


def filter_value_and_grad(fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., tuple[Any, PyTree]]:
    """``eqx.filter_value_and_grad``, differentiating ``fun(...) * scale``.

    As ``eqx.filter_value_and_grad``, the gradients are taken with respect
    to the inexact (floating) arrays of the first argument, and are ``None``
    where it holds anything else (activation functions, ints, static
    fields). The loss is checked and scaled as ``loss_scale.value_and_grad``
    does (a real floating scalar, scaled in at least float32).

    Args:
      fun: ``(model, *args, **kwargs) -> loss``, or ``-> (loss, aux)`` with
        ``has_aux=True``.
      has_aux: whether ``fun`` returns auxiliary data.

    Returns:
      ``(opt_state, model, *args, **kwargs) -> (value, grads)``: ``opt_state``
      is any optimizer state holding a loss-scale state, ``value`` is
      ``fun``'s own (unscaled) output and ``grads`` the gradients of ``loss *
      scale``, ready for ``apply_gradients`` (or ``tx.update``), which
      unscales them. Called without the optimizer state (``(model, x)``), it
      raises an error that says so.

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> from loss_scale import equinox as lsq
      >>> model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=1024.0)
      >>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
      >>> loss_fn = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
      >>> loss, grads = lsq.filter_value_and_grad(loss_fn)(opt_state, model, jnp.ones((4, 2)))
      >>> grads.weight.shape, float(ls.unscale(grads, opt_state).bias[0]) == float(
      ...     eqx.filter_grad(loss_fn)(model, jnp.ones((4, 2))).bias[0])
      ((1, 2), True)
    """

    call = "loss_scale.equinox.filter_value_and_grad(fun)(opt_state, model, *args, **kwargs)"

    @_named_after(fun)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, PyTree]:
        _need_arguments(args, ["opt_state", "model"], call)
        opt_state, model, *args = args
        state = _state_argument(opt_state, call)
        scaled = scaled_objective(fun, has_aux, jax.lax.stop_gradient(state.scale))
        # Boundaries (loss_scale.segment) in force where the optimizer has segments.
        diff, static = eqx.partition(model, eqx.is_inexact_array)

        def of_diff(diff, *args, **kwargs):
            return scaled(eqx.combine(diff, static), *args, **kwargs)

        segmented = _SegmentedGradient.prepare(of_diff, 0, (diff, *args), kwargs, state)
        if segmented is not None:
            grads, out = segmented.plain()
            return out, grads
        (_, out), grads = eqx.filter_value_and_grad(scaled, has_aux=True)(model, *args, **kwargs)
        return out, grads

    return _takes_first(wrapped, ["opt_state", "model"])


def apply_gradients(
    tx: optax.GradientTransformation, grads: PyTree, opt_state: optax.OptState, model: Any, **extra_args: Any
) -> tuple[Any, optax.OptState]:
    """One optimizer step on an ``eqx.Module``: ``(new_model, new_opt_state)``.

    ``tx.update`` and the addition to the model's inexact arrays in one
    (``loss_scale.apply_gradients``: with a loss-scaling ``tx`` the update is
    added before the skip keeps or drops it, and a skipped step leaves the
    model and the optimizer state exactly as they were); the model's other fields are
    kept as they are.

    Args:
      tx: the optimizer, whose state was made by
        ``tx.init(eqx.filter(model, eqx.is_inexact_array))``.
      grads: gradients of ``loss * scale``, from ``filter_value_and_grad``.
      opt_state: ``tx``'s state.
      model: the ``eqx.Module`` (or any pytree).
      **extra_args: passed on to ``tx.update``.

    Returns:
      ``(new_model, new_opt_state)``.

    Examples:
      >>> import equinox as eqx, jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> from loss_scale import equinox as lsq
      >>> model = eqx.nn.MLP(2, 1, width_size=8, depth=1, key=jax.random.key(0))
      >>> tx = ls.dynamic(optax.adam(1e-2))
      >>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
      >>> grads = jax.tree.map(lambda w: jnp.full_like(w, jnp.nan), eqx.filter(model, eqx.is_inexact_array))
      >>> new_model, opt_state = lsq.apply_gradients(tx, grads, opt_state, model)   # an overflow: skipped
      >>> bool(ls.find_state(opt_state).skipped), bool((new_model.layers[0].weight == model.layers[0].weight).all())
      (True, True)
    """
    params = eqx.filter(model, eqx.is_inexact_array)
    new_params, opt_state = _apply_gradients(tx, grads, opt_state, params, **extra_args)
    return eqx.combine(new_params, model), opt_state
