"""The loss-scaling transformation: one update, read top to bottom.

``tx.update(grads, state, params)`` (and the fused ``apply_gradients``,
which adds the updates to the params before the skip keeps or drops them)
is ``step`` below: 1. check the gradients (one read of each) and the loss;
2. apply or skip: the unscaled gradients go through the inner update, whose
results are kept on a finite step; a skipped step returns zero updates (or
the params as they were) and the inner state as it was, either by selecting
where each value is produced or inside one ``lax.cond`` (``_skip.py``); 3.
adjust: the rule (``loss_scale/_rules/<rule>.py``) moves the scale, and the
step is recorded for the user (``StepRecord``).

``no_op`` without ``skip_nonfinite`` makes the same read for its statistics
and clipping, and applies the inner update with no branch. Differentiated
through (meta-learning, unrolled optimisation), a taken step is the inner
update of the unscaled (and clipped) gradients; the check, the statistics
and the scale are constants.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import optax

from loss_scale._check import gradient_stats
from loss_scale._errors import raise_when_stuck, warn_about_float16_state
from loss_scale._grid import round_to
from loss_scale._packed import PackedFields
from loss_scale._rules import Rule, RuleState, select
from loss_scale._rules.segmented import SegmentedRule, SegmentPeaks
from loss_scale._rules.static import fixed_scale_of
from loss_scale._saturating import increment
from loss_scale._settings import Settings
from loss_scale._sharding import match_varying, zeros_like_shapes
from loss_scale._skip import apply_or_skip, kept_inner_state
from loss_scale._state import LossScaleState, PackedValues, SkipReason, StepRecord, check_layout
from loss_scale._unscale import is_float_leaf, unscale_dtype, unscale_tree


class LossScaleTransformation(optax.GradientTransformationExtraArgs):
    """The optax transformation that ``dynamic``, ``predictive``, ``static``,
    ``no_op`` and the presets return.

    An ``optax.GradientTransformationExtraArgs`` (a NamedTuple of ``init`` and
    ``update``, accepted wherever optax takes a transformation) with one more
    method, ``apply_gradients``: ``update`` and ``optax.apply_updates`` in
    one, with the addition to the params before the skip keeps or drops it.
    ``loss_scale.apply_gradients`` calls it.

    The fused step travels on the ``update`` function (``FUSED_ATTRIBUTE``):
    the transformation stays a NamedTuple of exactly ``init`` and ``update``,
    so ``copy``, ``deepcopy``, cloudpickle and ``_replace`` behave as for any
    optax transformation, and an ``update`` replaced with ``_replace`` is
    never bypassed by the fused step of the one it replaced.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.static(optax.sgd(0.5), scale=4.0)
      >>> params = jnp.ones(2)
      >>> params, state = tx.apply_gradients(jnp.array([4.0, 8.0]), tx.init(params), params)
      >>> params
      Array([0.5, 0. ], dtype=float32)
    """

    def apply_gradients(
        self, grads: optax.Updates, state: optax.OptState, params: optax.Params, **extra_args: Any
    ) -> tuple[optax.Params, optax.OptState]:
        """``(new_params, new_state)``: ``update`` and ``optax.apply_updates``,
        fused when ``update`` is the one this library built (see
        ``loss_scale.apply_gradients``), one after the other otherwise."""
        fused = getattr(self.update, FUSED_ATTRIBUTE, None)
        if fused is not None:
            return fused(grads, state, params, **extra_args)
        updates, state = self.update(grads, state, params, **extra_args)
        return optax.apply_updates(params, updates), state


# The attribute of a loss-scaling ``update`` function that holds its fused step.
FUSED_ATTRIBUTE = "loss_scale_apply_gradients"


def loss_scaled(inner: Any, rule: Rule, settings: Settings) -> LossScaleTransformation:
    """The loss-scaling transformation around ``inner``, with ``rule`` moving
    the scale; ``dynamic``, ``predictive``, ``static``, ``no_op`` and every
    preset build theirs here."""
    inner = _as_transformation(inner)
    # The state as init makes it, shapes only: what every state passed to
    # update must look like (a gradient leaf count of 1 stands in for the
    # real one, which check_layout does not compare).
    layout = jax.eval_shape(lambda: _initial_state(rule, None, settings, num_leaves=1))

    def init_fn(params: optax.Params) -> LossScaleState:
        inner_state = inner.init(params)
        if any(isinstance(x, LossScaleState) for x in jax.tree.leaves(inner_state, is_leaf=_is_state)):
            raise ValueError(
                "the wrapped optimizer's state holds a LossScaleState: a loss-scaling transformation is nested "
                "inside another (e.g. in an optax.chain), so the gradients would be divided by both scales. "
                "Wrap the whole optimizer once."
            )
        warn_about_float16_state(inner_state)
        return _initial_state(rule, inner_state, settings, num_leaves=len(jax.tree.leaves(params)))

    def step(grads, state, params, extra_args, apply_to_params):
        """One update; returns (updates, state), or with ``apply_to_params``
        (new params, state) with ``apply_updates`` before the skip."""
        check_layout(state, layout, grads)
        # The loss and the backward peak are this transformation's extra
        # arguments; the inner optimizer gets the loss too (as optax's
        # reduce_on_plateau takes value=), never the peak.
        extra_args = dict(extra_args)
        backward_peak = _backward_peak(extra_args.pop("backward_peak", None), settings.axis_name)
        if isinstance(backward_peak, SegmentPeaks) and not isinstance(rule, SegmentedRule):
            raise TypeError(
                "backward_peak holds the peaks of an optimizer with segments (loss_scale.predictive(..., "
                "segments=...)), and this optimizer has none: measure with this optimizer's state"
            )
        loss = extra_args.get("value")
        if not settings.reads_gradients:
            # Nothing to check or record: the unscaled inner update, and the
            # rule's counters and the record as they were.
            out, inner_state = _unchecked(inner, grads, state, params, extra_args, apply_to_params)
            return out, state._replace(inner_state=inner_state)

        # The state's own values, read from its one packed array (written
        # back as one below).
        scale, good_steps, counters, old = state.fields()

        # 1. Check: one read of every gradient, and of the loss when passed.
        # (An unchecked update that records a statistic makes the same read.)
        # Flags per leaf only where they are recorded or reported.
        per_leaf = settings.locate_overflows or settings.max_consecutive_skips is not None
        stats = gradient_stats(
            grads, scale, settings.with_norm, settings.track_underflow, settings.axis_name, per_leaf=per_leaf
        )
        grads_finite = stats.finite
        loss_finite = _loss_finite(loss, settings.axis_name) if settings.check_finite else jnp.array(True)
        clip_factor = None
        if settings.max_grad_norm is not None:
            # Part of the update's math (optax.clip_by_global_norm's), so it
            # is differentiated; the check itself is not.
            norm = jnp.sqrt(stats.sq_norm)
            clip_factor = jnp.where(norm < settings.max_grad_norm, 1.0, settings.max_grad_norm / norm)

        def apply(grads, inner_state, params):
            # The unscale (and clip) is part of the applied computation, where
            # XLA fuses it with the inner optimizer's elementwise pass.
            unscaled = unscale_tree(grads, scale, clip_factor)
            updates, inner_state = inner.update(unscaled, inner_state, params, **extra_args)
            if apply_to_params:
                return optax.apply_updates(params, updates), inner_state
            return updates, inner_state

        # 2. Apply or skip.
        if settings.check_finite:
            applied = grads_finite & loss_finite
            out, inner_state = _apply_or_skip(applied, apply, grads, state.inner_state, params, apply_to_params)
        else:
            applied = jnp.array(True)
            out, inner_state = apply(grads, state.inner_state, params)

        # 3. Adjust the scale: the rule sees whether the gradients overflowed.
        # A non-finite loss is a forward failure, which no smaller scale can
        # fix: the rule does not see that step unless backoff_on_nonfinite_loss.
        stats = jax.lax.stop_gradient(stats)  # the record and the rule's inputs are constants
        rule_finite = grads_finite if settings.check_finite else jnp.array(True)
        before = RuleState(scale, good_steps, counters)
        if settings.backoff_on_nonfinite_loss:
            moved = rule.adjust(before, rule_finite & loss_finite, stats.grad_max, backward_peak)
        else:
            moved = select(loss_finite, rule.adjust(before, rule_finite, stats.grad_max, backward_peak), before)

        # ...and record the step for the user.
        skipped = ~applied
        forward_failure = ~loss_finite
        reason = jnp.where(forward_failure, int(SkipReason.NONFINITE_LOSS), int(SkipReason.GRADIENT_OVERFLOW))
        nonfinite_leaves = old.nonfinite_leaves
        if nonfinite_leaves is not None:
            # Kept from the most recent skipped step (unchecked: the most
            # recent non-finite one), so a later clean step keeps the evidence.
            nonfinite = ~stats.leaf_finite
            nonfinite_leaves = jnp.where(skipped | jnp.any(nonfinite), nonfinite, nonfinite_leaves)
        record = StepRecord(
            skipped=skipped,
            skipped_steps=increment(old.skipped_steps, skipped),
            consecutive_skips=jnp.where(skipped, increment(old.consecutive_skips), 0).astype(jnp.int32),
            growths=increment(old.growths, moved.scale > scale),
            backoffs=increment(old.backoffs, moved.scale < scale),
            steps_at_min=increment(old.steps_at_min, scale <= rule.floor),
            skip_reason=jnp.where(skipped, reason, int(SkipReason.APPLIED)).astype(jnp.int32),
            nonfinite_losses=increment(old.nonfinite_losses, forward_failure),
            grad_max=stats.grad_max,
            grad_norm=old.grad_norm if stats.sq_norm is None else jnp.sqrt(stats.sq_norm),
            zero_fraction=None if stats.underflow is None else stats.underflow[0],
            below_normal_fraction=None if stats.underflow is None else stats.underflow[1],
            nonfinite_leaves=nonfinite_leaves,
        )
        packed = state.packed.layout.pack(PackedValues(moved.scale, moved.good_steps, moved.counters, record))
        new_state = LossScaleState(PackedFields(packed, state.packed.layout), inner_state)
        if settings.max_consecutive_skips is not None:
            raise_when_stuck(new_state, stats.leaf_finite, grads, settings.max_consecutive_skips, rule.floor)
        return out, new_state

    def update_fn(
        updates: optax.Updates,
        state: LossScaleState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaleState]:
        _refuse_unscaled(updates)
        out, state = step(updates, state, params, extra_args, apply_to_params=False)
        _mark_unscaled(out, updates)
        return out, state

    def apply_gradients_fn(
        grads: optax.Updates, state: LossScaleState, params: optax.Params, **extra_args: Any
    ) -> tuple[optax.Params, LossScaleState]:
        _refuse_unscaled(grads)
        return step(grads, state, params, extra_args, apply_to_params=True)

    setattr(update_fn, FUSED_ATTRIBUTE, apply_gradients_fn)
    return LossScaleTransformation(init_fn, update_fn)


def _unchecked(inner, grads, state, params, extra_args, apply_to_params):
    """The inner update of the gradients divided by the state's scale: 1,
    unless a state of a scaled run was restored into an unscaled one (a
    power of two, then, by which the division is exact), in the inner
    update's own pass on the CPU and on a GPU (see the comment below)."""

    state_scale = state.scale

    def unscale(g):
        if not is_float_leaf(g):
            return g
        wide = g.astype(unscale_dtype(g.dtype))
        scale = state_scale.astype(wide.dtype)
        # XLA:CPU fuses a multiplication into the optimizer's pass but
        # materializes a division; XLA:GPU duplicates the division into each
        # kernel but gives a reciprocal shared by many leaves a kernel of
        # its own.
        unscaled = jax.lax.platform_dependent(wide, scale, cpu=lambda x, s: x * (1 / s), default=lambda x, s: x / s)
        return round_to(unscaled, g.dtype)

    updates, inner_state = inner.update(jax.tree.map(unscale, grads), state.inner_state, params, **extra_args)
    if apply_to_params:
        return optax.apply_updates(params, updates), inner_state
    return updates, inner_state


