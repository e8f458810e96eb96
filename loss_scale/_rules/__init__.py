"""The rules that move the loss scale, one module each, behind one protocol.

A rule is a frozen dataclass of settings (validated by the function that
builds it, and kept out of the state so that ``jit`` and checkpoints cannot
lose them) with two pure functions of arrays:

* ``init()``: the scale and counters at step 0;
* ``adjust(state, finite, grad_max, backward_peak=None)``: the scale and
  counters after a step, given whether the step's unscaled gradients were
  all finite, their largest magnitude and, when the step measured it
  (``loss_scale.value_grad_and_peak``), the largest value of its backward
  pass. Only ``predictive`` reads ``backward_peak``; the others ignore it.

Each rule keeps its own counters in a NamedTuple with honest names
(``DynamicCounters``, ``PredictiveCounters``...). Every rule of the update
that concerns the scale is in the rule's module:

* ``dynamic.py``: grow after clean runs, back off on overflow, hysteresis
  (``loss_scale.dynamic``, and the presets of torch, Keras, DeepSpeed,
  Megatron, Apex, flax and jmp);
* ``static.py``: a fixed scale (``loss_scale.static``, ``loss_scale.no_op``);
* ``predictive.py``: aim the scale at the recent gradient peak, with a
  learned headroom (``loss_scale.predictive``);
* ``cerebras.py``: Cerebras' overflow tolerance (``presets.cerebras``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np


class RuleState(NamedTuple):
    """What a rule reads and writes on every step.

    Attributes:
      scale: float32, the loss scale.
      good_steps: int32, the clean steps counted toward the rule's next
        growth (never negative).
      counters: the rule's own NamedTuple of arrays.
    """

    scale: jax.Array
    good_steps: jax.Array
    counters: Any

    @classmethod
    def start(cls, initial_scale: float, counters: Any) -> RuleState:
        """Step 0: ``initial_scale`` in float32, no clean steps counted yet."""
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32), counters)


class FloorAtMinScale:
    """For a rule whose scale never goes below its ``min_scale`` setting."""

    min_scale: float

    @property
    def floor(self) -> float:
        return float(np.float32(self.min_scale))


class Rule(Protocol):
    """A scale rule (see the module docstring)."""

    @property
    def floor(self) -> float:
        """The lowest scale the rule can reach (0 where it cannot get stuck)."""
        ...

    def init(self) -> RuleState:
        """The scale and counters at step 0."""
        ...

    def adjust(
        self, state: RuleState, finite: jax.Array, grad_max: jax.Array, backward_peak: jax.Array | None = None
    ) -> RuleState:
        """The scale and counters after a step whose unscaled gradients were
        all finite (``finite``, a bool scalar) with largest magnitude
        ``grad_max`` (float32; inf on an overflow). ``backward_peak``
        (float32, ``None`` when not given): the largest magnitude of the
        step's scaled backward pass in the compute dtype, 0 on a step that
        did not measure it."""
        ...


def select(finite: jax.Array, clean: RuleState, overflow: RuleState) -> RuleState:
    """``clean`` where the step was finite, ``overflow`` where it was not,
    field by field (a select, so that ``vmap`` batches it)."""
    return jax.tree.map(lambda c, o: jax.numpy.where(finite, c, o), clean, overflow)
