"""Moving an existing optimizer state under a loss-scaling transformation:
a plain optax state (``wrap_opt_state``) or a state saved by an earlier
version of this library (``migrate_state``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from loss_scale._packed import PackedFields
from loss_scale._state import LossScaleState, PackedValues, StepRecord
from loss_scale._trees import first_difference

# The fields of 0.2.0's LossScaleState, in order: one flat NamedTuple, the
# statistics of the last step nested under ``stats``.
_FIELDS_0_2_0 = (
    "scale",
    "good_steps",
    "skipped",
    "skipped_steps",
    "consecutive_skips",
    "growths",
    "backoffs",
    "steps_at_min",
    "skip_reason",
    "nonfinite_losses",
    "counters",
    "stats",
    "inner_state",
)
_STATS_0_2_0 = ("grad_max", "grad_norm", "zero_fraction", "below_normal_fraction", "nonfinite_leaves")


def wrap_opt_state(
    tx: optax.GradientTransformation, inner_opt_state: optax.OptState, params: optax.Params
) -> LossScaleState:
    """A loss-scaled optimizer state that keeps an existing inner state.

    For resuming from a checkpoint saved with a plain optax optimizer: Adam's
    moments and step count (and the learning-rate schedule that reads it)
    carry on, while the scale and its counters start fresh.

    For changing the loss-scaling rule or its options when resuming (a
    checkpoint of ``ls.dynamic(adam)`` continued under
    ``ls.predictive(adam)``), pass the restored ``LossScaleState`` itself:
    its ``inner_state`` is kept bit for bit, and ``tx``'s rule starts as
    ``tx.init`` starts it (its scale, counters and record; the old rule's
    are dropped, since another rule's counters mean something else).
    Restore the checkpoint with the old transformation's ``init`` as the
    target first (a checkpointer cannot restore it into ``tx``'s layout).

    Args:
      tx: the loss-scaling transformation, e.g. ``ls.dynamic(optax.adam(lr))``
        wrapping the same optimizer that produced ``inner_opt_state``.
      inner_opt_state: the plain optimizer's state, or a ``LossScaleState``
        (of any rule and options) whose ``inner_state`` is kept.
      params: the parameters (only their structure and shapes are used).

    Returns:
      ``tx.init(params)`` with its ``inner_state`` replaced.

    Raises:
      ValueError: when ``inner_opt_state`` does not have the structure, shapes
        and dtypes of the state the wrapped optimizer makes (the message names
        the first leaf that differs, and both sides).

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> params = {"w": jnp.ones(3)}
      >>> old = optax.adam(1e-3).init(params)
      >>> state = ls.wrap_opt_state(ls.dynamic(optax.adam(1e-3)), old, params)
      >>> int(state.inner_state[0].count), float(state.scale)
      (0, 32768.0)
      >>> moved = ls.wrap_opt_state(ls.predictive(optax.adam(1e-3)), state, params)  # another rule
      >>> type(moved.counters).__name__, moved.inner_state is state.inner_state
      ('PredictiveCounters', True)
    """
    if isinstance(inner_opt_state, LossScaleState):
        inner_opt_state = inner_opt_state.inner_state
    fresh = _fresh(tx, params)
    difference = first_difference(inner_opt_state, fresh.inner_state)
    if difference is not None:
        raise ValueError(f"the inner state is not the one the wrapped optimizer makes, {difference}")
    return tx.init(params)._replace(inner_state=inner_opt_state)


def migrate_state(saved: Any, tx: optax.GradientTransformation, params: optax.Params) -> LossScaleState:
    """The state of ``tx`` that carries on from a state saved by loss_scale
    0.2.0, whose layout was one flat NamedTuple.

    Pass what the checkpoint holds: the 0.2.0 ``LossScaleState``'s fields by
    name (a mapping, as ``flax.serialization.to_state_dict`` writes it and a
    checkpointer restores it without a target; ``counters``, ``stats`` and
    ``inner_state`` nested alike, a tuple's entries under ``"0"``, ``"1"``...),
    or its 13 fields in order (a tuple or list). Every value is kept: the
    scale, the rule's counters, the counts, the statistics and the inner
    state, which is laid out as ``tx``'s own (``params`` gives its
    structure).

    A state already in this version's layout is returned as it is (a
    ``LossScaleState`` that ``tx`` made), or laid out as ``tx``'s (its
    fields by name, restored without a target). One that ``tx`` did not make
    (another rule, other options) is refused with the way to resume it
    under ``tx``: ``ls.wrap_opt_state(tx, old_state, params)`` keeps its
    inner state and starts ``tx``'s rule afresh.

    Args:
      saved: the 0.2.0 state, as restored.
      tx: the loss-scaling transformation, built as it was when the state was
        saved (the same rule, options and inner optimizer).
      params: the parameters (only their structure and shapes are used).

    Returns:
      A ``LossScaleState`` that ``tx.update`` continues from.

    Raises:
      ValueError: when ``saved`` misses a field ``tx``'s state has, or a leaf
        has another shape (the message names it), or is a state of this
        version that ``tx`` did not make.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(2)}
      >>> saved = {  # as 0.2.0 wrote it, e.g. restored by a checkpointer
      ...     "scale": 1024.0, "good_steps": 3, "skipped": False, "skipped_steps": 2,
      ...     "consecutive_skips": 0, "growths": 0, "backoffs": 5, "steps_at_min": 0,
      ...     "skip_reason": 0, "nonfinite_losses": 0,
      ...     "counters": {"overflows_left": 1, "first_growth_pending": False},
      ...     "stats": {"grad_max": 0.5}, "inner_state": {"0": {}, "1": {}},
      ... }
      >>> state = ls.migrate_state(saved, tx, params)
      >>> float(state.scale), int(state.skipped_steps), int(state.record.backoffs)
      (1024.0, 2, 5)
    """
    fresh = _fresh(tx, params)
    if isinstance(saved, LossScaleState):
        difference = state_difference(saved, fresh)
        if difference is not None:
            raise _already_current(f"but tx did not make it, {difference}")
        return saved
    if isinstance(saved, Mapping) and set(LossScaleState._fields) <= set(saved):
        try:
            data = _leaf(_child(saved["packed"], "data", ".packed.data"), fresh.packed.data, ".packed.data")
            state = LossScaleState(
                PackedFields(data, fresh.packed.layout), _like(saved["inner_state"], fresh.inner_state, ".inner_state")
            )
        except ValueError as error:
            raise _already_current(f"but not tx's: {error}") from None
        # Every saved leaf must have found its place: one left over is a
        # counter or statistic of a rule or option that tx does not have.
        kept = {_names(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
        for path, _ in jax.tree_util.tree_flatten_with_path({n: saved[n] for n in fresh._fields})[0]:
            if _names(path) not in kept:
                where = "".join(f"[{name}]" if name.isdigit() else f".{name}" for name in _names(path))
                raise _already_current(f"but not tx's: it holds {where}, which tx's state does not keep")
        return state
    fields = _fields_by_name(saved)
    missing = [name for name in _FIELDS_0_2_0 if name != "stats" and name not in fields]
    if missing:
        raise ValueError(
            f"the saved state misses {', '.join(missing)}: it is not a loss_scale 0.2.0 LossScaleState (its "
            f"fields are {', '.join(_FIELDS_0_2_0)})"
        )
    stats = _fields_by_name(fields.get("stats", {}))
    record_values = {name: fields[name] for name in StepRecord._fields if name in fields}
    record_values |= {name: stats[name] for name in _STATS_0_2_0 if name in stats}
    layout = fresh.packed.layout
    values = PackedValues(
        _leaf(fields["scale"], fresh.scale, ".scale"),
        _leaf(fields["good_steps"], fresh.good_steps, ".good_steps"),
        _like(fields["counters"], fresh.counters, ".counters"),
        _like(record_values, fresh.record, ".record"),
    )
    return LossScaleState(
        PackedFields(layout.pack(values), layout), _like(fields["inner_state"], fresh.inner_state, ".inner_state")
    )


def state_difference(have: LossScaleState, want: LossScaleState) -> str | None:
    """``first_difference`` of two loss-scale states, their packed values
    compared by name (``.record.grad_norm``) and then their inner states."""
    difference = first_difference(have.shapes(), want.shapes())
    if difference is None and have.packed.layout != want.packed.layout:
        difference = f"the packed layouts differ: {have.packed.layout} here, {want.packed.layout} expected"
    if difference is None:
        inner = first_difference(have.inner_state, want.inner_state)
        difference = None if inner is None else inner.replace("at ", "at .inner_state", 1)
    return difference


def _already_current(detail: str) -> ValueError:
    """The error for a state that is already in this version's layout but
    that ``tx`` did not make: say how to resume it under ``tx``."""
    return ValueError(
        f"the saved state is already in this version's layout ({', '.join(LossScaleState._fields)}), {detail}. "
        "migrate_state converts states saved by loss_scale 0.2.0; this one needs no conversion. To resume it "
        "under another rule or other options (a ls.dynamic state under ls.predictive), restore it with the old "
        "transformation's init as the target, then keep its inner state and start tx's rule: "
        "ls.wrap_opt_state(tx, restored_state, params). To resume it as it was, build tx as it was when the "
        "state was saved."
    )


def _names(path: tuple) -> tuple[str, ...]:
    """A tree path as the names of its steps (a field, a key, an index as a
    string), so that a NamedTuple's path and a restored mapping's compare."""
    return tuple(str(getattr(e, "name", getattr(e, "key", getattr(e, "idx", e)))) for e in path)


def _fresh(tx: optax.GradientTransformation, params: optax.Params) -> LossScaleState:
    fresh = jax.eval_shape(tx.init, params)
    if not isinstance(fresh, LossScaleState):
        raise ValueError(f"tx must be a loss-scaling transformation (its init returns {type(fresh).__name__})")
    return fresh


def _fields_by_name(node: Any) -> Mapping[str, Any]:
    """A saved NamedTuple as ``{field: value}``: a mapping as it is, a
    NamedTuple by its fields, a plain sequence of 0.2.0's state by position."""
    if isinstance(node, Mapping):
        return node
    if hasattr(node, "_asdict"):
        return node._asdict()
    if isinstance(node, Sequence) and len(node) == len(_FIELDS_0_2_0):
        return dict(zip(_FIELDS_0_2_0, node, strict=True))
    raise ValueError(
        f"expected the saved state as a mapping of its fields (or their sequence), got {type(node).__name__}"
    )