def _apply_or_skip(go, apply, grads, inner_state, params, apply_to_params):
    """``apply(grads, inner_state, params)`` where ``go``, else zero updates
    (or, fused, the params as they were) and ``inner_state`` unchanged: one
    ``lax.cond``, or a form that equals it (``_skip.py``: the branch chosen
    in Python for an eager step, no branch where the inner update allows
    it).

    ``apply`` is traced once, by ``make_jaxpr``: its jaxpr is the taken
    branch, and its output types give the skip branch its shapes (tracing
    the inner update a second time, as ``eval_shape`` would, doubles the
    trace time of a many-leaf tree). The skip branch matches those types
    exactly, ``shard_map`` axis types included, so both branches agree."""
    traced, out_shapes = jax.make_jaxpr(apply, return_shape=True)(grads, inner_state, params)
    kept_inner_state(inner_state, out_shapes[1])  # raises here, outside the cond, if it must
    out_treedef = jax.tree.structure(out_shapes)
    # The jaxpr's output types, whose shard_map axis types the skip branch
    # must match (older jax leaves them off the returned shapes).
    out_types = jax.tree.unflatten(out_treedef, traced.out_avals)
    leaves, in_treedef = jax.tree.flatten((grads, inner_state, params))

    def kept(leaves):
        _, inner_state, params = jax.tree.unflatten(in_treedef, leaves)
        inner_state = kept_inner_state(inner_state, out_types[1])
        if apply_to_params:
            # The params as they were: nothing is written, nothing is added.
            return jax.tree.leaves((jax.tree.map(match_varying, params, out_types[0]), inner_state))
        return jax.tree.leaves((zeros_like_shapes(out_types[0]), inner_state))

    def taken(leaves):
        return jax.tree.leaves(apply(*jax.tree.unflatten(in_treedef, leaves)))

    outputs = apply_or_skip(go, traced, taken, kept, len(jax.tree.leaves(grads)), leaves)
    return jax.tree.unflatten(out_treedef, outputs)


