"""The loss-scale state and the rules that move the scale.

Every rule of the update that concerns the scale and its counters lives in
this module, as pure functions of arrays; configuration is validated once, at
construction, and kept out of the state (only arrays travel through ``jit``,
``tree_map`` and checkpoints, so no setting can be lost on the way).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale._tree import GradStats

FLOAT32_TINY = float(np.finfo(np.float32).tiny)


class LossScaleState(NamedTuple):
    """State of a loss-scaling transformation.

    A NamedTuple, so optax's tree utilities, ``jax.tree`` functions and
    checkpointers see its fields. All fields but ``nonfinite_leaves`` and
    ``inner_state`` are scalar arrays; ``loss_scale.metrics`` reads them as a dict.

    Attributes:
      scale: the current loss scale, float32. The loss is multiplied by it
        before differentiation and the gradients are divided by it.
      good_steps: int32, consecutive clean (finite) steps since the last
        growth, backoff or overflow. The scale grows when it reaches the
        growth interval. (Rules that delay the first growth after an
        overflow start it below 0.)
      overflow_budget: int32, how many more overflows are tolerated before the
        scale backs off (hysteresis). Refilled to ``hysteresis`` on growth (and
        on every clean step with ``consecutive_hysteresis=True``).
      skipped: bool, whether the most recent update was skipped.
      skipped_steps: int32, total number of skipped updates.
      consecutive_skips: int32, skipped updates since the last applied one.
      growths: int32, how many times the scale went up.
      backoffs: int32, how many times the scale went down.
      steps_at_min: int32, steps taken with the scale at ``min_scale``
        (many of them, with skips, mean the gradients overflow at any scale).
      grad_max: float32, the largest unscaled gradient magnitude of the last
        step (inf or nan when it overflowed).
      grad_norm: float32, the global norm of the last step's unscaled
        gradients, when tracked (``track_grad_norm`` or ``max_grad_norm``);
        ``None`` (an empty subtree) otherwise.
      zero_fraction: float32, the fraction of the last step's gradient
        elements that are exactly 0, with ``track_underflow=True``; ``None``
        otherwise.
      below_normal_fraction: float32, the fraction whose scaled magnitude is
        below float16's smallest normal (6.1e-5): in a float16 backward pass
        such values are subnormal or flushed, so a large fraction says the
        scale is too low. ``None`` unless ``track_underflow=True``.
      nonfinite_leaves: bool[n], which gradient leaves were non-finite on the
        most recent skipped step, when ``locate_overflows=True``; ``None``
        (an empty subtree) otherwise. ``loss_scale.overflow_paths`` names them.
      inner_state: the wrapped optimizer's state; unchanged on skipped steps.
    """

    scale: jax.Array
    good_steps: jax.Array
    overflow_budget: jax.Array
    skipped: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    growths: jax.Array
    backoffs: jax.Array
    steps_at_min: jax.Array
    grad_max: jax.Array
    grad_norm: jax.Array | None
    zero_fraction: jax.Array | None
    below_normal_fraction: jax.Array | None
    nonfinite_leaves: jax.Array | None
    inner_state: optax.OptState


class ScaleCounters(NamedTuple):
    """The part of the state that a scale rule reads and writes."""

    scale: jax.Array
    good_steps: jax.Array
    overflow_budget: jax.Array


def _check_positive_finite(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | jnp.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class DynamicRule:
    """Dynamic loss scaling: grow after clean runs, back off on overflow.

    The rule, applied once per update with ``finite`` the result of the check
    on the unscaled gradients:

    * clean step: ``good_steps += 1``; with ``consecutive_hysteresis`` the
      overflow budget is refilled. When ``good_steps`` reaches
      ``growth_interval`` the scale becomes ``min(scale * growth_factor,
      max_scale)`` (kept as it is if that is not finite), ``good_steps``
      returns to 0 and the overflow budget is refilled to ``hysteresis``.
    * overflow: ``good_steps = 0`` and the budget drops by one (not below 0).
      When it reaches 0 the scale becomes ``max(scale * backoff_factor,
      min_scale)``. The budget stays at 0, so every further overflow backs off
      until the next refill: with ``hysteresis = h`` the scale backs off on
      the h-th overflow since the last growth, and on each overflow after it.

    With ``hysteresis=1`` this is torch.amp.GradScaler's rule, with a floor
    and a ceiling. ``consecutive_hysteresis=False`` is Megatron-LM's and
    DeepSpeed's default; ``True`` is DeepSpeed's ``consecutive_hysteresis``.
    """

    initial_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    # Extra clean steps the first growth needs, at the start and after every
    # overflow (DeepSpeed since 0.17.1 needs one): good_steps restarts at
    # -growth_delay there, and at 0 after a growth.
    growth_delay: int = 0

    def __post_init__(self):
        initial = _check_positive_finite("initial_scale", self.initial_scale)
        minimum = _check_positive_finite("min_scale", self.min_scale)
        try:
            maximum = float(self.max_scale)
        except (TypeError, ValueError):
            raise TypeError(f"max_scale must be a real number, got {self.max_scale!r}") from None
        if math.isnan(maximum) or maximum <= 0:
            raise ValueError(f"max_scale must be > 0 (inf allowed), got {self.max_scale!r}")
        if minimum > maximum:
            raise ValueError(f"min_scale ({self.min_scale!r}) must be <= max_scale ({self.max_scale!r})")
        if not minimum <= initial <= maximum:
            raise ValueError(
                f"initial_scale must lie in [min_scale, max_scale] = "
                f"[{self.min_scale!r}, {self.max_scale!r}], got {self.initial_scale!r}"
            )
        growth = _check_positive_finite("growth_factor", self.growth_factor)
        if growth <= 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}")
        backoff = _check_positive_finite("backoff_factor", self.backoff_factor)
        if backoff >= 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        _check_int("growth_interval", self.growth_interval, 1)
        _check_int("hysteresis", self.hysteresis, 1)
        _check_int("growth_delay", self.growth_delay, 0)
        if not isinstance(self.consecutive_hysteresis, bool):
            raise TypeError(f"consecutive_hysteresis must be a bool, got {self.consecutive_hysteresis!r}")
        float32_max = float(np.finfo(np.float32).max)
        if initial > float32_max or minimum > float32_max:
            raise ValueError(
                f"initial_scale and min_scale must be at most float32's largest value ({float32_max:g}), "
                f"got {self.initial_scale!r} and {self.min_scale!r}"
            )
        if float(np.float32(initial)) < FLOAT32_TINY or float(np.float32(minimum)) < FLOAT32_TINY:
            raise ValueError(
                f"initial_scale and min_scale must be at least float32's smallest normal "
                f"({FLOAT32_TINY}), got {self.initial_scale!r} and {self.min_scale!r}"
            )

    @property
    def floor(self) -> float:
        """The lowest scale the rule can reach."""
        return float(np.float32(self.min_scale))

    def init(self) -> ScaleCounters:
        return ScaleCounters(
            scale=jnp.asarray(self.initial_scale, jnp.float32),
            good_steps=jnp.full((), -self.growth_delay, jnp.int32),
            overflow_budget=jnp.asarray(self.hysteresis, jnp.int32),
        )

    def adjust(self, counters: ScaleCounters, finite: jax.Array) -> ScaleCounters:
        scale, good_steps, budget = counters
        hysteresis = jnp.asarray(self.hysteresis, jnp.int32)

        # Clean step.
        clean_steps = good_steps + 1
        grow = clean_steps >= self.growth_interval
        grown = jnp.minimum(scale * jnp.float32(self.growth_factor), jnp.float32(self.max_scale))
        # A scale of inf would turn every loss into inf: refuse to grow there.
        grown = jnp.where(jnp.isfinite(grown), grown, scale)
        clean_budget = hysteresis if self.consecutive_hysteresis else jnp.where(grow, hysteresis, budget)
        clean = ScaleCounters(
            scale=jnp.where(grow, grown, scale),
            good_steps=jnp.where(grow, 0, clean_steps).astype(jnp.int32),
            overflow_budget=clean_budget,
        )

        # Overflow.
        overflow_budget = jnp.maximum(budget - 1, 0)
        shrunk = jnp.maximum(scale * jnp.float32(self.backoff_factor), jnp.float32(self.min_scale))
        overflow = ScaleCounters(
            scale=jnp.where(overflow_budget == 0, shrunk, scale),
            good_steps=jnp.full((), -self.growth_delay, jnp.int32),
            overflow_budget=overflow_budget,
        )
        return jax.tree.map(lambda c, o: jnp.where(finite, c, o), clean, overflow)


@dataclasses.dataclass(frozen=True)
class StaticRule:
    """A fixed scale. Counters still track clean steps for diagnostics."""

    scale: float = 1.0

    def __post_init__(self):
        _check_positive_finite("scale", self.scale)

    # A fixed scale has no floor to get stuck at.
    floor = 0.0

    def init(self) -> ScaleCounters:
        return ScaleCounters(
            scale=jnp.asarray(self.scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            overflow_budget=jnp.ones((), jnp.int32),
        )

    def adjust(self, counters: ScaleCounters, finite: jax.Array) -> ScaleCounters:
        good_steps = jnp.where(finite, counters.good_steps + 1, 0).astype(jnp.int32)
        return counters._replace(good_steps=good_steps)


Rule = DynamicRule | StaticRule


def init_state(
    rule: Rule,
    inner_state: optax.OptState,
    num_leaves: int | None = None,
    with_norm: bool = False,
    with_underflow: bool = False,
) -> LossScaleState:
    """A fresh state: the rule's initial counters and no skipped steps.

    ``num_leaves`` sizes ``nonfinite_leaves`` (``None`` when overflows are not
    located); ``with_norm`` keeps a ``grad_norm``, ``with_underflow`` the
    underflow fractions."""
    counters = rule.init()

    def zero():
        # A new array per field: one array in two fields could not be donated.
        return jnp.zeros((), jnp.int32)

    return LossScaleState(
        scale=counters.scale,
        good_steps=counters.good_steps,
        overflow_budget=counters.overflow_budget,
        skipped=jnp.zeros((), jnp.bool_),
        skipped_steps=zero(),
        consecutive_skips=zero(),
        growths=zero(),
        backoffs=zero(),
        steps_at_min=zero(),
        grad_max=jnp.zeros((), jnp.float32),
        grad_norm=jnp.zeros((), jnp.float32) if with_norm else None,
        zero_fraction=jnp.zeros((), jnp.float32) if with_underflow else None,
        below_normal_fraction=jnp.zeros((), jnp.float32) if with_underflow else None,
        nonfinite_leaves=None if num_leaves is None else jnp.zeros((num_leaves,), jnp.bool_),
        inner_state=inner_state,
    )


def next_state(
    rule: Rule,
    state: LossScaleState,
    stats: GradStats,
    finite: jax.Array,
    inner_state: optax.OptState,
) -> LossScaleState:
    """The state after one update: the rule moves the scale, the counters
    record what happened, the statistics of this step replace the last."""
    counters = rule.adjust(ScaleCounters(state.scale, state.good_steps, state.overflow_budget), finite)
    skipped = jnp.logical_not(finite)
    nonfinite_leaves = state.nonfinite_leaves
    if nonfinite_leaves is not None:
        # Kept from the most recent skipped step, so a later clean step does
        # not erase the evidence.
        nonfinite_leaves = jnp.where(skipped, jnp.logical_not(stats.leaf_finite), nonfinite_leaves)
    grad_norm = jnp.sqrt(stats.sq_norm) if stats.sq_norm is not None else state.grad_norm
    return LossScaleState(
        scale=counters.scale,
        good_steps=counters.good_steps,
        overflow_budget=counters.overflow_budget,
        skipped=skipped,
        skipped_steps=state.skipped_steps + skipped.astype(jnp.int32),
        consecutive_skips=jnp.where(skipped, state.consecutive_skips + 1, 0).astype(jnp.int32),
        growths=state.growths + (counters.scale > state.scale).astype(jnp.int32),
        backoffs=state.backoffs + (counters.scale < state.scale).astype(jnp.int32),
        steps_at_min=state.steps_at_min + (state.scale <= rule.floor).astype(jnp.int32),
        grad_max=stats.grad_max,
        grad_norm=grad_norm,
        zero_fraction=None if stats.underflow is None else stats.underflow[0],
        below_normal_fraction=None if stats.underflow is None else stats.underflow[1],
        nonfinite_leaves=nonfinite_leaves,
        inner_state=inner_state,
    )
