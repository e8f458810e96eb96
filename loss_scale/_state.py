"""The loss-scale state and the rules that move the scale.

Every rule of the update that concerns the scale and its counters lives in
this module, as pure functions of arrays; configuration is validated once, at
construction, and kept out of the state (only arrays travel through ``jit``,
``tree_map`` and checkpoints, so no setting can be lost on the way).
"""

from __future__ import annotations

import dataclasses
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
        step (inf when it overflowed).
      headroom: int32, with ``loss_scale.predictive`` only (``None``
        otherwise): the margin, in powers of two, that the scale keeps between
        the recent peak of the scaled gradients and float16's largest value;
        learned from overflows.
      grad_peak: float32, with ``loss_scale.predictive`` only: the recent
        peak of ``grad_max``, a running maximum that halves every
        ``peak_half_life`` steps unless a larger gradient renews it.
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

    Attributes that the state does not have are looked up on ``inner_state``,
    so that code written for the wrapped optimizer's state keeps working
    through the wrapper: ``opt_state.hyperparams`` of an
    ``optax.inject_hyperparams`` optimizer (to read or set a learning rate),
    ``optax.contrib.schedule_free_eval_params(opt_state, params)``. Where the
    inner state does not have it either (an ``optax.chain`` state is a tuple),
    the error says how to reach it.
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
    headroom: jax.Array | None
    grad_peak: jax.Array | None
    grad_norm: jax.Array | None
    zero_fraction: jax.Array | None
    below_normal_fraction: jax.Array | None
    nonfinite_leaves: jax.Array | None
    inner_state: optax.OptState

    def __getattr__(self, name: str):
        # Only called when normal lookup fails. Private and special names are
        # never forwarded (copy, pickle and pytree machinery probe them).
        if name.startswith("_"):
            raise AttributeError(f"'LossScaleState' object has no attribute {name!r}")
        inner = self.inner_state
        try:
            return getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"'LossScaleState' object has no attribute {name!r}, nor has its inner_state (a "
                f"{type(inner).__name__}). Reach the wrapped optimizer's state with "
                f"loss_scale.find_state(opt_state).inner_state; set a hyperparameter anywhere in the state with "
                f"optax.tree_utils.tree_set(opt_state, {name}=...)."
            ) from None