# The floating update arrays (or tracers) that a loss-scaling update has
# returned and that are still alive, by id: gradients that arrive at another
# loss-scaling update as one of these were divided by a scale already (two
# loss-scaling transformations chained in one optimizer, which neither
# state can show).
_UNSCALED: dict[int, weakref.ref] = {}


def _mark_unscaled(updates: optax.Updates, grads: optax.Updates) -> None:
    inputs = {id(g) for g in jax.tree.leaves(grads)}
    for leaf in jax.tree.leaves(updates):
        if id(leaf) in inputs or not is_float_leaf(leaf):
            continue  # a gradient leaf passed through (it is the caller's own), or nothing to scale
        key = id(leaf)
        try:
            _UNSCALED[key] = weakref.ref(leaf, lambda _, key=key: _UNSCALED.pop(key, None))
        except TypeError:  # a leaf that cannot be referenced weakly: nothing to recognise it by
            continue


def _refuse_unscaled(grads: optax.Updates) -> None:
    for leaf in jax.tree.leaves(grads):
        ref = _UNSCALED.get(id(leaf))
        if ref is not None and ref() is leaf:
            raise ValueError(
                "the gradients passed to this loss-scaling update are the output of another loss-scaling "
                "update, already divided by its scale: the optimizer chains two loss-scaling transformations "
                "(e.g. optax.chain(ls.dynamic(optax.clip(1.0)), ls.dynamic(optax.adam(1e-3)))), and each would "
                "divide the gradients by its own scale while the loss is multiplied by one. Wrap the whole "
                "optimizer once: ls.dynamic(optax.chain(optax.clip(1.0), optax.adam(1e-3)))"
            )


