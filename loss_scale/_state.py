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
import jax.numpy as jnp
import optax

from loss_scale._packed import PackedFields
from loss_scale._trees import first_difference


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


class _Slots(NamedTuple):
    packed: PackedFields
    inner_state: optax.OptState


class PackedValues(NamedTuple):
    """The values ``LossScaleState.packed`` holds, by name."""

    scale: jax.Array
    good_steps: jax.Array
    counters: Any
    record: StepRecord


PACKED_FIELDS = PackedValues._fields


class LossScaleState(_Slots):
    """State of a loss-scaling transformation.

    A NamedTuple of two fields: ``packed``, the loss-scale state's own
    values (the scale, the good steps, the rule's counters and the step
    record) in one int32 array, and ``inner_state``, the wrapped optimizer's
    state. The packing makes the state's bookkeeping one buffer, which a
    GPU step updates in one kernel rather than one per field
    (``loss_scale/_packed.py``). The scale of a state made by a fixed-scale
    transformation (``static``, ``no_op``) is a constant of its layout:
    reading it reads no array, so a step that scales its loss by it reads
    nothing more than the bare step. Every value reads by name:

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
      packed: the ``PackedFields`` that hold ``scale``, ``good_steps``,
        ``counters`` and ``record``.

    ``scale``, ``good_steps``, ``skipped``, ``skipped_steps``,
    ``consecutive_skips`` and ``inner_state`` are stable attributes; every
    counter, stable or not, is also in ``loss_scale.metrics``, whose keys are
    the stable view of the rest. ``state._replace(good_steps=...)`` (or
    ``scale``, ``counters``, ``record``, ``inner_state``) returns a state
    with those values; ``LossScaleState.of(scale, good_steps, counters,
    record, inner_state)`` makes one. ``jax.tree`` functions and
    checkpointers see one leaf besides the inner state's: ``packed.data``.

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
      >>> int(state._replace(good_steps=7).good_steps)
      7
    """

    __slots__ = ()

    @classmethod
    def of(
        cls,
        scale: Any,
        good_steps: Any,
        counters: Any,
        record: StepRecord,
        inner_state: optax.OptState,
        fixed_scale: float | None = None,
    ) -> LossScaleState:
        """A state of these values, packed in their own layout;
        ``fixed_scale``: the scale that the state's transformation never
        moves (``scale`` must equal it), a constant of the layout."""
        values = PackedValues(scale, good_steps, counters, record)
        return cls(PackedFields.of(values, fixed_scale), inner_state)

    def fields(self) -> PackedValues:
        """``(scale, good_steps, counters, record)``, unpacked at once."""
        values = PackedValues(*self.packed.unpack())
        fixed = self.packed.layout.fixed_scale
        if fixed is not None and not isinstance(values.scale, jax.ShapeDtypeStruct):
            values = values._replace(scale=jnp.full(jnp.shape(values.scale), fixed, jnp.float32))
        return values

    def shapes(self) -> PackedValues:
        """``fields()``'s shapes and dtypes (``jax.ShapeDtypeStruct``s, with
        every static part such as the counters' types), read from the
        layout alone: no array is read."""
        data = self.packed.data
        return PackedValues(*self.packed.layout.unpack(jax.ShapeDtypeStruct(jnp.shape(data), jnp.int32)))

    @property
    def scale(self) -> jax.Array:
        """float32, the current loss scale (for a fixed-scale
        transformation's state, the constant of its layout)."""
        fixed = self.packed.layout.fixed_scale
        data = self.packed.data
        if fixed is not None and hasattr(data, "shape") and not isinstance(data, jax.ShapeDtypeStruct):
            return jnp.full(data.shape[:-1], fixed, jnp.float32)  # reads nothing
        return self.fields().scale

    @property
    def good_steps(self) -> jax.Array:
        """int32, the clean steps counted toward the rule's next growth."""
        return self.fields()[1]

    @property
    def counters(self) -> Any:
        """The rule's own counters, a NamedTuple."""
        return self.fields()[2]

    @property
    def record(self) -> StepRecord:
        """The ``StepRecord`` of the steps so far."""
        return self.fields()[3]

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

    def _replace(self, **changes: Any) -> LossScaleState:
        """A state with some values replaced: ``packed`` and
        ``inner_state``, or the packed values by name (``scale``,
        ``good_steps``, ``counters``, ``record``), which keep the state's
        layout (a value of another shape or structure is refused, and so is
        a scale of a fixed-scale transformation's state)."""
        named = {name: changes.pop(name) for name in PACKED_FIELDS if name in changes}
        unknown = set(changes) - set(self._fields)
        if unknown:
            raise ValueError(
                f"LossScaleState has no field {sorted(unknown)[0]!r}; its values are "
                f"{', '.join((*PackedValues._fields, 'inner_state'))}"
            )
        state = super()._replace(**changes)
        if named:
            layout = state.packed.layout
            if "scale" in named and layout.fixed_scale is not None:
                raise ValueError(
                    f"this state's scale is fixed at {layout.fixed_scale} by the transformation that made it "
                    "(ls.static, ls.no_op): build that transformation with the scale you want, or carry the inner "
                    "state over to another with ls.wrap_opt_state"
                )
            values = dict(zip(PACKED_FIELDS, state.packed.unpack(), strict=True)) | named
            fields = PackedValues(**values)
            if jax.tree.structure(fields) != layout.treedef:
                raise ValueError(
                    f"the values given for {', '.join(named)} do not have the state's structure: "
                    f"{jax.tree.structure(fields)} given, {layout.treedef} expected"
                )
            state = super(LossScaleState, state)._replace(packed=PackedFields(layout.pack(fields), layout))
        return state

    def __repr__(self) -> str:
        data = getattr(self.packed, "data", None)
        if not (hasattr(data, "shape") and hasattr(data, "dtype")) or isinstance(data, jax.ShapeDtypeStruct):
            return f"LossScaleState(packed={self.packed!r}, inner_state={self.inner_state!r})"
        values = ", ".join(f"{name}={value!r}" for name, value in zip(PackedValues._fields, self.fields(), strict=True))
        return f"LossScaleState({values}, inner_state={self.inner_state!r})"

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Private and special names are
        # never forwarded (copy, pickle and pytree machinery probe them).
        if name.startswith("_"):
            raise AttributeError(f"'LossScaleState' object has no attribute {name!r}")
        # Which part holds the name is static (the layout's shapes); only a
        # name found there unpacks the array, not one forwarded further.
        try:
            shapes = self.shapes()
        except (TypeError, ValueError):  # data without a shape: only the inner state's names
            shapes = (None,) * 4
        for index in (3, 2):  # the record, then the counters
            part = type(shapes[index])
            # A field, or a property (SegmentCounters.segment_exponents).
            if name in getattr(part, "_fields", ()) or isinstance(getattr(part, name, None), property):
                try:
                    return getattr(self.fields()[index], name)
                except TypeError:  # a tree of other values than arrays: only the inner state's names
                    break
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


