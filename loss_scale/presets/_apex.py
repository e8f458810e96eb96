"""The NVIDIA Apex amp preset: ``apex``."""

from __future__ import annotations

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules.static import fixed
from loss_scale._update import LossScaleTransformation, loss_scaled
from loss_scale.presets._common import FLOAT32_TINY, dynamic_rule


@takes_options()
def apex(
    inner: optax.GradientTransformation,
    init_scale: float = 2.0**16,
    scale_window: int = 2000,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    loss_scale: str | float = "dynamic",
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """NVIDIA Apex amp's ``LossScaler`` (last published source, apex master).

    Source: ``apex/amp/scaler.py``, ``LossScaler.__init__`` and
    ``update_scale``; ``min_loss_scale``, ``max_loss_scale`` and
    ``loss_scale`` are also ``amp.initialize``'s arguments.

    Rule: the scale starts at ``min(max_loss_scale, init_scale)``. On an
    overflow the step is skipped, the scale halves, floored at
    ``min_loss_scale`` when that is set (``None`` or 0: no floor), and the
    clean-step count returns to 0. On a clean step the count goes up; at
    ``scale_window`` the scale becomes ``min(max_loss_scale, scale * 2)``
    and the count returns to 0. Factors 2 and 0.5 are fixed (the
    constructor's ``scale_factor`` is unused). ``loss_scale`` other than
    ``"dynamic"`` is a static scale.

    Differences: without ``min_loss_scale`` Apex's float64 scale can halve
    far below float32's range; the preset stops at ``2**-126``. A static
    Apex scale never checks the gradients and applies inf/nan updates; the
    preset skips them. Apex checks the gradients before unscaling them (its
    Python fallback checks their float32 sum, which can overflow for finite
    gradients).

    Args:
      inner: the optimizer to wrap.
      init_scale: the scale at step 0 (capped at ``max_loss_scale``).
      scale_window: clean steps in a row before the scale doubles.
      min_loss_scale: the floor; ``None`` or 0 for none (float32's smallest
        normal here).
      max_loss_scale: the ceiling.
      loss_scale: ``"dynamic"``, or a number for a static scale.
      **options: the keyword options.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.apex(optax.sgd(0.1), init_scale=2.0**30, scale_window=1)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> float(state.scale) == 2.0**24
      True
      >>> for g in [1.0, jnp.inf, 1.0, 1.0]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale) / 2**24, bool(state.skipped))
      1.0 False
      0.5 True
      1.0 False
      1.0 False
    """
    options = settings_from("apex", options)
    maximum = validate.scale("max_loss_scale", max_loss_scale, allow_inf=True)
    initial = min(maximum, validate.scale("init_scale", init_scale))
    rule = dynamic_rule(
        initial=("min(max_loss_scale, init_scale)", initial),
        minimum=("min_loss_scale", min_loss_scale) if min_loss_scale else ("float32's smallest normal", FLOAT32_TINY),
        maximum=("max_loss_scale", maximum),
        growth_interval=validate.count("scale_window", scale_window),
    )
    if loss_scale != "dynamic":
        rule = fixed(validate.scale("loss_scale", loss_scale))
    return loss_scaled(inner, rule, options)