def _like(saved: Any, template: Any, where: str) -> Any:
    """``saved`` laid out as ``template`` (``ShapeDtypeStruct`` leaves and
    ``None``s): each template leaf is found in ``saved`` by its path's names
    (a NamedTuple's field, a dict's key, a sequence's index, or that index
    as a string key)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, want in paths:
        node = saved
        for entry in path:
            key = getattr(entry, "name", getattr(entry, "key", getattr(entry, "idx", None)))
            node = _child(node, key, where + jax.tree_util.keystr(path))
        leaves.append(_leaf(node, want, where + jax.tree_util.keystr(path)))
    return jax.tree.unflatten(treedef, leaves)


def _child(node: Any, key: Any, where: str) -> Any:
    if isinstance(node, Mapping):
        for candidate in (key, str(key)):
            if candidate in node:
                return node[candidate]
    elif isinstance(key, str) and hasattr(node, key):
        return getattr(node, key)
    elif isinstance(key, int) and isinstance(node, Sequence) and key < len(node):
        return node[key]
    raise ValueError(f"the saved state has nothing at {where}, which this transformation's state keeps")


def _leaf(value: Any, want: Any, where: str) -> jax.Array:
    """The saved leaf as an array of ``want``'s type. The inner optimizer's
    leaves must have their dtype already (a cast could lose values); the
    loss-scale state's own scalars are cast (a checkpointer may restore an
    int32 count as int64)."""
    if value is None:  # a statistic the saving transformation did not track
        raise ValueError(f"the saved state has nothing at {where}, which this transformation's state keeps")
    value = jnp.asarray(value)
    exact = where.startswith(".inner_state")
    if value.shape != want.shape or (exact and value.dtype != want.dtype):
        have, expected = f"{value.dtype}{list(value.shape)}", f"{want.dtype}{list(want.shape)}"
        raise ValueError(f"the saved state has {have} at {where}, {expected} expected")
    return value.astype(want.dtype)
