"""The DeepSpeed preset: ``deepspeed``."""

from __future__ import annotations

import math

import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules.static import fixed
from loss_scale._update import LossScaleTransformation, loss_scaled
from loss_scale.presets._common import dynamic_rule


@takes_options()
def deepspeed(
    inner: optax.GradientTransformation,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_loss_scale: float = 1.0,
    *,
    loss_scale: float = 0.0,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """DeepSpeed's ``fp16`` dynamic loss scaler (DeepSpeed 0.19).

    The arguments are the keys of DeepSpeed's ``"fp16"`` config section
    (``deepspeed/runtime/precision_config.py``, ``DeepSpeedFP16Config``),
    with its defaults; ``loss_scale`` > 0 selects a static scale.

    Source: ``deepspeed/runtime/fp16/loss_scaler.py``,
    ``DynamicLossScaler.update_scale`` (0.19.8), which ZeRO stages 1-3 use.
    DeepSpeed counts iterations; with ``W = loss_scale_window``, ``h =
    hysteresis``, a scale starting at ``2**initial_scale_power`` and the
    hysteresis counter at ``h``:

    * overflow: the step is skipped. If ``h == 1`` or the counter is at 1
      the scale becomes ``max(scale / 2, min_loss_scale)`` (DeepSpeed raises
      instead when the scale already equals ``min_loss_scale``, see below);
      otherwise the counter drops by one. The overflow is remembered either
      way.
    * clean step: with ``consecutive_hysteresis`` the counter is refilled to
      ``h``. The scale doubles when the number of clean steps since the last
      overflow (or the start), not counting this one, is a positive multiple
      of ``W``, and then (without ``consecutive_hysteresis``) the counter is
      refilled. So the first growth after an overflow, or after the start,
      needs ``W + 1`` clean steps and the next ones ``W`` each (since
      DeepSpeed 0.17.1; until 0.17.0 the first also needed ``W``). No
      maximum.

    Here: ``DynamicRule(growth_interval=W, growth_delay=1, hysteresis=h)``,
    whose overflow budget, after an overflow, is 0 exactly when DeepSpeed
    backs off (its counter was at 1).

    Differences: where DeepSpeed raises ``Exception("Current loss scale
    already at minimum ...")`` (an overflow that calls for a backoff while
    the scale equals ``min_loss_scale``), a jitted update cannot raise: the
    preset skips the step and keeps the scale at ``min_loss_scale``. To stop
    as DeepSpeed does, check on the host after each update, with ``prev`` the
    scale before it: ``prev == min_loss_scale and state.skipped and
    state.counters.overflows_left == 0``. DeepSpeed never checks that a doubled scale
    is finite; its Python-float scale can pass float32's largest value (where
    the preset stays). The non-ZeRO ``FP16_Optimizer``/``FP16_UnfusedOptimizer``
    paths (``fused_optimizer.py``, ``unfused_optimizer.py``) ignore
    ``hysteresis`` and ``consecutive_hysteresis`` and never raise: for them
    pass ``hysteresis=1``.

    Args:
      inner: the optimizer to wrap.
      initial_scale_power: the scale at step 0 is ``2**initial_scale_power``.
      loss_scale_window: clean steps before the scale doubles (one more for
        the first growth after an overflow or the start).
      hysteresis: overflows tolerated before the scale halves.
      consecutive_hysteresis: refill the hysteresis on every clean step.
      min_loss_scale: the floor.
      loss_scale: a positive number for a static scale; 0 for dynamic.
      **options: the keyword options (``max_grad_norm`` is DeepSpeed's
        ``gradient_clipping``).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.presets.deepspeed(optax.sgd(0.1), initial_scale_power=3, loss_scale_window=2)
      >>> state, update = tx.init(jnp.zeros(1)), jax.jit(tx.update)
      >>> for g in [1.0, 1.0, 1.0, jnp.inf, jnp.inf, 1.0, 1.0, 1.0]:
      ...     _, state = update(jnp.array([g]) * state.scale, state)
      ...     print(float(state.scale), bool(state.skipped))
      8.0 False
      8.0 False
      16.0 False
      16.0 True
      8.0 True
      8.0 False
      8.0 False
      16.0 False
    """
    options = settings_from("deepspeed", options)
    power = validate.count("initial_scale_power", initial_scale_power, -126, 127)
    rule = dynamic_rule(
        initial=("2**initial_scale_power", 2.0**power),
        minimum=("min_loss_scale", min_loss_scale),
        maximum=("inf", math.inf),
        # The first growth needs one more clean step: the window's counter
        # must stay an int32.
        growth_interval=validate.count("loss_scale_window", loss_scale_window, maximum=validate.INT32_MAX - 1),
        hysteresis=validate.count("hysteresis", hysteresis),
        consecutive_hysteresis=validate.flag("consecutive_hysteresis", consecutive_hysteresis),
        growth_delay=1,
    )
    if loss_scale:
        rule = fixed(validate.scale("loss_scale", loss_scale))
    return loss_scaled(inner, rule, options)
