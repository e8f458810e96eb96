"""The jmp preset: ``jmp``."""

from __future__ import annotations

import math

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._update import LossScaleTransformation, loss_scaled
from loss_scale.presets._common import dynamic_rule


@takes_options()
def jmp(
    inner: optax.GradientTransformation,
    loss_scale: float = 2.0**15,
    period: int = 2000,
    factor: int = 2,
    min_loss_scale: float = 1.0,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """jmp's ``jmp.DynamicLossScale`` (jmp 0.0.4).

    Source: ``jmp/_src/loss_scale.py``, ``DynamicLossScale.adjust``. jmp's
    ``loss_scale`` has no default; ``2**15`` is the value its docstring
    uses. Rule: on a clean step, if ``counter == period - 1`` the scale
    becomes ``scale * factor`` when that is finite (else it stays), and
    ``counter = (counter + 1) % period``: growth after ``period`` clean steps
    in a row. On an overflow ``scale = max(min_loss_scale, scale / factor)``
    and ``counter = 0``. No maximum.

    Here: ``backoff_factor = 1 / factor``, exact for power-of-two factors;
    for others (3, 10) each backoff may differ from jmp's division by one
    float32 rounding.

    Differences (jmp defect not reproduced): jmp keeps ``min_loss_scale``
    out of its pytree (``tree_flatten`` drops it), so after crossing a
    ``jit`` boundary or any tree transformation the minimum silently
    becomes 1. The preset keeps ``min_loss_scale`` under ``jit``. jmp leaves
    the skip to the caller; the preset skips the step.

    Args:
      inner: the optimizer to wrap.
      loss_scale: the scale at step 0.
      period: clean steps in a row before the scale grows.
      factor: the scale is multiplied by it on growth and divided by it on an
        overflow (an int >= 2).
      min_loss_scale: the floor.
      **options: the keyword options.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.jmp(optax.sgd(0.1), loss_scale=4.0, period=1, factor=4, min_loss_scale=0.5)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [jnp.inf, jnp.inf, 1.0]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      1.0 True
      0.5 True
      2.0 False
    """
    options = settings_from("jmp", options)
    # 1 / factor must be a normal float32.
    factor = validate.count("factor", factor, 2, 2**126, integral_float=True)
    rule = dynamic_rule(
        initial=("loss_scale", loss_scale),
        minimum=("min_loss_scale", min_loss_scale),
        maximum=("inf", math.inf),
        growth_factor=("factor", float(factor)),
        backoff_factor=("1 / factor", 1.0 / factor),
        growth_interval=validate.count("period", period),
    )
    return loss_scaled(inner, rule, options)
