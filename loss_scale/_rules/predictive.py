"""Predictive loss scaling: aim the scale at the recent gradient peak
(``loss_scale.predictive``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from loss_scale._rules import FloorAtMinScale, RuleState, select
from loss_scale._saturating import increment


class PredictiveCounters(NamedTuple):
    """The predictive rule's counters.

    Attributes:
      headroom: int32, the learned margin H, in powers of two, between the
        recent gradient peak times the scale and the overflow threshold.
      grad_peak: float32, the recent peak of the largest unscaled gradient
        magnitude: a running maximum that halves every ``peak_half_life``
        steps unless a larger gradient renews it (0 before any measurement).
      searching: bool, the headroom search is on (until the first overflow
        after a measurement, H drops by one a clean step).
      overflow_run: int32, overflows in a row so far (each backs off faster).
      extra_headroom: int32, binades added to a measured headroom: one for
        every overflow (the first of a run) while ``measured``, one fewer
        after every ``headroom_interval`` clean steps in a row. It keeps a
        peak that the measurement misses (inside a ``scan`` or a
        ``custom_vjp``) from costing a skipped step after every measurement;
        0 without measured peaks.
      measured: bool, H was set from a measured backward peak
        (``backward_peak``, see ``loss_scale.value_grad_and_peak``).
    """

    headroom: jax.Array
    grad_peak: jax.Array
    searching: jax.Array
    overflow_run: jax.Array
    extra_headroom: jax.Array
    measured: jax.Array


def _floor_log2(x: jax.Array) -> jax.Array:
    """``floor(log2(x))`` as int32, exact for positive finite float32 (XLA's
    log2 is not exact at powers of two)."""
    return jnp.frexp(x)[1] - 1


def _ceil_log2(x: jax.Array) -> jax.Array:
    """``ceil(log2(x))`` as int32, exact for positive finite float32."""
    mantissa, exponent = jnp.frexp(x)
    return exponent - (mantissa == 0.5).astype(jnp.int32)


def _pow2(exponent: jax.Array) -> jax.Array:
    """``2**exponent`` in float32, exact (0 or inf outside float32's range)."""
    return jnp.ldexp(jnp.float32(1.0), exponent.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class PredictiveRule(FloorAtMinScale):
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

    Measured backward peaks (``backward_peak``, from
    ``loss_scale.value_grad_and_peak``): on a clean step with a measured
    peak B (finite, > 0, and a non-zero gradient), H is not learned by
    overflowing but set from the measurement: ::

        H = min_headroom + extra_headroom + max(0, ceil(log2(B / (grad_max * scale))))

    the last term being how many binades the backward pass's largest value
    exceeded the largest scaled parameter gradient by, rounded up: H is
    whole and ``target`` rounds down, so that until the next measurement,
    while the gradients stay within ``grad_peak`` and the amplification as
    measured, the backward pass's largest value keeps at least
    ``min_headroom + extra_headroom`` binades below the threshold (and less
    than two more right after the measurement). The scale moves to ``target`` at once, in either
    direction (it is measured, so there is no one-binade cap), the search
    ends and ``measured`` is set. Between measurements H is kept, not
    relaxed: after ``headroom_interval`` clean steps in a row
    ``extra_headroom`` drops by one instead, and the next step measures
    again. An overflow still raises H at once, and while ``measured`` adds
    one to ``extra_headroom``, which later measurements keep (a peak that
    the measurement does not see, inside a ``scan`` say, then costs a skip
    or two, not one after every measurement). A step without a measurement
    (``backward_peak`` ``None`` or 0, an overflowing step, a non-finite
    peak) is otherwise as without measurements.
    The first measurement is on the first step, at ``initial_scale``: start
    at a scale that cannot overflow (``initial_scale=1.0``) and the scale
    moves to the measured target after one step.

    ``good_steps`` counts the clean steps since H was last relaxed or raised
    by an overflow (toward the next relaxation; a measurement does not
    restart it, so that measuring every k steps keeps its period).
    Settings are validated by ``predictive``, which builds the rule.
    """

    initial_scale: float = 2.0**15
    initial_headroom: int = 12
    min_headroom: int = 1
    headroom_interval: int = 20000
    peak_half_life: float = 100.0
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    overflow_threshold: float = 65504.0

    def init(self) -> RuleState:
        return RuleState.start(
            self.initial_scale,
            PredictiveCounters(
                headroom=jnp.asarray(self.initial_headroom, jnp.int32),
                grad_peak=jnp.zeros((), jnp.float32),
                searching=jnp.ones((), jnp.bool_),
                overflow_run=jnp.zeros((), jnp.int32),
                extra_headroom=jnp.zeros((), jnp.int32),
                measured=jnp.zeros((), jnp.bool_),
            ),
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

    def adjust(
        self, state: RuleState, finite: jax.Array, grad_max: jax.Array, backward_peak: jax.Array | None = None
    ) -> RuleState:
        scale, good_steps, counters = state
        headroom, peak, searching, run_so_far, extra, measured = counters
        known = peak > 0  # a clean step with a non-zero gradient was seen

        # Clean step.
        grad_max = jnp.where(finite, grad_max, 0)
        new_peak = jnp.maximum(grad_max, peak * jnp.float32(2.0 ** (-1.0 / self.peak_half_life)))
        clean_steps = increment(good_steps)
        relax = (searching & known) | (clean_steps >= self.headroom_interval)
        # A measured H is not probed: its extra margin relaxes instead, and
        # the next step (good_steps 0) measures again.
        clean_headroom = jnp.where(relax & ~measured, jnp.maximum(headroom - 1, self.min_headroom), headroom)
        # The first measurement: no more headroom than this step had.
        had_now = self._room(grad_max * scale)
        first_headroom = jnp.maximum(jnp.minimum(clean_headroom, had_now), self.min_headroom)
        clean_headroom = jnp.where(known, clean_headroom, first_headroom)
        target = self.target(new_peak, clean_headroom)
        target = jnp.where(known, jnp.minimum(target, scale * 2), target)
        clean_extra = jnp.where(relax & measured, jnp.maximum(extra - 1, 0), extra).astype(jnp.int32)
        clean = RuleState(
            scale=self._clamp(jnp.where(new_peak > 0, target, scale), scale),
            good_steps=jnp.where(relax, 0, clean_steps).astype(jnp.int32),
            counters=PredictiveCounters(
                headroom=jnp.where(new_peak > 0, clean_headroom, headroom).astype(jnp.int32),
                grad_peak=new_peak,
                searching=searching,
                overflow_run=jnp.zeros((), jnp.int32),
                extra_headroom=clean_extra,
                measured=measured & ~relax,
            ),
        )
        if backward_peak is not None:
            clean = self._measured(clean, finite, grad_max, scale, jnp.asarray(backward_peak, jnp.float32))

        # Overflow.
        first = run_so_far == 0
        had = self._room(peak * scale)
        # The search leaves the scale at the edge: two binades, one to be
        # below it and one of margin. Later overflows add one.
        learned = jnp.where(first & known, jnp.maximum(headroom, had) + 1 + searching.astype(jnp.int32), headroom)
        # The n-th overflow in a row backs off by 2**-(2**(n-1)): 2, 4, 16, 256, ...
        run = increment(run_so_far)
        shrunk = scale * _pow2(-jnp.left_shift(1, jnp.minimum(run - 1, 7)))
        shrunk = jnp.where(first & known, jnp.minimum(shrunk, self.target(peak, learned)), shrunk)
        shrunk = jnp.where(known, shrunk, jnp.float32(self.min_scale))
        overflow = RuleState(
            scale=self._clamp(shrunk, jnp.float32(self.min_scale)),
            good_steps=jnp.zeros((), jnp.int32),
            counters=PredictiveCounters(
                headroom=learned.astype(jnp.int32),
                grad_peak=peak,
                searching=searching & ~known,
                overflow_run=run.astype(jnp.int32),
                extra_headroom=increment(extra, first & known & measured),
                measured=measured,
            ),
        )
        return select(finite, clean, overflow)

    def _measured(
        self, clean: RuleState, finite: jax.Array, grad_max: jax.Array, scale: jax.Array, backward_peak: jax.Array
    ) -> RuleState:
        """The clean step's state, with the headroom set from a measured
        backward peak where the step has one (see the class docstring)."""
        counters = clean.counters
        # How much larger than the largest scaled parameter gradient the
        # backward pass's largest value was, in binades rounded up: a whole H
        # that keeps min_headroom binades under any grad_peak until the next
        # measurement (the target's own rounding is down).
        amplification = backward_peak / (grad_max * scale)
        measured = finite & (backward_peak > 0) & jnp.isfinite(backward_peak) & (grad_max > 0)
        measured &= jnp.isfinite(amplification) & (amplification > 0)
        binades = jnp.maximum(_ceil_log2(jnp.where(measured, amplification, 1.0)), 0)
        headroom = jnp.clip(self.min_headroom + counters.extra_headroom + binades, -1000, 1000).astype(jnp.int32)
        at_measured = RuleState(
            scale=self._clamp(self.target(counters.grad_peak, headroom), clean.scale),
            good_steps=clean.good_steps,
            counters=counters._replace(
                headroom=headroom, searching=jnp.zeros((), jnp.bool_), measured=jnp.ones((), jnp.bool_)
            ),
        )
        return select(measured, at_measured, clean)
