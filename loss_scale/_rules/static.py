"""A fixed loss scale: ``loss_scale.static`` and ``loss_scale.no_op``."""

from __future__ import annotations

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules.dynamic import DynamicRule
from loss_scale._transform import LossScaleTransformation, loss_scaled


def fixed(scale: float) -> DynamicRule:
    """The rule of a fixed scale: the dynamic rule with its scale pinned
    (``min_scale = max_scale``), so that its state has ``dynamic``'s layout
    (``loss_scale.for_dtype`` switches between the two without changing the
    checkpoint's structure). It never grows (``growth_interval`` is the
    largest int32, and any growth would be capped at the scale anyway), and
    ``good_steps`` counts the clean steps in a row. ``scale`` is validated by
    the caller."""
    return DynamicRule(initial_scale=scale, min_scale=scale, max_scale=scale, growth_interval=validate.INT32_MAX)


@takes_options()
def static(inner: optax.GradientTransformation, scale: float, **options: Unpack[Options]) -> LossScaleTransformation:
    """A fixed loss scale around ``inner``; non-finite steps are still skipped.

    Args:
      inner: the optimizer to wrap.
      scale: the loss scale, a positive normal float32.
      **options: the keyword options.

    Returns:
      A ``LossScaleTransformation`` whose state is a ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.static(optax.sgd(1.0), scale=128.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> updates, state = tx.update(jnp.array([128.0, jnp.inf]), state)
      >>> updates, bool(state.skipped)
      (Array([0., 0.], dtype=float32), True)
    """
    return loss_scaled(inner, fixed(validate.scale("scale", scale)), settings_from("static", options))


def no_op(inner: optax.GradientTransformation, skip_nonfinite: bool = False) -> LossScaleTransformation:
    """No loss scaling (scale 1), with the same state as ``dynamic``.

    For bfloat16 and float32 training, so that switching precision does not
    change the shape of the optimizer state or the training loop
    (``loss_scale.for_dtype`` builds it with the options, which take effect
    as they do for ``dynamic``).

    Args:
      inner: the optimizer to wrap.
      skip_nonfinite: by default the inner update runs on every step, even a
        non-finite one, as the bare optimizer's would (the statistics are
        still measured: ``grad_max`` is inf after a non-finite step); ``True``
        skips non-finite steps as ``static(inner, 1.0)`` does.

    Returns:
      A ``LossScaleTransformation`` whose state is a ``LossScaleState``.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.no_op(optax.sgd(1.0))
      >>> state = tx.init(jnp.zeros(2))
      >>> float(ls.get_scale(state))
      1.0
      >>> updates, state = tx.update(jnp.array([3.0, -4.0]), state)
      >>> updates, float(ls.metrics(state)["loss_scale/grad_max"])
      (Array([-3.,  4.], dtype=float32), 4.0)
    """
    return unscaled(inner, "no_op", {}, skip_nonfinite)


def unscaled(
    inner: optax.GradientTransformation, function: str, options: Options, skip_nonfinite: bool
) -> LossScaleTransformation:
    """Scale 1 around ``inner``, with ``options`` (validated for
    ``function``); every step applied unless ``skip_nonfinite``. The options
    that act on skipped steps only are refused without it."""
    skip_nonfinite = validate.flag("skip_nonfinite", skip_nonfinite)
    return loss_scaled(inner, fixed(1.0), settings_from(function, options, check_finite=skip_nonfinite))
