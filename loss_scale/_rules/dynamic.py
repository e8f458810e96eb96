"""Dynamic loss scaling: grow after clean runs, back off on overflow.

``loss_scale.dynamic`` and the presets of torch, Keras, tf-keras, DeepSpeed,
Megatron-LM, Apex, flax and jmp use this rule.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale import _validate as validate
from loss_scale._options import Options, Unpack, settings_from, takes_options
from loss_scale._rules import RuleState, select
from loss_scale._transform import LossScaleTransformation, loss_scaled


class DynamicCounters(NamedTuple):
    """The dynamic rule's counters.

    Attributes:
      overflows_left: int32, overflows still tolerated before the scale backs
        off (hysteresis): refilled to ``hysteresis`` on every growth (and, with
        ``consecutive_hysteresis``, on every clean step), one less on every
        overflow, never below 0.
      first_growth_pending: bool, no growth since the last overflow (or the
        start); with ``growth_delay`` (DeepSpeed's rule) that growth needs
        more clean steps than the later ones.
    """

    overflows_left: jax.Array
    first_growth_pending: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicRule:
    """Dynamic loss scaling, applied once per update with ``finite`` the
    result of the check on the unscaled gradients:

    * clean step: ``good_steps += 1``; with ``consecutive_hysteresis`` the
      overflow allowance is refilled. When ``good_steps`` reaches
      ``growth_interval`` (plus ``growth_delay`` for the first growth after an
      overflow or the start) the scale becomes ``min(scale * growth_factor,
      max_scale)`` (kept as it is if that is not finite), ``good_steps``
      returns to 0 and the allowance is refilled to ``hysteresis``.
    * overflow: ``good_steps = 0`` and the allowance drops by one (not below
      0). When it reaches 0 the scale becomes ``max(scale * backoff_factor,
      min_scale)``. It stays at 0, so every further overflow backs off until
      the next refill: with ``hysteresis = h`` the scale backs off on the h-th
      overflow since the last growth, and on each overflow after it.

    With ``hysteresis=1`` this is torch.amp.GradScaler's rule, with a floor
    and a ceiling. ``consecutive_hysteresis=False`` is Megatron-LM's and
    DeepSpeed's default; ``True`` is DeepSpeed's ``consecutive_hysteresis``.
    ``growth_delay=1`` is DeepSpeed's since 0.17.1. Settings are validated by
    the functions that build the rule (``dynamic``, the presets).
    """

    initial_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    growth_delay: int = 0

    @property
    def floor(self) -> float:
        # A pinned scale (min_scale == max_scale, loss_scale.static) has no
        # minimum to get stuck at.
        if self.min_scale == self.max_scale:
            return 0.0
        return float(np.float32(self.min_scale))

    def init(self) -> RuleState:
        return RuleState.start(
            self.initial_scale,
            DynamicCounters(
                overflows_left=jnp.asarray(self.hysteresis, jnp.int32),
                first_growth_pending=jnp.ones((), jnp.bool_),
            ),
        )

    def adjust(
        self, state: RuleState, finite: jax.Array, grad_max: jax.Array, backward_peak: jax.Array | None = None
    ) -> RuleState:
        del grad_max, backward_peak  # a reactive rule: only whether the step overflowed matters
        scale, good_steps, counters = state
        hysteresis = jnp.asarray(self.hysteresis, jnp.int32)
        # A state restored from a run with a larger hysteresis keeps at most this one's allowance.
        allowance = jnp.minimum(counters.overflows_left, hysteresis)

        # Clean step.
        clean_steps = good_steps + 1
        needed = self.growth_interval + jnp.where(counters.first_growth_pending, self.growth_delay, 0)
        grow = clean_steps >= needed
        grown = jnp.minimum(scale * jnp.float32(self.growth_factor), jnp.float32(self.max_scale))
        # A scale of inf would turn every loss into inf: refuse to grow there.
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        clean = RuleState(
            scale=jnp.where(grow, grown, scale),
            good_steps=jnp.where(grow, 0, clean_steps).astype(jnp.int32),
            counters=DynamicCounters(
                overflows_left=hysteresis if self.consecutive_hysteresis else jnp.where(grow, hysteresis, allowance),
                first_growth_pending=counters.first_growth_pending & ~grow,
            ),
        )

        # Overflow.
        left = jnp.maximum(allowance - 1, 0)
        shrunk = jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(self.min_scale))
        overflow = RuleState(
            scale=jnp.where(left == 0, shrunk, scale),
            good_steps=jnp.zeros((), jnp.int32),
            counters=DynamicCounters(overflows_left=left, first_growth_pending=jnp.ones((), jnp.bool_)),
        )
        return select(finite, clean, overflow)


@takes_options()
def dynamic(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    **options: Unpack[Options],
) -> LossScaleTransformation:
    """Dynamic loss scaling around any optax optimizer.

    ``update`` expects the gradients of ``loss * scale`` (see
    ``loss_scale.value_and_grad``). It divides them by the scale in float32,
    checks them for inf/nan, and then either runs ``inner``'s update on the
    unscaled gradients or, if anything is non-finite, skips it: the updates
    are zeros and ``inner``'s state is returned unchanged (Adam's moments and
    step count do not move). Then the scale adjusts:

    * after ``growth_interval`` consecutive clean steps it is multiplied by
      ``growth_factor``, capped at ``max_scale`` (never inf);
    * on an overflow it is multiplied by ``backoff_factor``, floored at
      ``min_scale``; with ``hysteresis = h`` only from the h-th overflow since
      the last growth on (``consecutive_hysteresis=True``: since the last
      clean step).

    With ``min_scale`` tiny, ``max_scale=inf`` and ``hysteresis=1`` the scale
    and the skipped steps follow torch.amp.GradScaler exactly. The rule is
    ``loss_scale/_rules/dynamic.py``'s ``DynamicRule``.

    Args:
      inner: the optimizer to wrap.
      initial_scale: the scale at step 0.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on overflow, in (0, 1).
      growth_interval: clean steps in a row before the scale grows, >= 1.
      min_scale: floor of the scale, > 0 (below 1 is allowed).
      max_scale: ceiling of the scale, may be ``inf``.
      hysteresis: overflows tolerated before backing off, >= 1.
      consecutive_hysteresis: refill the hysteresis on every clean step
        instead of only on growth.
      **options: the keyword options.

    Returns:
      A ``LossScaleTransformation`` (an ``optax.GradientTransformationExtraArgs``)
      whose state is a ``LossScaleState``.

    Raises:
      TypeError: a setting of the wrong type, or an ``inner`` that is not an
        optax transformation.
      ValueError: a setting out of range, or an ``inner`` that scales already.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=2.0**10)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> loss, grads = ls.value_and_grad(loss_fn)(state, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["w"]
      Array([0.8, 0.8, 0.8], dtype=float32)
    """
    initial = validate.scale("initial_scale", initial_scale)
    minimum = validate.scale("min_scale", min_scale)
    maximum = validate.scale("max_scale", max_scale, allow_inf=True)
    validate.scale_bounds(("initial_scale", initial), ("min_scale", minimum), ("max_scale", maximum))
    rule = DynamicRule(
        initial_scale=initial,
        growth_factor=validate.growth_factor("growth_factor", growth_factor),
        backoff_factor=validate.backoff_factor("backoff_factor", backoff_factor),
        growth_interval=validate.count("growth_interval", growth_interval),
        min_scale=minimum,
        max_scale=maximum,
        hysteresis=validate.count("hysteresis", hysteresis),
        consecutive_hysteresis=validate.flag("consecutive_hysteresis", consecutive_hysteresis),
    )
    return loss_scaled(inner, rule, settings_from("dynamic", options))
