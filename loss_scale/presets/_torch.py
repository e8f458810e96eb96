"""The torch.amp.GradScaler preset: ``torch``."""

from __future__ import annotations

import math

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules.static import fixed
from loss_scale._update import LossScaleTransformation, loss_scaled
from loss_scale.presets._common import FLOAT32_TINY, dynamic_rule


@takes_options()
def torch(
    inner: optax.GradientTransformation,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """``torch.amp.GradScaler``'s rule (torch 2.13).

    Source: ``torch/amp/grad_scaler.py`` (``GradScaler.update``) and the
    ``_amp_update_scale_`` kernel (``aten/src/ATen/native/cpu/
    AmpGradScalerKernels.cpp``, ``.../cuda/AmpKernels.cu``).

    Rule: on an overflow the step is skipped, ``scale *= backoff_factor`` and
    the growth tracker returns to 0. On a clean step the tracker counts up;
    when it reaches ``growth_interval`` the scale becomes ``scale *
    growth_factor`` unless that is inf (then it stays), and the tracker
    returns to 0. No minimum, no maximum.

    Differences (torch defects not reproduced): torch's scale has no floor.
    143 halvings in a row from the default ``2**16`` take it below float32's
    smallest normal (``2**-126``); from ``2**-128`` down its float32 inverse
    scale is inf and torch applies inf updates, and through the subnormals
    the scale reaches 0, where torch applies nan updates forever (0 never
    grows). The preset stops at ``2**-126``, so the trajectories agree until
    torch's scale would fall below it. torch checks the gradients before
    unscaling them, so below a scale of 1 a finite gradient can overflow in
    the division and torch applies the inf update; the preset skips it.
    ``enabled=False`` keeps the scale at 1 and, unlike torch (which then
    applies any inf/nan update), still skips non-finite steps. The
    ``device`` argument has no counterpart.

    Args:
      inner: the optimizer to wrap.
      init_scale: the scale at step 0.
      growth_factor: the multiplier on growth.
      backoff_factor: the multiplier on an overflow.
      growth_interval: clean steps in a row before the scale grows.
      enabled: ``False`` keeps the scale at 1 (non-finite steps are still
        skipped).
      **options: the keyword options.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.torch(optax.sgd(0.1), init_scale=8.0, growth_interval=2)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [1.0, 1.0, jnp.inf, 1.0]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      8.0 False
      16.0 False
      8.0 True
      8.0 False
    """
    options = settings_from("torch", options)
    rule = dynamic_rule(
        initial=("init_scale", init_scale),
        minimum=("float32's smallest normal", FLOAT32_TINY),
        maximum=("inf", math.inf),
        growth_factor=("growth_factor", growth_factor),
        backoff_factor=("backoff_factor", backoff_factor),
        growth_interval=validate.count("growth_interval", growth_interval),
    )
    if not validate.flag("enabled", enabled):
        rule = fixed(1.0)
    return loss_scaled(inner, rule, options)