def _initial_state(rule: Rule, inner_state: optax.OptState, settings: Settings, num_leaves: int) -> LossScaleState:
    """A fresh state: the rule's initial scale and counters, nothing
    recorded yet; the optional statistics are present only where the
    settings record them (``nonfinite_leaves`` with one flag per gradient
    leaf)."""
    start = rule.init()

    def zero(dtype=jnp.int32):
        # A new array per field: one array in two fields could not be donated.
        return jnp.zeros((), dtype)

    record = StepRecord(
        skipped=zero(jnp.bool_),
        skipped_steps=zero(),
        consecutive_skips=zero(),
        growths=zero(),
        backoffs=zero(),
        steps_at_min=zero(),
        skip_reason=zero(),
        nonfinite_losses=zero(),
        grad_max=zero(jnp.float32),
        grad_norm=zero(jnp.float32) if settings.with_norm else None,
        zero_fraction=zero(jnp.float32) if settings.track_underflow else None,
        below_normal_fraction=zero(jnp.float32) if settings.track_underflow else None,
        nonfinite_leaves=jnp.zeros((num_leaves,), jnp.bool_) if settings.locate_overflows else None,
    )
    return LossScaleState.of(
        start.scale, start.good_steps, start.counters, record, inner_state, fixed_scale=fixed_scale_of(rule)
    )


