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

from loss_scale._rules import RuleState, select
from loss_scale._saturating import increment


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
        clean_steps = increment(good_steps)
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