class ScaleCounters(NamedTuple):
    """The part of the state that a scale rule reads and writes; the last two
    fields are the predictive rule's (``None`` for the others)."""

    scale: jax.Array
    good_steps: jax.Array
    overflow_budget: jax.Array
    headroom: jax.Array | None = None
    grad_peak: jax.Array | None = None


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

    def adjust(self, counters: ScaleCounters, finite: jax.Array, grad_max: jax.Array | None = None) -> ScaleCounters:
        del grad_max  # a reactive rule: only whether the step overflowed matters
        scale, good_steps, budget = counters.scale, counters.good_steps, counters.overflow_budget
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

    # A fixed scale has no floor to get stuck at.
    floor = 0.0

    def init(self) -> ScaleCounters:
        return ScaleCounters(
            scale=jnp.asarray(self.scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            overflow_budget=jnp.ones((), jnp.int32),
        )

    def adjust(self, counters: ScaleCounters, finite: jax.Array, grad_max: jax.Array | None = None) -> ScaleCounters:
        del grad_max
        good_steps = jnp.where(finite, counters.good_steps + 1, 0).astype(jnp.int32)
        return counters._replace(good_steps=good_steps)


def _floor_log2(x: jax.Array) -> jax.Array:
    """``floor(log2(x))`` as int32, exact for positive finite float32 (XLA's
    log2 is not exact at powers of two)."""
    return jnp.frexp(x)[1] - 1


def _pow2(exponent: jax.Array) -> jax.Array:
    """``2**exponent`` in float32, exact (0 or inf outside float32's range)."""
    return jnp.ldexp(jnp.float32(1.0), exponent.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class PredictiveRule:
    """Predictive loss scaling: aim the scale at the recent gradient peak.

    The rule reads ``grad_max``, the largest unscaled gradient magnitude of
    each step, which the finite check computes anyway. It keeps ``grad_peak``,
    a running maximum of it that halves every ``peak_half_life`` steps, and a
    learned ``headroom`` H (an integer, in powers of two), and sets the scale
    to the power of two at or below ::

        target = overflow_threshold / (grad_peak * 2**H)

    so that the largest scaled gradient seen lately sits H binades below
    float16's largest value. The float16 values that overflow are often not
    the parameter gradients but intermediate values of the backward pass
    (logits, activations), larger by a model-dependent factor; H learns that
    factor from overflows.

    * Clean step: ``grad_peak = max(grad_max, grad_peak * decay)``; the scale
      moves to ``target``: downwards at once (backing off *before* the next
      overflow when the gradients grow), upwards by at most a factor of 2 a
      step (so that an overflow while growing pins H to within one binade).
    * First measurement (the first clean step with a non-zero gradient): H
      becomes the headroom that step had, ``floor(log2(threshold /
      (grad_max * scale)))``, kept within [``min_headroom``,
      ``initial_headroom``]: the scale stays where it was verified, or jumps
      up to the target for ``initial_headroom``, or down to ``min_headroom``'s.
    * Headroom search: then, until the first overflow, H drops by one on
      every clean step (the scale climbs a binade a step) down to
      ``min_headroom``. After it, H drops by one after every
      ``headroom_interval`` clean steps in a row, probing for a smaller
      margin; each probe may cost one skipped step, so they are rare.
    * Overflow, the first of a run: H becomes one more than the headroom the
      scale had, ``max(H, floor(log2(threshold / (grad_peak * scale)))) +
      1``, and the scale moves to the new target (at least halving). The
      overflow that ends the search adds two: its climb left the scale within
      a binade of the edge, so one binade to get below it and one of margin.
      Before any measurement there is nothing to learn from: the scale
      drops to ``min_scale``, and the first measurement sets it.
    * Further overflows in a row (the gradients jumped, or the data is bad):
      H is left alone and the scale backs off faster each time, by 2, 4, 16,
      256, ... (15 binades in four skips, where halving needs 15); the climb
      back is a binade a step.

    ``good_steps`` counts clean steps since H last changed and, during a run
    of overflows, minus the number of overflows; ``overflow_budget`` is 1
    while the headroom search is on, 0 after it.
    """

    initial_scale: float = 2.0**15
    initial_headroom: int = 12
    min_headroom: int = 1
    headroom_interval: int = 20000
    peak_half_life: float = 100.0
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    overflow_threshold: float = 65504.0

    @property
    def floor(self) -> float:
        """The lowest scale the rule can reach."""
        return float(np.float32(self.min_scale))

    def init(self) -> ScaleCounters:
        return ScaleCounters(
            scale=jnp.asarray(self.initial_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            overflow_budget=jnp.ones((), jnp.int32),
            headroom=jnp.asarray(self.initial_headroom, jnp.int32),
            grad_peak=jnp.zeros((), jnp.float32),
        )

    def _room(self, magnitude: jax.Array) -> jax.Array:
        """``floor(log2(threshold / magnitude))``, int32; large for 0 or a
        subnormal magnitude."""
        room = jnp.float32(self.overflow_threshold) / magnitude
        return jnp.where(jnp.isfinite(room), _floor_log2(room), 1000)

    def _clamp(self, scale: jax.Array, fallback: jax.Array) -> jax.Array:
        scale = jnp.clip(scale, jnp.float32(self.min_scale), jnp.float32(self.max_scale))
        # A scale of inf would turn every loss into inf (max_scale may be inf).
        return jnp.where(jnp.isfinite(scale), scale, fallback)

    def target(self, peak: jax.Array, headroom: jax.Array) -> jax.Array:
        """The power of two at or below ``threshold / (peak * 2**headroom)``."""
        return _pow2(jnp.clip(self._room(peak) - headroom, -200, 200))

    def adjust(self, counters: ScaleCounters, finite: jax.Array, grad_max: jax.Array | None = None) -> ScaleCounters:
        if grad_max is None:
            raise ValueError("the predictive rule needs the step's grad_max")
        scale, good_steps, searching = counters.scale, counters.good_steps, counters.overflow_budget
        headroom, peak = counters.headroom, counters.grad_peak
        known = peak > 0  # a clean step with a non-zero gradient was seen

        # Clean step.
        grad_max = jnp.where(finite, grad_max, 0)
        new_peak = jnp.maximum(grad_max, peak * jnp.float32(2.0 ** (-1.0 / self.peak_half_life)))
        clean_steps = jnp.maximum(good_steps, 0) + 1
        relax = ((searching == 1) & known) | (clean_steps >= self.headroom_interval)
        clean_headroom = jnp.where(relax, jnp.maximum(headroom - 1, self.min_headroom), headroom)
        # The first measurement: no more headroom than this step had.
        had_now = self._room(grad_max * scale)
        first_headroom = jnp.maximum(jnp.minimum(clean_headroom, had_now), self.min_headroom)
        clean_headroom = jnp.where(known, clean_headroom, first_headroom)
        target = self.target(new_peak, clean_headroom)
        target = jnp.where(known, jnp.minimum(target, scale * 2), target)
        clean = ScaleCounters(
            scale=self._clamp(jnp.where(new_peak > 0, target, scale), scale),
            good_steps=jnp.where(relax, 0, clean_steps).astype(jnp.int32),
            overflow_budget=searching,
            headroom=jnp.where(new_peak > 0, clean_headroom, headroom).astype(jnp.int32),
            grad_peak=new_peak,
        )

        # Overflow.
        first = good_steps >= 0
        had = self._room(peak * scale)
        # The search leaves the scale at the edge: two binades, one to be
        # below it and one of margin. Later overflows add one.
        learned = jnp.where(first & known, jnp.maximum(headroom, had) + 1 + searching, headroom)
        # The n-th overflow in a row backs off by 2**-(2**(n-1)): 2, 4, 16, 256, ...
        run = jnp.where(first, 1, 1 - good_steps)
        shrunk = scale * _pow2(-jnp.left_shift(1, jnp.minimum(run - 1, 7)))
        shrunk = jnp.where(first & known, jnp.minimum(shrunk, self.target(peak, learned)), shrunk)
        shrunk = jnp.where(known, shrunk, jnp.float32(self.min_scale))
        overflow = ScaleCounters(
            scale=self._clamp(shrunk, jnp.float32(self.min_scale)),
            good_steps=jnp.where(first, -1, good_steps - 1).astype(jnp.int32),
            overflow_budget=jnp.where(known, 0, searching).astype(jnp.int32),
            headroom=learned.astype(jnp.int32),
            grad_peak=peak,
        )
        return jax.tree.map(lambda c, o: jnp.where(finite, c, o), clean, overflow)


Rule = DynamicRule | StaticRule | PredictiveRule


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
        headroom=counters.headroom,
        grad_peak=counters.grad_peak,
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
    counters = rule.adjust(
        ScaleCounters(state.scale, state.good_steps, state.overflow_budget, state.headroom, state.grad_peak),
        finite,
        stats.grad_max,
    )
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
        headroom=counters.headroom,
        grad_peak=counters.grad_peak,
        grad_norm=grad_norm,
        zero_fraction=None if stats.underflow is None else stats.underflow[0],
        below_normal_fraction=None if stats.underflow is None else stats.underflow[1],
        nonfinite_leaves=nonfinite_leaves,
        inner_state=inner_state,
    )
