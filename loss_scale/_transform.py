"""The loss-scaling transformation: check, then apply or skip, then adjust.

One update, in order:

1. check: one reduction per gradient leaf (``all(isfinite(g))`` and
   ``max|g|`` in one read, ``_check.gradient_stats``) decides whether every
   gradient is finite once divided by the scale;
2. one ``jax.lax.cond`` on that scalar: the taken branch unscales the
   gradients and runs the inner update (so XLA fuses the division into the
   inner optimizer's elementwise pass); the skip branch returns zero updates
   and the inner state exactly as it was;
3. the rule adjusts the scale and its counters (``_state.next_state``),
   given the backward pass's measured peak when the caller passes one as
   ``backward_peak=`` (``loss_scale.value_grad_and_peak``; it is not passed
   on to the inner optimizer).

``no_op`` without ``skip_nonfinite`` makes the same read for its statistics
and clipping, and applies the inner update with no branch. Differentiated
through (meta-learning, unrolled optimisation), a taken step is the inner
update of the unscaled (and clipped) gradients; the check and the statistics
are constants.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale._check import gradient_stats
from loss_scale._errors import raise_when_stuck, warn_about_float16_state
from loss_scale._options import Settings
from loss_scale._rules import Rule
from loss_scale._sharding import match_varying, zeros_like_shapes
from loss_scale._state import LossScaleState, StepStats, init_state, next_state
from loss_scale._types import PyTree
from loss_scale._unscale import unscale_tree


class LossScaleTransformation(optax.GradientTransformationExtraArgs):
    """The optax transformation that ``dynamic``, ``predictive``, ``static``,
    ``no_op`` and the presets return.

    An ``optax.GradientTransformationExtraArgs`` (a NamedTuple of ``init`` and
    ``update``, accepted wherever optax takes a transformation) with one more
    method, ``apply_gradients``: ``update`` and ``optax.apply_updates`` in
    one, with the addition to the params inside the taken branch.
    ``loss_scale.apply_gradients`` calls it.

    The fused step travels on the ``update`` function itself (as its
    ``FUSED_ATTRIBUTE``), not in a field of its own: the transformation stays
    a NamedTuple of exactly ``init`` and ``update``, so that ``copy``,
    ``deepcopy``, pickling (with cloudpickle, as for optax's own closures)
    and ``_replace`` behave as for any optax transformation, and an
    ``update`` replaced with ``_replace`` is never bypassed by the fused step
    of the one it replaced.
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


def as_transformation(inner: Any) -> optax.GradientTransformationExtraArgs:
    """Validates ``inner`` and returns it with extra-args support."""
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


def _skipped_inner_state(before: PyTree, after: PyTree) -> PyTree:
    """The inner state a skipped step returns: ``before``, typed as the inner
    update's result ``after`` (``ShapeDtypeStruct`` leaves) so that both
    branches of the ``lax.cond`` agree.

    An inner update may widen a state leaf: ``optax.adam`` initialises its
    moments in the params' dtype and promotes them when the gradients are
    wider (bfloat16 params, float32 gradients). The skipped step returns the
    old values in the wider dtype, which is exact. A change that would lose
    values (a narrowing, a shape or structure change, a typed PRNG key that
    changes implementation) raises a TypeError. A leaf whose type the update
    keeps (a typed key, ``float0``) is returned as it is.
    """
    paths_before, treedef_before = jax.tree_util.tree_flatten_with_path(before)
    leaves_after, treedef_after = jax.tree.flatten(after)
    if treedef_before != treedef_after:
        raise TypeError(
            "the inner optimizer's update changes the structure of its state "
            f"({treedef_before} -> {treedef_after}); a skipped step could not return it unchanged"
        )
    kept = []
    for (path, old), new in zip(paths_before, leaves_after, strict=True):
        # A Python number in the state (a custom optimizer's count, say) is
        # an array of its JAX type once traced, as in plain optax under jit.
        old = jnp.asarray(old)
        if old.shape != new.shape or not _widens_exactly(old.dtype, new.dtype):
            raise TypeError(
                f"the inner optimizer's update changes state leaf {jax.tree_util.keystr(path)} from "
                f"{old.dtype}{old.shape} to {new.dtype}{new.shape}; a skipped step could "
                "not return it unchanged in the new type. Initialise it with the dtype it will keep (for "
                "example, pass params of that dtype to init)"
            )
        if old.dtype != new.dtype:
            old = old.astype(new.dtype)
        kept.append(match_varying(old, new))
    return jax.tree.unflatten(treedef_after, kept)


def _widens_exactly(old: np.dtype, new: np.dtype) -> bool:
    """Whether every value of dtype ``old`` is a value of ``new``. JAX's
    extended dtypes (typed PRNG keys) are no numpy dtypes, which
    ``np.can_cast`` cannot interpret: they only ever match themselves."""
    if old == new:
        return True
    if jax.dtypes.issubdtype(old, jax.dtypes.extended) or jax.dtypes.issubdtype(new, jax.dtypes.extended):
        return False
    return bool(np.can_cast(old, new, casting="safe"))


def _check_layout(state: LossScaleState, expected: LossScaleState) -> None:
    """A clear error for a state made by a transformation with other settings
    (a checkpoint restored into a differently configured optimizer), instead
    of a failure deep inside the update."""
    restart = (
        "the state was made by a transformation built with other settings (a checkpoint restored into a "
        "differently configured optimizer?). Build the optimizer as it was when the state was saved, or start "
        "from tx.init(params) and carry over inner_state (ls.wrap_opt_state)."
    )
    have, want = type(state.counters), type(expected.counters)
    if have is not want or jax.tree.structure(state.counters) != jax.tree.structure(expected.counters):
        raise ValueError(
            f"the state keeps {have.__name__} but this transformation's rule keeps {want.__name__}: {restart}"
        )
    for field in StepStats._fields:
        have, want = getattr(state.stats, field), getattr(expected.stats, field)
        if (have is None) != (want is None):
            described = "absent" if have is None else "present"
            keeps = "keeps none" if want is None else "keeps one"
            raise ValueError(f"the state's field {field!r} is {described}, but this transformation {keeps}: {restart}")


def loss_scaled(inner: Any, rule: Rule, options: Settings) -> LossScaleTransformation:
    """The loss-scaling transformation around ``inner``, with ``rule`` moving
    the scale; ``dynamic``, ``predictive``, ``static``, ``no_op`` and every
    preset build theirs here."""
    inner = as_transformation(inner)

    # The state as init makes it, shapes only (one leaf stands in for the
    # gradients' leaf count, which _check_layout does not compare).
    layout = jax.eval_shape(
        lambda: init_state(
            rule, None, 1 if options.locate_overflows else None, options.with_norm, options.track_underflow
        )
    )

    def init_fn(params: optax.Params) -> LossScaleState:
        inner_state = inner.init(params)
        if any(isinstance(x, LossScaleState) for x in jax.tree.leaves(inner_state, is_leaf=_is_state)):
            raise ValueError(
                "the wrapped optimizer's state holds a LossScaleState: a loss-scaling transformation is nested "
                "inside another (e.g. in an optax.chain), so the gradients would be divided by both scales. "
                "Wrap the whole optimizer once."
            )
        warn_about_float16_state(inner_state)
        num_leaves = len(jax.tree.leaves(params)) if options.locate_overflows else None
        return init_state(
            rule, inner_state, num_leaves, with_norm=options.with_norm, with_underflow=options.track_underflow
        )

    def step(grads, state, params, extra_args, apply_to_params):
        """One update; returns (updates, state), or with ``apply_to_params``
        (new params, state) with ``apply_updates`` inside the taken branch."""
        if not isinstance(state, LossScaleState):
            raise TypeError(
                f"state must be the LossScaleState made by this transformation's init, got {type(state).__name__}"
            )
        scale = state.scale
        _check_layout(state, layout)
        # The backward peak is this transformation's, not the inner optimizer's.
        extra_args = dict(extra_args)
        backward_peak = _backward_peak(extra_args.pop("backward_peak", None), options.axis_name)
        num_leaves = len(jax.tree.leaves(grads))
        if options.locate_overflows and num_leaves != state.stats.nonfinite_leaves.shape[0]:
            raise ValueError(
                f"locate_overflows: the gradients have {num_leaves} leaves but init saw "
                f"{state.stats.nonfinite_leaves.shape[0]} (init with a tree of the gradients' structure)"
            )

        def inner_step(grads, inner_state, params):
            updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
            if apply_to_params:
                return optax.apply_updates(params, updates), inner_state
            return updates, inner_state

        # 1. Check: one read of every gradient (and the loss, when passed).
        # Without the check (no_op) the same read still gives the statistics,
        # and the step is applied whatever it found.
        stats = gradient_stats(grads, scale, options.with_norm, options.track_underflow, options.axis_name)
        finite = jnp.all(stats.leaf_finite)
        clip_factor = None
        if options.max_grad_norm is not None:
            # Part of the update's math (optax.clip_by_global_norm's), so it
            # is differentiated; the check above is not.
            norm = jnp.sqrt(stats.sq_norm)
            clip_factor = jnp.where(norm < options.max_grad_norm, 1.0, options.max_grad_norm / norm)

        def apply(grads, inner_state, params):
            # The unscale (and clip) sits inside the taken branch, where XLA
            # fuses it with the inner optimizer's elementwise pass.
            return inner_step(unscale_tree(grads, scale, clip_factor), inner_state, params)

        if not options.check_finite:
            out, inner_state = apply(grads, state.inner_state, params)
            applied = jnp.array(True)
            return out, next_state(rule, state, stats, applied, inner_state, backward_peak=backward_peak)

        loss_finite = _loss_finite(extra_args.get("value"), options.axis_name)
        go = finite if loss_finite is None else jnp.logical_and(finite, loss_finite)

        # Traced once: the jaxpr gives the skip branch its shapes and the taken
        # branch its computation (tracing the inner update twice doubles the
        # trace time of a many-leaf tree).
        traced, out_shapes = jax.make_jaxpr(apply, return_shape=True)(grads, state.inner_state, params)
        _skipped_inner_state(state.inner_state, out_shapes[1])  # raises here, outside the cond, if it must
        run_traced = jax.extend.core.jaxpr_as_fun(traced)
        out_treedef = jax.tree.structure(out_shapes)
        # The jaxpr's output types, whose shard_map axis types the skip branch
        # must match (older jax leaves them off the returned shapes).
        out_types = jax.tree.unflatten(out_treedef, traced.out_avals)

        def taken(grads, inner_state, params):
            return jax.tree.unflatten(out_treedef, run_traced(*jax.tree.leaves((grads, inner_state, params))))

        def skip(grads, inner_state, params):
            del grads
            inner_state = _skipped_inner_state(inner_state, out_types[1])
            if apply_to_params:
                # The params as they were: nothing is written, nothing is added.
                return jax.tree.map(match_varying, params, out_types[0]), inner_state
            return zeros_like_shapes(out_types[0]), inner_state

        # 2. Apply or skip, on one scalar.
        out, inner_state = jax.lax.cond(go, taken, skip, grads, state.inner_state, params)
        # 3. Adjust the scale and record the step.
        new_state = next_state(
            rule, state, stats, finite, inner_state, loss_finite, options.backoff_on_nonfinite_loss, backward_peak
        )
        if options.max_consecutive_skips is not None:
            raise_when_stuck(new_state, stats.leaf_finite, grads, options.max_consecutive_skips, rule.floor)
        return out, new_state

    def update_fn(
        updates: optax.Updates,
        state: LossScaleState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaleState]:
        return step(updates, state, params, extra_args, apply_to_params=False)

    def apply_gradients_fn(
        grads: optax.Updates, state: LossScaleState, params: optax.Params, **extra_args: Any
    ) -> tuple[optax.Params, LossScaleState]:
        return step(grads, state, params, extra_args, apply_to_params=True)

    setattr(update_fn, FUSED_ATTRIBUTE, apply_gradients_fn)
    return LossScaleTransformation(init_fn, update_fn)


def _loss_finite(value: Any, axis_name: Any) -> jax.Array | None:
    """Whether the loss passed as ``value=`` is finite (on every replica of
    ``axis_name``); ``None`` when no loss was passed."""
    if value is None:
        return None
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.inexact):
        return None
    finite = jnp.all(jnp.isfinite(value))
    if axis_name is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


def _backward_peak(peak: Any, axis_name: Any) -> jax.Array | None:
    """The ``backward_peak=`` extra argument as a float32 scalar (the
    largest over ``axis_name``, so that every replica moves its scale
    alike); ``None`` when not passed."""
    if peak is None:
        return None
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
