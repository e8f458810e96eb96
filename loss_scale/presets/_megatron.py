"""The Megatron-LM preset: ``megatron``."""

from __future__ import annotations

import math

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules.static import fixed
from loss_scale._update import LossScaleTransformation, loss_scaled
from loss_scale.presets._common import dynamic_rule


@takes_options()
def megatron(
    inner: optax.GradientTransformation,
    initial_loss_scale: float = 2.0**32,
    min_loss_scale: float = 1.0,
    loss_scale_window: float = 1000,
    hysteresis: int = 2,
    *,
    loss_scale: float | None = None,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """Megatron-LM's ``DynamicGradScaler`` (megatron-core 0.16).

    The arguments are ``megatron.core.optimizer.OptimizerConfig``'s fields,
    with their defaults (``loss_scale`` set selects a constant scale, as
    ``ConstantGradScaler``); growth and backoff factors are 2 and 0.5, fixed
    by ``get_megatron_optimizer`` (``megatron/core/optimizer/__init__.py``).

    Source: ``megatron/core/optimizer/grad_scaler.py``,
    ``DynamicGradScaler.update`` (0.16.1). Rule: on an overflow the step is
    skipped, the growth tracker returns to 0 and the hysteresis tracker
    drops by one; when it is at or below 0 the scale becomes ``max(scale *
    0.5, min_loss_scale)``. On a clean step the growth tracker counts up; at
    ``loss_scale_window`` it returns to 0, the hysteresis tracker is refilled
    to ``hysteresis`` (only here: clean steps alone do not refill it) and the
    scale doubles. So with ``hysteresis = h`` the scale backs off on the
    h-th overflow since the last growth (or the start) and on every overflow
    after it until the next growth.

    Differences: Megatron never checks that a doubled scale is finite (its
    float32 scale becomes inf after ``2**127``); the preset keeps the scale
    there. Megatron checks the gradients before unscaling them.

    Args:
      inner: the optimizer to wrap.
      initial_loss_scale: the scale at step 0.
      min_loss_scale: the floor.
      loss_scale_window: clean steps before the scale doubles (typed float
        in Megatron; integral values only).
      hysteresis: overflows since the last growth tolerated before the
        scale halves.
      loss_scale: a number for a constant scale (``ConstantGradScaler``);
        ``None`` for dynamic.
      **options: the keyword options (``max_grad_norm`` is Megatron's
        ``clip_grad``).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.megatron(optax.sgd(0.1), initial_loss_scale=8.0, loss_scale_window=2)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [jnp.inf, 1.0, jnp.inf, jnp.inf, 1.0, 1.0, jnp.inf]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      8.0 True
      8.0 False
      4.0 True
      2.0 True
      2.0 False
      4.0 False
      4.0 True
    """
    options = settings_from("megatron", options)
    rule = dynamic_rule(
        initial=("initial_loss_scale", initial_loss_scale),
        minimum=("min_loss_scale", min_loss_scale),
        maximum=("inf", math.inf),
        growth_interval=validate.count("loss_scale_window", loss_scale_window, integral_float=True),
        hysteresis=validate.count("hysteresis", hysteresis),
    )
    if loss_scale:
        rule = fixed(validate.scale("loss_scale", loss_scale))
    return loss_scaled(inner, rule, options)
