"""Cerebras' dynamic loss scaling, with its overflow tolerance
(``loss_scale.presets.cerebras``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from loss_scale._rules import FloorAtMinScale, RuleState
from loss_scale._saturating import increment


class CerebrasCounters(NamedTuple):
    """The Cerebras rule's counters.

    Attributes:
      overflows: int32, the overflows (tolerated ones included) since the
        scale last changed.
    """

    overflows: jax.Array


@dataclasses.dataclass(frozen=True)
class CerebrasRule(FloorAtMinScale):
    """Cerebras ``GradScaler(loss_scale="dynamic")``: overflow tolerance.

    The rule of ``cerebras.pytorch.amp.GradScaler.update_scale``
    (cerebras_pytorch 2.10.0, ``cerebras/pytorch/amp/grad_scaler.py``), once
    per update, with ``n`` the steps and ``k`` the overflows since the scale
    last changed (both start at 0):

    1. ``n += 1``; ``k += 1`` if this step overflowed.
    2. If ``float32(k) / float32(n) > overflow_tolerance``: the scale halves
       and ``n = k = 0``.
    3. If ``n > steps_per_increase``: the scale doubles and ``n = k = 0``.
    4. The scale is clamped to ``[min_scale, max_scale]``.

    So the scale grows after ``steps_per_increase + 1`` steps without a
    decrease, which may include tolerated overflows; with the default
    tolerance 0 any overflow halves the scale and growth needs
    ``steps_per_increase + 1`` clean steps in a row. Every overflowing step is
    skipped, tolerated or not (the transformation skips on the finite check).

    ``good_steps`` holds the clean steps and ``CerebrasCounters.overflows``
    the (tolerated) overflows since the last change of the scale, so ``n =
    good_steps + overflows``. Settings are validated by
    ``presets.cerebras``, which builds the rule.

    A growth that would give inf keeps the scale (only possible with
    ``max_scale=inf``; Cerebras would store inf).
    """

    initial_scale: float = 2.0**15
    steps_per_increase: int = 2000
    min_scale: float = 2.0**-14
    max_scale: float = 2.0**15
    overflow_tolerance: float = 0.0

    def init(self) -> RuleState:
        return RuleState.start(
            self.initial_scale,
            CerebrasCounters(overflows=jnp.zeros((), jnp.int32)),
        )

    def adjust(
        self, state: RuleState, finite: jax.Array, grad_max: jax.Array, backward_peak: jax.Array | None = None
    ) -> RuleState:
        del grad_max, backward_peak  # a reactive rule
        scale, clean, (overflows,) = state
        clean = increment(clean, finite)
        overflows = increment(overflows, jnp.logical_not(finite))
        steps = clean + overflows

        # Decrease: the fraction of overflows since the last change, in float32.
        ratio = overflows.astype(jnp.float32) / steps.astype(jnp.float32)
        decrease = jnp.float32(self.overflow_tolerance) < ratio
        scale = jnp.where(decrease, scale * jnp.float32(0.5), scale)
        clean = jnp.where(decrease, 0, clean)
        overflows = jnp.where(decrease, 0, overflows)

        # Increase, after the decrease (which resets the step count).
        increase = clean + overflows > self.steps_per_increase
        grown = jnp.minimum(scale * jnp.float32(2.0), jnp.float32(self.max_scale))
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        scale = jnp.where(increase, grown, scale)
        clean = jnp.where(increase, 0, clean)
        overflows = jnp.where(increase, 0, overflows)

        scale = jnp.clip(scale, jnp.float32(self.min_scale), jnp.float32(self.max_scale))
        return RuleState(scale, clean.astype(jnp.int32), CerebrasCounters(overflows.astype(jnp.int32)))
