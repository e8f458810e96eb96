"""The Keras 3 and tf-keras presets: ``keras``, ``tf_keras``."""

from __future__ import annotations

import math

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules.static import fixed
from loss_scale._update import LossScaleTransformation, loss_scaled
from loss_scale.presets._common import FLOAT32_TINY, dynamic_rule


@takes_options()
def keras(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """Keras 3's ``keras.optimizers.LossScaleOptimizer`` (Keras 3.15).

    Source: ``keras/src/optimizers/loss_scale_optimizer.py``
    (``stateless_apply``, ``_stateless_handle_finite_grads``,
    ``_stateless_handle_non_finite_grads``).

    Rule: on an overflow the step is skipped, ``scale *= 0.5`` and the step
    counter returns to 0. On a clean step, if the counter equals
    ``dynamic_growth_steps - 1`` the scale doubles and the counter returns to
    0, else the counter counts up: the scale doubles after
    ``dynamic_growth_steps`` clean steps in a row. Factors 2 and 0.5 are
    fixed; no minimum, no maximum.

    Differences (Keras defects not reproduced): Keras never checks that a
    doubled scale is finite (from ``2**127`` it becomes inf, every step
    overflows and is skipped, and ``inf * 0.5`` stays inf), and has no
    minimum (the scale can halve to 0, where the scaled gradients are 0,
    pass Keras's check, and are divided by 0: Keras applies nan updates from
    then on). The preset keeps the scale when doubling would give inf and
    stops at ``2**-126``. Keras checks the scaled gradients, the preset the
    unscaled ones (the same while the scale is at least 1).

    Args:
      inner: the optimizer to wrap.
      initial_scale: the scale at step 0.
      dynamic_growth_steps: clean steps in a row before the scale doubles.
      **options: the keyword options.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.keras(optax.sgd(0.1), initial_scale=4.0, dynamic_growth_steps=1)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [1.0, jnp.nan, 1.0]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      8.0 False
      4.0 True
      8.0 False
    """
    options = settings_from("keras", options)
    rule = dynamic_rule(
        initial=("initial_scale", initial_scale),
        minimum=("float32's smallest normal", FLOAT32_TINY),
        maximum=("inf", math.inf),
        growth_interval=validate.count("dynamic_growth_steps", dynamic_growth_steps),
    )
    return loss_scaled(inner, rule, options)


@takes_options()
def tf_keras(
    inner: optax.GradientTransformation,
    dynamic: bool = True,
    initial_scale: float | None = None,
    dynamic_growth_steps: int | None = None,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """tf-keras's ``tf.keras.mixed_precision.LossScaleOptimizer`` (tf-keras 2.21).

    Source: ``tf_keras/src/mixed_precision/loss_scale_optimizer.py``
    (``_DynamicLossScaleState.update``, ``LossScaleOptimizer.__init__`` and
    ``apply_gradients``). ``initial_scale=None`` means ``2**15`` and
    ``dynamic_growth_steps=None`` means 2000 (``_DEFAULT_INITIAL_SCALE``,
    ``_DEFAULT_GROWTH_STEPS``), with ``multiplier=2``.

    Rule (``dynamic=True``): on an overflow the step is skipped, the counter
    returns to 0 and ``scale = max(scale / 2, 1)``. On a clean step, if
    ``counter + 1 >= dynamic_growth_steps`` the scale doubles if the result is
    finite (else it stays) and the counter returns to 0; otherwise the
    counter counts up. So: growth after ``dynamic_growth_steps`` clean steps,
    a minimum of 1, no maximum. ``dynamic=False`` keeps ``initial_scale``
    (then required, and ``dynamic_growth_steps`` must be None, as tf-keras
    requires).

    Differences: on a skipped step tf-keras still increments the inner
    optimizer's ``iterations`` (so learning-rate schedules advance); the
    preset leaves the inner state, step count included, unchanged. With
    ``dynamic=False`` tf-keras applies non-finite gradients; the preset skips
    them. An ``initial_scale`` below 1 is rejected (tf-keras would jump to 1
    on the first overflow).

    Args:
      inner: the optimizer to wrap.
      dynamic: ``False`` for a fixed ``initial_scale``.
      initial_scale: the scale at step 0 (``None``: ``2**15``).
      dynamic_growth_steps: clean steps before the scale doubles (``None``:
        2000; must be ``None`` when ``dynamic`` is ``False``).
      **options: the keyword options.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.tf_keras(optax.sgd(0.1), initial_scale=2.0, dynamic_growth_steps=3)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [jnp.inf, jnp.inf, 1.0, 1.0, 1.0]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      1.0 True
      1.0 True
      1.0 False
      1.0 False
      2.0 False
    """
    options = settings_from("tf_keras", options)
    if not validate.flag("dynamic", dynamic):
        if initial_scale is None:
            raise ValueError('"initial_scale" must be specified if "dynamic" is False')
        if dynamic_growth_steps is not None:
            raise ValueError(f'"dynamic_growth_steps" must be None if "dynamic" is False, got {dynamic_growth_steps!r}')
        return loss_scaled(inner, fixed(validate.scale("initial_scale", initial_scale)), options)
    initial = validate.scale("initial_scale", 2.0**15 if initial_scale is None else initial_scale)
    if initial < 1:
        raise ValueError(f"initial_scale must be >= 1 (tf-keras's minimum scale), got {initial_scale!r}")
    steps = 2000 if dynamic_growth_steps is None else dynamic_growth_steps
    rule = dynamic_rule(
        initial=("initial_scale", initial),
        minimum=("tf-keras's minimum scale", 1.0),
        maximum=("inf", math.inf),
        growth_interval=validate.count("dynamic_growth_steps", steps, integral_float=True),
    )
    return loss_scaled(inner, rule, options)
