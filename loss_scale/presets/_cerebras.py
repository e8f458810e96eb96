"""The Cerebras preset: ``cerebras``."""

from __future__ import annotations

import math

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules.cerebras import CerebrasRule
from loss_scale._update import LossScaleTransformation, loss_scaled


@takes_options(exclude=("max_grad_norm",))
def cerebras(
    inner: optax.GradientTransformation,
    initial_loss_scale: float | None = 2.0**15,
    steps_per_increase: int | None = 2000,
    min_loss_scale: float | None = 2.0**-14,
    max_loss_scale: float | None = 2.0**15,
    overflow_tolerance: float = 0.0,
    max_gradient_norm: float | None = None,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """Cerebras' ``cerebras.pytorch.amp.GradScaler(loss_scale="dynamic")``.

    Source: ``cerebras/pytorch/amp/grad_scaler.py`` (cerebras_pytorch
    2.10.0, the last published), ``GradScaler.__init__`` and
    ``update_scale``. The names are the model zoo's ``optimizer`` config
    keys (``initial_loss_scale`` is the constructor's ``init_scale``). As in
    Cerebras, ``None`` or 0 for the first four means the default, which is
    the float16 one (``cbfloat16`` raises the initial and maximum scale to
    ``2**31`` there: pass them explicitly); the scale starts at
    ``min(max_loss_scale, initial_loss_scale)``; ``min_loss_scale`` below
    ``2**-14`` and a negative ``overflow_tolerance`` are rejected.

    Rule, with ``n`` the steps and ``k`` the overflows since the scale last
    changed: ``n += 1`` and ``k += 1`` on an overflow; if
    ``float32(k) / float32(n) > overflow_tolerance`` the scale halves and
    ``n = k = 0``; then if ``n > steps_per_increase`` the scale doubles and
    ``n = k = 0``; then the scale is clamped to ``[min_loss_scale,
    max_loss_scale]``. Every overflowing step is skipped (Cerebras'
    conditional update restores the parameters and optimizer state), even
    when the tolerance keeps the scale. With the default tolerance 0 this is
    growth after ``steps_per_increase + 1`` clean steps in a row and a
    backoff on every overflow. The rule is
    ``loss_scale/_rules/cerebras.py``'s ``CerebrasRule``.

    ``max_gradient_norm`` clips the unscaled gradients by their global norm
    on finite steps (as the other presets' ``max_grad_norm``).

    Differences: Cerebras decides finiteness by ``global_norm < inf`` on
    the unscaled gradients, which also flags finite gradients whose float32
    sum of squares overflows (a norm above about ``1.8e19``); the preset
    checks each element. Cerebras clips by ``max_gradient_norm / (norm +
    1e-6)`` when that is below 1; the preset by ``max_gradient_norm /
    norm`` when the norm is at least ``max_gradient_norm``, as
    ``optax.clip_by_global_norm`` (a relative difference of ``1e-6 /
    norm``).

    Args:
      inner: the optimizer to wrap.
      initial_loss_scale: the scale at step 0 (``None`` or 0: ``2**15``).
      steps_per_increase: steps without a decrease before the scale doubles
        (``None`` or 0: 2000).
      min_loss_scale: the floor, at least ``2**-14`` (``None`` or 0: ``2**-14``).
      max_loss_scale: the ceiling (``None`` or 0: ``2**15``).
      overflow_tolerance: the fraction of overflowing steps since the last
        change of the scale that does not yet halve it.
      max_gradient_norm: clip the unscaled gradients to this global norm on
        finite steps (Cerebras' own name for the ``max_grad_norm`` option,
        which this preset does not take).
      **options: the keyword options.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.cerebras(optax.sgd(0.1), initial_loss_scale=8.0, steps_per_increase=3,
      ...                          overflow_tolerance=0.5)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [1.0, 1.0, jnp.inf, 1.0, jnp.inf]:  # 1 overflow in 3 steps is tolerated
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      8.0 False
      8.0 False
      8.0 True
      16.0 False
      8.0 True
    """
    # As in Cerebras, None or 0 means the default.
    maximum = validate.scale("max_loss_scale", max_loss_scale if max_loss_scale else 2.0**15, allow_inf=True)
    initial = validate.scale("initial_loss_scale", initial_loss_scale if initial_loss_scale else 2.0**15)
    minimum = validate.scale("min_loss_scale", min_loss_scale if min_loss_scale else 2.0**-14)
    if minimum < 2.0**-14:
        raise ValueError(f"min_loss_scale too small: must be >= 2**-14, got {min_loss_scale!r}")
    initial = min(maximum, initial)
    validate.scale_bounds(
        ("min(max_loss_scale, initial_loss_scale)", initial), ("min_loss_scale", minimum), ("max_loss_scale", maximum)
    )
    tolerance = validate.real("overflow_tolerance", overflow_tolerance)
    if not 0 <= tolerance < math.inf:
        raise ValueError(f"overflow_tolerance must be finite and >= 0, got {overflow_tolerance!r}")
    steps = steps_per_increase if steps_per_increase else 2000
    rule = CerebrasRule(
        initial_scale=initial,
        # The step counter passes steps_per_increase before the growth.
        steps_per_increase=validate.count("steps_per_increase", steps, maximum=validate.INT32_MAX - 1),
        min_scale=minimum,
        max_scale=maximum,
        overflow_tolerance=tolerance,
    )
    norm = validate.optional(validate.positive, "max_gradient_norm", max_gradient_norm if max_gradient_norm else None)
    settings = settings_from("cerebras", options, exclude=("max_grad_norm",), overrides={"max_grad_norm": norm})
    return loss_scaled(inner, rule, settings)
