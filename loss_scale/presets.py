"""Compatibility presets: other libraries' loss-scaling rules, by their own names.

Each function takes the inner optimizer and the arguments of one peer, with
that peer's names and defaults, and returns the loss-scaling transformation
(``optax.GradientTransformationExtraArgs`` with a ``LossScaleState``) whose
scale after every step, and whose skipped steps, are the peer's for the same
sequence of clean and overflowing steps. Bring a PyTorch, DeepSpeed or
Megatron configuration and get the same scale trajectory:

=============  ================================  ==========================================
preset         peer                              growth after / backoff / bounds
=============  ================================  ==========================================
``torch``      torch 2.13 ``GradScaler``         N clean / x backoff_factor / none
``keras``      Keras 3.15 LossScaleOptimizer     N clean / x0.5 / none
``tf_keras``   tf-keras 2.21 LossScaleOptimizer  N clean / x0.5 / min 1
``deepspeed``  DeepSpeed 0.19 (ZeRO)             N+1 first, then N / x0.5, hysteresis / min
``megatron``   megatron-core 0.16                N clean / x0.5, hysteresis / min
``apex``       Apex amp ``LossScaler`` (master)  N clean / x0.5 / min, max 2**24
``flax``       flax 0.12 ``DynamicScale``        N+1 clean / x backoff_factor / min
``jmp``        jmp 0.0.4 ``DynamicLossScale``    N clean / / factor / min 1
``cerebras``   cerebras_pytorch 2.10             N+1 steps / x0.5, tolerance / min, max
=============  ================================  ==========================================

What every preset shares, and where that differs from some peers:

* A step is skipped exactly when a gradient is non-finite once divided by
  the scale; the inner optimizer's update does not run, so its state (Adam's
  moments, the step count behind learning-rate schedules) is unchanged.
  torch, Megatron, DeepSpeed, Apex and Keras 3 check the gradients *before*
  dividing them, which is the same check while the scale is at least 1; below
  1 a finite gradient can overflow in the division, which those peers then
  apply as inf.
* The scale is float32 and never becomes 0 or inf: a growth that would give
  inf keeps the scale, and a preset whose peer has no minimum stops at
  float32's smallest normal (``2**-126``). Peers without these guards can
  reach a scale of inf (then every step overflows and is skipped, forever)
  or of 0 (then torch and Keras 3 apply nan updates, forever).
  DeepSpeed and Apex keep the scale as a Python float (float64): the
  trajectories agree while the scale stays within float32's normal range.
* Factors are applied in float32 (``scale * float32(factor)``). With
  power-of-two factors (every default) this is exact. torch multiplies by
  its factors in float64 and rounds once, and jmp divides by its factor, so
  with a factor such as 0.9 (torch) or 3 (jmp) each growth or backoff may
  differ by one float32 rounding.

Every preset also takes, keyword-only, the options of ``loss_scale.dynamic``:
``max_grad_norm`` (fused clipping of the unscaled gradients; ``cerebras``
takes its own ``max_gradient_norm`` instead), ``track_grad_norm``,
``locate_overflows``, ``axis_name``, ``max_consecutive_skips`` and
``track_underflow``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import optax

from loss_scale import _validate as validate
from loss_scale._peer_rules import CerebrasRule
from loss_scale._state import DynamicRule, StaticRule
from loss_scale._transform import LossScaleTransformation, keyword_options, loss_scaled

__all__ = ["apex", "cerebras", "deepspeed", "flax", "jmp", "keras", "megatron", "tf_keras", "torch"]

FLOAT32_MAX, FLOAT32_TINY = validate.FLOAT32_MAX, validate.FLOAT32_TINY

_Result = LossScaleTransformation


def _dynamic_rule(
    *,
    initial: tuple[str, Any],
    minimum: tuple[str, Any],
    maximum: tuple[str, Any],
    growth_factor: tuple[str, Any] = ("growth_factor", 2.0),
    backoff_factor: tuple[str, Any] = ("backoff_factor", 0.5),
    growth_interval: int,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    growth_delay: int = 0,
) -> DynamicRule:
    """``DynamicRule`` from a peer's settings, each a ``(peer's name, value)``
    pair so that every error names the peer's argument. Counts are checked
    by the caller, which knows their names and ranges.

    Presets check every setting whatever their mode (``enabled=False``, a
    static ``loss_scale``), so that a wrong setting fails before anyone
    switches the mode."""
    initial_value = validate.scale(*initial)
    min_value = validate.scale(*minimum)
    max_value = validate.scale(*maximum, allow_inf=True)
    validate.scale_bounds((initial[0], initial_value), (minimum[0], min_value), (maximum[0], max_value))
    return DynamicRule(
        initial_scale=initial_value,
        growth_factor=validate.growth_factor(*growth_factor),
        backoff_factor=validate.backoff_factor(*backoff_factor),
        growth_interval=growth_interval,
        min_scale=min_value,
        max_scale=max_value,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        growth_delay=growth_delay,
    )


def torch(
    inner: optax.GradientTransformation,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
      init_scale, growth_factor, backoff_factor, growth_interval, enabled:
        as ``torch.amp.GradScaler``, with its defaults.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``.

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    rule = _dynamic_rule(
        initial=("init_scale", init_scale),
        minimum=("float32's smallest normal", FLOAT32_TINY),
        maximum=("inf", math.inf),
        growth_factor=("growth_factor", growth_factor),
        backoff_factor=("backoff_factor", backoff_factor),
        growth_interval=validate.count("growth_interval", growth_interval),
    )
    if not validate.flag("enabled", enabled):
        rule = StaticRule(1.0)
    return loss_scaled(inner, rule, options)


def keras(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
      initial_scale, dynamic_growth_steps: as Keras 3, with its defaults.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``.

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    rule = _dynamic_rule(
        initial=("initial_scale", initial_scale),
        minimum=("float32's smallest normal", FLOAT32_TINY),
        maximum=("inf", math.inf),
        growth_interval=validate.count("dynamic_growth_steps", dynamic_growth_steps),
    )
    return loss_scaled(inner, rule, options)


def tf_keras(
    inner: optax.GradientTransformation,
    dynamic: bool = True,
    initial_scale: float | None = None,
    dynamic_growth_steps: int | None = None,
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
      dynamic, initial_scale, dynamic_growth_steps: as tf-keras, with its
        defaults.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``.

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    if not validate.flag("dynamic", dynamic):
        if initial_scale is None:
            raise ValueError('"initial_scale" must be specified if "dynamic" is False')
        if dynamic_growth_steps is not None:
            raise ValueError(f'"dynamic_growth_steps" must be None if "dynamic" is False, got {dynamic_growth_steps!r}')
        return loss_scaled(inner, StaticRule(validate.scale("initial_scale", initial_scale)), options)
    initial = validate.scale("initial_scale", 2.0**15 if initial_scale is None else initial_scale)
    if initial < 1:
        raise ValueError(f"initial_scale must be >= 1 (tf-keras's minimum scale), got {initial_scale!r}")
    steps = 2000 if dynamic_growth_steps is None else dynamic_growth_steps
    rule = _dynamic_rule(
        initial=("initial_scale", initial),
        minimum=("tf-keras's minimum scale", 1.0),
        maximum=("inf", math.inf),
        growth_interval=validate.count("dynamic_growth_steps", steps, integral_float=True),
    )
    return loss_scaled(inner, rule, options)


def deepspeed(
    inner: optax.GradientTransformation,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_loss_scale: float = 1.0,
    *,
    loss_scale: float = 0.0,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
    state.overflow_budget == 0``. DeepSpeed never checks that a doubled scale
    is finite; its Python-float scale can pass float32's largest value (where
    the preset stays). The non-ZeRO ``FP16_Optimizer``/``FP16_UnfusedOptimizer``
    paths (``fused_optimizer.py``, ``unfused_optimizer.py``) ignore
    ``hysteresis`` and ``consecutive_hysteresis`` and never raise: for them
    pass ``hysteresis=1``.

    Args:
      inner: the optimizer to wrap.
      initial_scale_power, loss_scale_window, hysteresis,
        consecutive_hysteresis, min_loss_scale, loss_scale: DeepSpeed's
        ``fp16`` keys, with its defaults.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``
        (``max_grad_norm`` is DeepSpeed's ``gradient_clipping``).

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    power = validate.count("initial_scale_power", initial_scale_power, -126, 127)
    rule = _dynamic_rule(
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
        rule = StaticRule(validate.scale("loss_scale", loss_scale))
    return loss_scaled(inner, rule, options)


def megatron(
    inner: optax.GradientTransformation,
    initial_loss_scale: float = 2.0**32,
    min_loss_scale: float = 1.0,
    loss_scale_window: float = 1000,
    hysteresis: int = 2,
    *,
    loss_scale: float | None = None,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
      initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis,
        loss_scale: Megatron's ``OptimizerConfig`` fields, with its defaults
        (``loss_scale_window`` is typed float there; integral values only).
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``
        (``max_grad_norm`` is Megatron's ``clip_grad``).

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    rule = _dynamic_rule(
        initial=("initial_loss_scale", initial_loss_scale),
        minimum=("min_loss_scale", min_loss_scale),
        maximum=("inf", math.inf),
        growth_interval=validate.count("loss_scale_window", loss_scale_window, integral_float=True),
        hysteresis=validate.count("hysteresis", hysteresis),
    )
    if loss_scale:
        rule = StaticRule(validate.scale("loss_scale", loss_scale))
    return loss_scaled(inner, rule, options)


def apex(
    inner: optax.GradientTransformation,
    init_scale: float = 2.0**16,
    scale_window: int = 2000,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    loss_scale: str | float = "dynamic",
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
      init_scale, scale_window, min_loss_scale, max_loss_scale, loss_scale:
        as Apex, with its defaults.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``.

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    maximum = validate.scale("max_loss_scale", max_loss_scale, allow_inf=True)
    initial = min(maximum, validate.scale("init_scale", init_scale))
    rule = _dynamic_rule(
        initial=("min(max_loss_scale, init_scale)", initial),
        minimum=("min_loss_scale", min_loss_scale) if min_loss_scale else ("float32's smallest normal", FLOAT32_TINY),
        maximum=("max_loss_scale", maximum),
        growth_interval=validate.count("scale_window", scale_window),
    )
    if loss_scale != "dynamic":
        rule = StaticRule(validate.scale("loss_scale", loss_scale))
    return loss_scaled(inner, rule, options)


def flax(
    inner: optax.GradientTransformation,
    scale: float = 65536.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    minimum_scale: float | None = None,
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
      scale, growth_factor, backoff_factor, growth_interval, minimum_scale:
        as ``DynamicScale``, with its defaults.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``
        (``axis_name`` agrees on the finite check; average the gradients
        yourself, see ``loss_scale.value_and_grad``).

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    rule = _dynamic_rule(
        initial=("scale", scale),
        minimum=("minimum_scale", FLOAT32_TINY if minimum_scale is None else minimum_scale),
        maximum=("float32's largest value", FLOAT32_MAX),
        growth_factor=("growth_factor", growth_factor),
        backoff_factor=("backoff_factor", backoff_factor),
        # flax grows on the (growth_interval + 1)-th clean step.
        growth_interval=validate.count("growth_interval", growth_interval, 0, validate.INT32_MAX - 1) + 1,
    )
    return loss_scaled(inner, rule, options)


def jmp(
    inner: optax.GradientTransformation,
    loss_scale: float = 2.0**15,
    period: int = 2000,
    factor: int = 2,
    min_loss_scale: float = 1.0,
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
      loss_scale, period, factor, min_loss_scale: as ``DynamicLossScale``,
        with its defaults.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as ``loss_scale.dynamic``.

    Example:
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
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    # 1 / factor must be a normal float32.
    factor = validate.count("factor", factor, 2, 2**126, integral_float=True)
    rule = _dynamic_rule(
        initial=("loss_scale", loss_scale),
        minimum=("min_loss_scale", min_loss_scale),
        maximum=("inf", math.inf),
        growth_factor=("factor", float(factor)),
        backoff_factor=("1 / factor", 1.0 / factor),
        growth_interval=validate.count("period", period),
    )
    return loss_scaled(inner, rule, options)


def cerebras(
    inner: optax.GradientTransformation,
    initial_loss_scale: float | None = 2.0**15,
    steps_per_increase: int | None = 2000,
    min_loss_scale: float | None = 2.0**-14,
    max_loss_scale: float | None = 2.0**15,
    overflow_tolerance: float = 0.0,
    max_gradient_norm: float | None = None,
    *,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> _Result:
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
    backoff on every overflow. See ``_peer_rules.CerebrasRule`` for how the
    counters sit in the state.

    ``max_gradient_norm`` clips the unscaled gradients by their global norm
    on finite steps (``Options(max_grad_norm=...)``).

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
      initial_loss_scale, steps_per_increase, min_loss_scale, max_loss_scale,
        overflow_tolerance, max_gradient_norm: as Cerebras, with its float16
        defaults.
      track_grad_norm, locate_overflows, axis_name, max_consecutive_skips,
        track_underflow: as ``loss_scale.dynamic``.

    Example:
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
    options = keyword_options(
        max_gradient_norm if max_gradient_norm else None,
        track_grad_norm,
        locate_overflows,
        axis_name,
        max_consecutive_skips,
        track_underflow,
    )
    return loss_scaled(inner, rule, options)
