"""The loss-scale state: what the next step needs, apart from what is
recorded for the user.

Only arrays travel in the state (through ``jit``, ``tree_map`` and
checkpoints); every setting stays in the transformation's closure, so none
can be lost on the way. The update (``loss_scale/_update.py``) makes and
advances it; the rules (``loss_scale/_rules/``) decide the scale.

Where a new field goes: a rule's own counter in that rule's counters
NamedTuple; anything measured or counted for the user (a statistic, a tally)
in ``StepRecord``.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import jax
import optax


class SkipReason(enum.IntEnum):
    """Why the most recent update was skipped: the values of
    ``state.skip_reason`` (and of ``loss_scale.metrics``'
    ``loss_scale/skip_reason``).

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.array([8.0, jnp.inf]), state)
      >>> ls.SkipReason(int(state.skip_reason))
      <SkipReason.GRADIENT_OVERFLOW: 1>
    """

    #: the update was applied.
    APPLIED = 0
    #: a gradient was not finite once unscaled.
    GRADIENT_OVERFLOW = 1
    #: the loss passed as ``tx.update(..., value=loss)`` was not finite (a
    #: forward failure, which no loss scale can fix).
    NONFINITE_LOSS = 2


class StepRecord(NamedTuple):
    """What the update recorded for the user: tallies of what happened, and
    what the check saw on the most recent step. Nothing here moves the scale
    (the rule's counters do); every integer counter stops at int32's largest
    value rather than wrapping.

    Attributes:
      skipped: bool, whether the most recent update was skipped.
      skipped_steps: int32, skipped updates so far.
      consecutive_skips: int32, skipped updates since the last applied one.
      growths: int32, how many times the scale went up.
      backoffs: int32, how many times the scale went down.
      steps_at_min: int32, steps taken with the scale at its minimum (many of
        them, with skips, mean the gradients overflow at any scale).
      skip_reason: int32, a ``loss_scale.SkipReason``: why the most recent
        update was skipped (``APPLIED`` when it was not).
      nonfinite_losses: int32, updates skipped for a non-finite loss so far
        (they count in ``skipped_steps`` too).
      grad_max: float32, the largest unscaled gradient magnitude of the most
        recent step (inf when a gradient was not finite).
      grad_norm: float32, the global norm of the unscaled gradients (inf on a
        step with a non-finite gradient), with ``track_grad_norm`` or
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

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0, track_grad_norm=True)
      >>> state = tx.init(jnp.zeros(2))
      >>> _, state = tx.update(jnp.array([24.0, 32.0]), state)
      >>> record = state.record
      >>> bool(record.skipped), float(record.grad_max), float(record.grad_norm), record.zero_fraction
      (False, 4.0, 5.0, None)
    """

    skipped: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    growths: jax.Array
    backoffs: jax.Array
    steps_at_min: jax.Array
    skip_reason: jax.Array
    nonfinite_losses: jax.Array
    grad_max: jax.Array
    grad_norm: jax.Array | None = None
    zero_fraction: jax.Array | None = None
    below_normal_fraction: jax.Array | None = None
    nonfinite_leaves: jax.Array | None = None


class LossScaleState(NamedTuple):
    """State of a loss-scaling transformation.

    A NamedTuple of arrays, so optax's tree utilities
    (``optax.tree_utils.tree_get(opt_state, "skipped_steps")``), ``jax.tree``
    functions and checkpointers see its fields. Its first four fields are
    what the next step needs; ``record`` is what was recorded for the user.
    ``scale``, ``good_steps``, ``skipped``, ``skipped_steps``,
    ``consecutive_skips`` and ``inner_state`` are stable attributes; every
    counter, stable or not, is also in ``loss_scale.metrics``, whose keys are
    the stable view of the rest.

    Attributes:
      scale: float32, the current loss scale. The loss is multiplied by it
        before differentiation and the gradients are divided by it.
      good_steps: int32, the clean steps counted toward the rule's next
        growth (for ``dynamic``: since the last growth or overflow).
      counters: the rule's own counters, a NamedTuple
        (``DynamicCounters``, ``PredictiveCounters``, ...).
      record: a ``StepRecord``: skips, growths, backoffs and the statistics
        of the most recent step.
      inner_state: the wrapped optimizer's state; unchanged on skipped steps.

    Attributes the state does not have are looked up, in order, in
    ``record`` (``state.skip_reason``, ``state.grad_max``), in ``counters``
    (``state.headroom`` of ``loss_scale.predictive``) and in
    ``inner_state``, so that code written for the wrapped optimizer's state
    keeps working through the wrapper: ``opt_state.hyperparams`` of an
    ``optax.inject_hyperparams`` optimizer (to read or set a learning rate),
    ``optax.contrib.schedule_free_eval_params(opt_state, params)``. Where the
    inner state does not have it either (an ``optax.chain`` state is a
    tuple), the error says how to reach it.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> state = ls.dynamic(optax.sgd(0.1)).init(jnp.zeros(2))
      >>> float(state.scale), int(state.skipped_steps), state.counters._fields
      (32768.0, 0, ('overflows_left', 'first_growth_pending'))
    """

    scale: jax.Array
    good_steps: jax.Array
    counters: Any
    record: StepRecord
    inner_state: optax.OptState

    @property
    def skipped(self) -> jax.Array:
        """bool, whether the most recent update was skipped."""
        return self.record.skipped

    @property
    def skipped_steps(self) -> jax.Array:
        """int32, the number of skipped updates so far."""
        return self.record.skipped_steps

    @property
    def consecutive_skips(self) -> jax.Array:
        """int32, skipped updates since the last applied one."""
        return self.record.consecutive_skips

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Private and special names are
        # never forwarded (copy, pickle and pytree machinery probe them).
        if name.startswith("_"):
            raise AttributeError(f"'LossScaleState' object has no attribute {name!r}")
        for part in (self.record, self.counters):
            # A field, or a property (SegmentCounters.segment_exponents).
            if name in getattr(type(part), "_fields", ()) or isinstance(getattr(type(part), name, None), property):
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
