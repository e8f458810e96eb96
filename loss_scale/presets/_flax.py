"""The flax preset: ``flax``."""

from __future__ import annotations

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._update import LossScaleTransformation, loss_scaled
from loss_scale.presets._common import FLOAT32_MAX, FLOAT32_TINY, dynamic_rule


@takes_options()
def flax(
    inner: optax.GradientTransformation,
    scale: float = 65536.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    minimum_scale: float | None = None,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """flax's ``flax.training.dynamic_scale.DynamicScale`` (flax 0.12).

    Source: ``flax/training/dynamic_scale.py``, ``DynamicScale.value_and_grad``
    (0.12.8). Rule: ``fin_steps`` counts clean steps. On a clean step, if
    ``fin_steps == growth_interval`` the scale becomes ``min(scale *
    growth_factor, float32 max)`` and ``fin_steps`` returns to 0, otherwise
    ``fin_steps`` counts up: the scale grows on the ``growth_interval + 1``-th
    clean step in a row, not the ``growth_interval``-th. On an overflow
    ``scale = max(scale * backoff_factor, minimum_scale)`` and ``fin_steps =
    0``; flax returns ``is_fin`` and leaves the skip to the caller, the preset
    skips the step.

    Here: ``DynamicRule(growth_interval=growth_interval + 1,
    max_scale=float32 max)``. ``minimum_scale=None`` (this preset's default)
    means float32's smallest normal, flax's own default
    (``jnp.finfo(jnp.float32).tiny``).

    Differences: flax's ``minimum_scale=None`` disables its floor, letting
    the scale reach 0; the preset keeps float32's smallest normal instead.

    Args:
      inner: the optimizer to wrap.
      scale: the scale at step 0.
      growth_factor: the multiplier on growth.
      backoff_factor: the multiplier on an overflow.
      growth_interval: flax grows on the ``growth_interval + 1``-th clean
        step in a row.
      minimum_scale: the floor; ``None`` for float32's smallest normal.
      **options: the keyword options.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.flax(optax.sgd(0.1), scale=8.0, growth_interval=2)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [1.0, 1.0, 1.0, jnp.inf]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      8.0 False
      8.0 False
      16.0 False
      8.0 True
    """
    options = settings_from("flax", options)
    rule = dynamic_rule(
        initial=("scale", scale),
        minimum=("minimum_scale", FLOAT32_TINY if minimum_scale is None else minimum_scale),
        maximum=("float32's largest value", FLOAT32_MAX),
        growth_factor=("growth_factor", growth_factor),
        backoff_factor=("backoff_factor", backoff_factor),
        # flax grows on the (growth_interval + 1)-th clean step.
        growth_interval=validate.count("growth_interval", growth_interval, 0, validate.INT32_MAX - 1) + 1,
    )
    return loss_scaled(inner, rule, options)
