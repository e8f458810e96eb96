"""The loss-scale state, and how one step changes it.

Only arrays travel in the state (through ``jit``, ``tree_map`` and
checkpoints); every setting stays in the transformation's closure, so none
can be lost on the way. What the scale does on a step is the rule's
business (``loss_scale/_rules/``); this module records what happened.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from loss_scale._check import GradStats
from loss_scale._rules import Rule, RuleState, select


class StepStats(NamedTuple):
    """What the check saw on the most recent step.

    Attributes:
      grad_max: float32, the largest unscaled gradient magnitude (inf when a
        gradient was not finite).
      grad_norm: float32, the global norm of the unscaled gradients (inf on
        a step with a non-finite gradient), with ``track_grad_norm`` or
        ``max_grad_norm``; ``None`` otherwise.
      zero_fraction: float32, the fraction of gradient elements that were
        exactly 0, with ``track_underflow``; ``None`` otherwise.
      below_normal_fraction: float32, the fraction whose scaled magnitude was
        below float16's smallest normal (6.1e-5): in a float16 backward pass
        such values are subnormal or flushed, so a large fraction says the
        scale is too low. With ``track_underflow``; ``None`` otherwise.
      nonfinite_leaves: bool[n], which gradient leaves were non-finite on the
        most recent *skipped* step (under ``no_op`` without
        ``skip_nonfinite``, which skips none: on the most recent step with a
        non-finite gradient), with ``locate_overflows``; ``None`` otherwise.
        ``loss_scale.overflow_paths`` names them.

    Every statistic is measured on every step, ``no_op``'s unchecked ones
    included, and none is differentiable (their gradient is stopped).
    """

    grad_max: jax.Array
    grad_norm: jax.Array | None = None
    zero_fraction: jax.Array | None = None
    below_normal_fraction: jax.Array | None = None
    nonfinite_leaves: jax.Array | None = None


class LossScaleState(NamedTuple):
    """State of a loss-scaling transformation.

    A NamedTuple of arrays, so optax's tree utilities, ``jax.tree`` functions
    and checkpointers see its fields. ``scale``, ``good_steps``, ``skipped``,
    ``skipped_steps``, ``consecutive_skips`` and ``inner_state`` are stable;
    every counter, stable or not, is also in ``loss_scale.metrics``, whose
    keys are the stable view of the rest.

    Attributes:
      scale: float32, the current loss scale. The loss is multiplied by it
        before differentiation and the gradients are divided by it.
      good_steps: int32, the clean steps counted toward the rule's next
        growth (for ``dynamic``: since the last growth or overflow).
      skipped: bool, whether the most recent update was skipped.
      skipped_steps: int32, the number of skipped updates so far.
      consecutive_skips: int32, skipped updates since the last applied one.
      growths: int32, how many times the scale went up.
      backoffs: int32, how many times the scale went down.
      steps_at_min: int32, steps taken with the scale at its minimum (many of
        them, with skips, mean the gradients overflow at any scale).
      skip_reason: int32, why the most recent update was skipped: 0 it was
        applied, 1 the gradients overflowed, 2 the loss passed as
        ``tx.update(..., value=loss)`` was not finite (a forward failure).
      nonfinite_losses: int32, updates skipped for a non-finite loss so far
        (they count in ``skipped_steps`` too).
      counters: the rule's own counters, a NamedTuple
        (``DynamicCounters``, ``PredictiveCounters``, ...).
      stats: ``StepStats``, what the check saw on the most recent step.
      inner_state: the wrapped optimizer's state; unchanged on skipped steps.

    Attributes the state does not have are looked up, in order, in
    ``counters`` (``state.headroom`` of ``loss_scale.predictive``), in
    ``stats`` (``state.grad_max``) and in ``inner_state``, so that code
    written for the wrapped optimizer's state keeps working through the
    wrapper: ``opt_state.hyperparams`` of an ``optax.inject_hyperparams``
    optimizer (to read or set a learning rate),
    ``optax.contrib.schedule_free_eval_params(opt_state, params)``. Where the
    inner state does not have it either (an ``optax.chain`` state is a
    tuple), the error says how to reach it.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    growths: jax.Array
    backoffs: jax.Array
    steps_at_min: jax.Array
    skip_reason: jax.Array
    nonfinite_losses: jax.Array
    counters: Any
    stats: StepStats
    inner_state: optax.OptState

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Private and special names are
        # never forwarded (copy, pickle and pytree machinery probe them).
        if name.startswith("_"):
            raise AttributeError(f"'LossScaleState' object has no attribute {name!r}")
        for part in (self.counters, self.stats):
            if name in getattr(type(part), "_fields", ()):
                return getattr(part, name)
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