def check_layout(state: Any, layout: LossScaleState, grads: Any) -> None:
    """A clear error for a state this transformation did not make (a
    checkpoint restored into a differently configured optimizer, a 0.2.0
    state), instead of a failure deep inside the update. The packed values
    are compared by name, as one structure; the inner state is not."""
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"state must be the LossScaleState made by this transformation's init, got {type(state).__name__}"
        )
    if not isinstance(state.packed, PackedFields):
        raise TypeError(
            f"state.packed must be the PackedFields made by this transformation's init, got "
            f"{type(state.packed).__name__}"
        )
    have, want = state.shapes(), layout.shapes()
    difference = first_difference(have, want, compare_types=False)
    fixed, fixed_here = state.packed.layout.fixed_scale, layout.packed.layout.fixed_scale
    if difference is None and fixed is not None and fixed != fixed_here:
        # A state whose scale is a constant of its layout (ls.static's,
        # ls.no_op's) reads that constant whatever a rule writes, so a rule
        # that moves the scale (or pins another) cannot take it over. The
        # other way round is sound: a state that keeps its scale as a word
        # reads what this rule writes there (a float16 checkpoint resumed
        # under for_dtype(bfloat16) reads its scale, then this rule's).
        here = "moves its scale" if fixed_here is None else f"fixes its scale at {fixed_here}"
        difference = (
            f"the transformation that made it fixes its scale at {fixed} and this one {here} (an ls.static or "
            "ls.no_op state keeps its scale as a constant)"
        )
    words = getattr(state.packed.data, "shape", (None,))[-1:]
    if difference is None and words != (state.packed.layout.size,):
        difference = f"at .packed.data: {words[0]} words here, {state.packed.layout.size} in its layout"
    if difference is not None:
        rules = ""
        if type(have[2]) is not type(want[2]):
            rules = f" (the state keeps {type(have[2]).__name__}, this rule {type(want[2]).__name__})"
        raise ValueError(
            f"the state does not have this transformation's layout{rules}, {difference}: it was made by a "
            "transformation built with other settings (a checkpoint restored into a differently configured "
            "optimizer?). Build the optimizer as it was when the state was saved, or start from tx.init(params) "
            "and carry over inner_state (ls.wrap_opt_state); a state saved by loss_scale 0.2.0 is converted by "
            "ls.migrate_state."
        )
    located = have[3].nonfinite_leaves
    if located is not None and len(jax.tree.leaves(grads)) != located.shape[-1]:
        raise ValueError(
            f"locate_overflows: the gradients have {len(jax.tree.leaves(grads))} leaves but init saw "
            f"{located.shape[-1]} (init with a tree of the gradients' structure)"
        )