def _as_transformation(inner: Any) -> optax.GradientTransformationExtraArgs:
    """``inner``, validated, with extra-args support."""
    if isinstance(inner, LossScaleTransformation):
        raise ValueError(
            "inner is already a loss-scaling transformation: nested, the outer scale would multiply the loss "
            "while both divide the gradients. Wrap the optimizer once, e.g. ls.dynamic(optax.adam(1e-3))."
        )
    if isinstance(inner, optax.GradientTransformation):
        return optax.with_extra_args_support(inner)
    init, update = getattr(inner, "init", None), getattr(inner, "update", None)
    if callable(init) and callable(update):
        # Duck-typed transformations such as optax.MultiSteps.
        return optax.GradientTransformationExtraArgs(init, update)
    hint = ""
    if callable(inner):
        hint = " (did you pass an optimizer factory without calling it, e.g. optax.adam instead of optax.adam(1e-3)?)"
    raise TypeError(
        f"inner must be an optax.GradientTransformation, got {inner!r} of type {type(inner).__name__}{hint}"
    )


def _loss_finite(value: Any, axis_name: Any) -> jax.Array:
    """Whether the loss passed as ``value=`` is finite (on every replica of
    ``axis_name``); True when no floating loss was passed."""
    if value is None:
        return jnp.array(True)
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.inexact):
        return jnp.array(True)
    finite = jnp.all(jnp.isfinite(value))
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def _backward_peak(peak: Any, axis_name: Any) -> jax.Array | SegmentPeaks | None:
    """The ``backward_peak=`` extra argument as a float32 scalar (the
    largest over ``axis_name``, so that every replica moves its scale
    alike), or the ``SegmentPeaks`` of an optimizer with segments (their
    peaks the largest, their counts summed over ``axis_name``); ``None``
    when not passed."""
    if peak is None:
        return None
    if isinstance(peak, SegmentPeaks):
        if axis_name is not None:
            peak = SegmentPeaks(
                peak.keys,
                peak.names,
                jax.lax.pmax(peak.peak, axis_name),
                *(jax.lax.psum(x, axis_name) for x in (peak.zeros, peak.below_normal, peak.count)),
            )
        return peak
    peak = jnp.asarray(peak)
    if peak.shape != () or not jnp.issubdtype(peak.dtype, jnp.floating):
        raise TypeError(
            f"backward_peak must be a floating scalar (the third output of ls.value_grad_and_peak), got "
            f"{peak.dtype}{list(peak.shape)}"
        )
    peak = peak.astype(jnp.float32)
    if axis_name is not None:
        peak = jax.lax.pmax(peak, axis_name)
    return peak


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)