def init_state(
    rule: Rule,
    inner_state: optax.OptState,
    num_leaves: int | None = None,
    with_norm: bool = False,
    with_underflow: bool = False,
) -> LossScaleState:
    """A fresh state: the rule's initial scale and counters, no skipped steps.

    ``num_leaves`` sizes ``nonfinite_leaves`` (``None`` when overflows are not
    located); ``with_norm`` keeps a ``grad_norm``, ``with_underflow`` the
    underflow fractions."""
    start = rule.init()

    def zero(dtype=jnp.int32):
        # A new array per field: one array in two fields could not be donated.
        return jnp.zeros((), dtype)

    return LossScaleState(
        scale=start.scale,
        good_steps=start.good_steps,
        skipped=zero(jnp.bool_),
        skipped_steps=zero(),
        consecutive_skips=zero(),
        growths=zero(),
        backoffs=zero(),
        steps_at_min=zero(),
        skip_reason=zero(),
        nonfinite_losses=zero(),
        counters=start.counters,
        stats=StepStats(
            grad_max=zero(jnp.float32),
            grad_norm=zero(jnp.float32) if with_norm else None,
            zero_fraction=zero(jnp.float32) if with_underflow else None,
            below_normal_fraction=zero(jnp.float32) if with_underflow else None,
            nonfinite_leaves=None if num_leaves is None else jnp.zeros((num_leaves,), jnp.bool_),
        ),
        inner_state=inner_state,
    )


def next_state(
    rule: Rule,
    state: LossScaleState,
    stats: GradStats,
    finite: jax.Array,
    inner_state: optax.OptState,
    loss_finite: jax.Array | None = None,
    backoff_on_nonfinite_loss: bool = False,
    backward_peak: jax.Array | None = None,
) -> LossScaleState:
    """The state after one update: the rule moves the scale, the counters
    record what happened, the statistics of this step replace the last.

    ``loss_finite`` (``None`` when no loss was passed) tells a forward
    failure apart: the step is skipped, but a smaller scale cannot make a
    non-finite loss finite, so the rule does not see it unless
    ``backoff_on_nonfinite_loss``. ``backward_peak`` (``None`` when not
    passed) goes to the rule as it is. ``finite`` is what the step's
    skipping and the rule go by (``no_op`` without ``skip_nonfinite`` passes
    True: it applies every step); ``stats`` are recorded as measured.

    Nothing recorded here is differentiable: the statistics' gradients are
    stopped, so that differentiating through an update sees the scale and
    the counters as constants."""
    stats = jax.lax.stop_gradient(stats)
    before = RuleState(state.scale, state.good_steps, state.counters)
    if loss_finite is None:
        loss_finite = jnp.array(True)
    forward_failure = jnp.logical_not(loss_finite)
    if backoff_on_nonfinite_loss:
        moved = rule.adjust(before, jnp.logical_and(finite, loss_finite), stats.grad_max, backward_peak)
    else:
        moved = select(forward_failure, before, rule.adjust(before, finite, stats.grad_max, backward_peak))
    skipped = jnp.logical_not(jnp.logical_and(finite, loss_finite))
    skip_reason = jnp.where(forward_failure, 2, jnp.where(finite, 0, 1)).astype(jnp.int32)
    nonfinite_leaves = state.stats.nonfinite_leaves
    if nonfinite_leaves is not None:
        # Kept from the most recent skipped step (or, unchecked, the most
        # recent non-finite one), so a later clean step does not erase the
        # evidence.
        nonfinite = jnp.logical_not(stats.leaf_finite)
        nonfinite_leaves = jnp.where(skipped | jnp.any(nonfinite), nonfinite, nonfinite_leaves)
    underflow = stats.underflow
    return LossScaleState(
        scale=moved.scale,
        good_steps=moved.good_steps,
        skipped=skipped,
        skipped_steps=state.skipped_steps + skipped.astype(jnp.int32),
        consecutive_skips=jnp.where(skipped, state.consecutive_skips + 1, 0).astype(jnp.int32),
        growths=state.growths + (moved.scale > state.scale).astype(jnp.int32),
        backoffs=state.backoffs + (moved.scale < state.scale).astype(jnp.int32),
        steps_at_min=state.steps_at_min + (state.scale <= rule.floor).astype(jnp.int32),
        skip_reason=skip_reason,
        nonfinite_losses=state.nonfinite_losses + forward_failure.astype(jnp.int32),
        counters=moved.counters,
        stats=StepStats(
            grad_max=stats.grad_max,
            grad_norm=state.stats.grad_norm if stats.sq_norm is None else jnp.sqrt(stats.sq_norm),
            zero_fraction=None if underflow is None else underflow[0],
            below_normal_fraction=None if underflow is None else underflow[1],
            nonfinite_leaves=nonfinite_leaves,
        ),
        inner_state=inner_state,
    )
