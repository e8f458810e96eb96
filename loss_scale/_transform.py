"""The loss-scaling optax transformations: ``dynamic``, ``predictive``,
``static``, ``no_op``.

One update, in order:

1. check: one reduction per gradient leaf (``all(isfinite(g))`` and
   ``max|g|`` in one read) decides whether every gradient is finite once
   divided by the scale (``_tree.gradient_stats``);
2. one ``jax.lax.cond`` on that scalar: the taken branch unscales the
   gradients and runs the inner update (so XLA fuses the division into the
   inner optimizer's elementwise pass); the skip branch returns zero updates
   and the inner state exactly as it was;
3. adjust the scale and counters (``_state.next_state``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale import _validate as validate
from loss_scale._state import DynamicRule, LossScaleState, PredictiveRule, Rule, StaticRule, init_state, next_state
from loss_scale._tree import (
    GradStats,
    gradient_stats,
    match_varying,
    unscale_and_clip_tree,
    unscale_tree,
    zeros_like_shapes,
)
from loss_scale._types import PyTree


class LossScaleTransformation(optax.GradientTransformationExtraArgs):
    """The optax transformation that ``dynamic``, ``predictive``, ``static``,
    ``no_op`` and the presets return.

    An ``optax.GradientTransformationExtraArgs`` (a NamedTuple of ``init`` and
    ``update``, accepted wherever optax takes a transformation) that also
    carries its fused step, ``apply_gradients``: ``update`` and
    ``optax.apply_updates`` in one, with the addition to the params inside
    the taken branch. ``loss_scale.apply_gradients`` calls it.
    """

    def __new__(cls, init, update, apply_gradients):
        tx = super().__new__(cls, init, update)
        object.__setattr__(tx, "_apply_gradients", apply_gradients)
        return tx

    def apply_gradients(
        self, grads: optax.Updates, state: optax.OptState, params: optax.Params, **extra_args: Any
    ) -> tuple[optax.Params, optax.OptState]:
        """``(new_params, new_state)``: ``update`` and ``optax.apply_updates``,
        fused (see ``loss_scale.apply_gradients``)."""
        return self._apply_gradients(grads, state, params, **extra_args)


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
    values (a narrowing, a shape or structure change) raises a TypeError.
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
        old_dtype, old_shape = getattr(old, "dtype", None), getattr(old, "shape", None)
        exact = old_dtype is not None and np.can_cast(old_dtype, new.dtype, casting="safe")
        if old_shape != new.shape or not exact:
            raise TypeError(
                f"the inner optimizer's update changes state leaf {jax.tree_util.keystr(path)} from "
                f"{old_dtype or type(old)}{old_shape or ''} to {new.dtype}{new.shape}; a skipped step could "
                "not return it unchanged in the new type. Initialise it with the dtype it will keep (for "
                "example, pass params of that dtype to init)"
            )
        kept.append(match_varying(jnp.asarray(old).astype(new.dtype), new))
    return jax.tree.unflatten(treedef_after, kept)


def _check_layout(state: LossScaleState, expected: LossScaleState) -> None:
    """A clear error for a state made by a transformation with other settings
    (a checkpoint restored into a differently configured optimizer), instead
    of a failure deep inside the update."""
    for field in LossScaleState._fields:
        if field == "inner_state":
            continue
        have, want = getattr(state, field), getattr(expected, field)
        mismatch = (have is None) != (want is None)
        if want is not None and have is not None and field != "nonfinite_leaves":
            mismatch = jnp.shape(have) != want.shape
        if mismatch:
            described = "absent" if have is None else f"of shape {jnp.shape(have)}"
            raise ValueError(
                f"the state's field {field!r} is {described}, but this transformation "
                f"{'keeps none' if want is None else f'keeps one of shape {want.shape}'}: the state was made "
                "by a transformation built with other settings (a checkpoint restored into a differently "
                "configured optimizer?). Build the optimizer as it was when the state was saved, or start "
                "from tx.init(params) and carry over inner_state (ls.wrap_opt_state)."
            )


@dataclasses.dataclass(frozen=True)
class Options:
    """What the update does besides scaling; validated once."""

    check_finite: bool = True
    max_grad_norm: float | None = None
    track_grad_norm: bool = False
    locate_overflows: bool = False
    axis_name: Hashable | None = None
    max_consecutive_skips: int | None = None
    track_underflow: bool = False

    def __post_init__(self):
        for field, check in [
            ("check_finite", validate.flag),
            ("max_grad_norm", lambda name, value: validate.optional(validate.positive, name, value)),
            ("track_grad_norm", validate.flag),
            ("locate_overflows", validate.flag),
            ("axis_name", validate.axis_name),
            ("max_consecutive_skips", lambda name, value: validate.optional(validate.count, name, value)),
            ("track_underflow", validate.flag),
        ]:
            object.__setattr__(self, field, check(field, getattr(self, field)))

    @property
    def with_norm(self) -> bool:
        return self.track_grad_norm or self.max_grad_norm is not None


def keyword_options(
    max_grad_norm: float | None,
    track_grad_norm: bool,
    locate_overflows: bool,
    axis_name: Hashable | None,
    max_consecutive_skips: int | None,
    track_underflow: bool,
) -> Options:
    """The ``Options`` of the keyword arguments that every loss-scaling
    transformation (and every preset) takes."""
    return Options(
        max_grad_norm=max_grad_norm,
        track_grad_norm=track_grad_norm,
        locate_overflows=locate_overflows,
        axis_name=axis_name,
        max_consecutive_skips=max_consecutive_skips,
        track_underflow=track_underflow,
    )


def loss_scaled(inner: Any, rule: Rule, options: Options) -> LossScaleTransformation:
    """The transformation behind ``dynamic``, ``static`` and ``no_op``."""
    inner = as_transformation(inner)

    # The state's fields as init makes them, shapes only (one leaf stands in
    # for the gradients' leaf count, which _check_layout does not compare).
    init_layout = jax.eval_shape(
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
        _warn_about_float16_state(inner_state)
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
        _check_layout(state, init_layout)
        num_leaves = len(jax.tree.leaves(grads))
        if options.locate_overflows and num_leaves != state.nonfinite_leaves.shape[0]:
            raise ValueError(
                f"locate_overflows: the gradients have {num_leaves} leaves but init saw "
                f"{state.nonfinite_leaves.shape[0]} (init with a tree of the gradients' structure)"
            )

        def inner_step(grads, inner_state, params):
            updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
            if apply_to_params:
                return optax.apply_updates(params, updates), inner_state
            return updates, inner_state

        if not options.check_finite:
            out, inner_state = inner_step(unscale_tree(grads, scale), state.inner_state, params)
            stats = GradStats(jnp.ones((0,), jnp.bool_), jnp.full((), jnp.nan, jnp.float32), None)
            return out, next_state(rule, state, stats, jnp.array(True), inner_state)

        stats = gradient_stats(grads, scale, options.with_norm, options.track_underflow, options.axis_name)
        finite = jnp.all(stats.leaf_finite)
        clip_factor = None
        if options.max_grad_norm is not None:
            norm = jnp.sqrt(stats.sq_norm)
            clip_factor = jnp.where(norm < options.max_grad_norm, 1.0, options.max_grad_norm / norm)

        def apply(grads, inner_state, params):
            # The unscale (and clip) sits inside the taken branch, where XLA
            # fuses it with the inner optimizer's elementwise pass.
            return inner_step(unscale_and_clip_tree(grads, scale, clip_factor), inner_state, params)

        out_shapes = jax.eval_shape(apply, grads, state.inner_state, params)
        _skipped_inner_state(state.inner_state, out_shapes[1])  # raises here, outside the cond, if it must

        def skip(grads, inner_state, params):
            del grads
            inner_state = _skipped_inner_state(inner_state, out_shapes[1])
            if apply_to_params:
                # The params as they were: nothing is written, nothing is added.
                return jax.tree.map(match_varying, params, out_shapes[0]), inner_state
            return zeros_like_shapes(out_shapes[0]), inner_state

        out, inner_state = jax.lax.cond(finite, apply, skip, grads, state.inner_state, params)
        new_state = next_state(rule, state, stats, finite, inner_state)
        if options.max_consecutive_skips is not None:
            _raise_when_stuck(new_state, stats, grads, options.max_consecutive_skips)
        return out, new_state

    def update_fn(
        updates: optax.Updates,
        state: LossScaleState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaleState]:
        return step(updates, state, params, extra_args, apply_to_params=False)

    def apply_gradients_fn(grads, state, params, **extra_args):
        return step(grads, state, params, extra_args, apply_to_params=True)

    return LossScaleTransformation(init_fn, update_fn, apply_gradients_fn)


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """``tx.update`` and ``optax.apply_updates`` in one, with the addition to
    the params inside the taken branch.

    The result equals ``updates, opt_state = tx.update(grads, opt_state,
    params); optax.apply_updates(params, updates)``. When ``tx`` is a
    loss-scaling transformation itself (``dynamic``, ``static``, ``no_op``
    or a preset), the addition happens inside the ``lax.cond``: XLA fuses the
    update into the write of the params as it does for a bare optimizer, the
    updates are never materialized (one write and one read of a
    parameter-sized buffer saved, and that much less temporary memory), and a
    skipped step writes nothing. Any other ``tx`` (a chain around the
    loss-scaling transformation, say) takes the two-step path.

    Args:
      tx: the optimizer.
      grads: gradients of ``loss * scale``.
      opt_state: ``tx``'s state.
      params: the parameters.
      **extra_args: passed on to ``tx.update``.

    Returns:
      ``(new_params, new_opt_state)``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.5), initial_scale=4.0)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> params, state = ls.apply_gradients(tx, {"w": jnp.array([4.0, 8.0])}, state, params)
      >>> params["w"]
      Array([0.5, 0. ], dtype=float32)
    """
    if isinstance(tx, LossScaleTransformation):
        return tx.apply_gradients(grads, opt_state, params, **extra_args)
    updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
    return optax.apply_updates(params, updates), opt_state


class Float16StateWarning(UserWarning):
    """The wrapped optimizer keeps part of its state in float16."""


def _warn_about_float16_state(inner_state: optax.OptState) -> None:
    """float16 optimizer state is a classic source of silent instability:
    Adam's eps=1e-8 rounds to 0 in float16 (an update of 0/0 = nan once a
    second moment underflows), and squared gradients below about 6e-8
    underflow to 0. bfloat16 has float32's range and is not flagged."""
    paths = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(inner_state)[0]
        if getattr(leaf, "dtype", None) == jnp.float16
    ]
    if paths:
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        warnings.warn(
            f"the optimizer state has float16 leaves ({shown}). In float16, Adam's eps=1e-8 is 0 and second "
            "moments below 6e-8 underflow to 0, which gives nan or huge updates. Keep float32 master params "
            "(cast to float16 inside the loss function) so the optimizer state is float32.",
            Float16StateWarning,
            stacklevel=3,
        )


class SkippedStepsError(FloatingPointError):
    """Raised (through ``jax.debug.callback``) when more consecutive steps than
    ``max_consecutive_skips`` were skipped. Under ``jit`` it reaches the caller
    wrapped in a ``jax.errors.JaxRuntimeError`` that carries its message."""


def _raise_when_stuck(state: LossScaleState, stats: GradStats, grads: PyTree, limit: int) -> None:
    """A host callback, run only on the step where the limit is reached, that
    raises with the scale and the names of the non-finite gradient leaves.

    The callback checks the count itself: under ``vmap`` the ``lax.cond``
    that guards it becomes a select, and the callback runs on every step
    (once per batch element)."""
    paths = [
        jax.tree_util.keystr(path) or "(the gradient array itself)"
        for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]
    ]

    def report(skips, scale, leaf_finite):
        if int(skips) != limit:
            return
        bad = [path for path, ok in zip(paths, leaf_finite, strict=True) if not ok]
        raise SkippedStepsError(
            f"loss_scale: {int(skips)} consecutive steps skipped (max_consecutive_skips={limit}); the scale is "
            f"{float(scale):g}. Non-finite gradient leaves on the last step: {', '.join(bad) or '(none)'}. "
            "The gradients overflow at any scale: look for bad data, a diverged model, or an op that "
            "overflows in float16 whatever the loss scale."
        )

    def callback():
        jax.debug.callback(report, state.consecutive_skips, state.scale, stats.leaf_finite)

    jax.lax.cond(state.consecutive_skips == limit, callback, lambda: None)


def dynamic(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> LossScaleTransformation:
    """Dynamic loss scaling around any optax optimizer.

    ``update`` expects the gradients of ``loss * scale`` (see
    ``loss_scale.value_and_grad``). It divides them by the scale in float32,
    checks them for inf/nan, and then either runs ``inner``'s update on the
    unscaled gradients or, if anything is non-finite, skips it: the updates
    are zeros and ``inner``'s state is returned unchanged (Adam's moments and
    step count do not move). Then the scale adjusts:

    * after ``growth_interval`` consecutive clean steps it is multiplied by
      ``growth_factor``, capped at ``max_scale`` (never inf);
    * on an overflow it is multiplied by ``backoff_factor``, floored at
      ``min_scale``; with ``hysteresis = h`` only from the h-th overflow since
      the last growth on (``consecutive_hysteresis=True``: since the last
      clean step).

    With ``min_scale`` tiny, ``max_scale=inf`` and ``hysteresis=1`` the scale
    and the skipped steps follow torch.amp.GradScaler exactly.

    Args:
      inner: the optimizer to wrap.
      initial_scale: the scale at step 0.
      growth_factor: multiplier on growth, > 1.
      backoff_factor: multiplier on overflow, in (0, 1).
      growth_interval: clean steps in a row before the scale grows, >= 1.
      min_scale: floor of the scale, > 0 (below 1 is allowed).
      max_scale: ceiling of the scale, may be ``inf``.
      hysteresis: overflows tolerated before backing off, >= 1.
      consecutive_hysteresis: refill the hysteresis on every clean step
        instead of only on growth.
      max_grad_norm: clip the unscaled gradients to this global norm before
        the inner update, on finite steps only; the same as
        ``optax.chain(optax.clip_by_global_norm(max_grad_norm), inner)``
        inside the wrapper, with the norm taken in the check's pass.
      track_grad_norm: record the unscaled global gradient norm in the state
        (``grad_norm``); costs a sum of squares over the gradients.
      locate_overflows: record which gradient leaves were non-finite on the
        last skipped step (``loss_scale.overflow_paths`` names them); costs a
        bool per leaf in the state.
      axis_name: under ``shard_map`` or ``pmap``, the axis over which the
        replicas agree on the finite check and the maximum, so that all of
        them skip the same steps and keep the same scale. The norm is that of
        the local gradients (average them first, see ``value_and_grad``).
      max_consecutive_skips: ``None`` (the default) keeps skipping for as
        long as the gradients overflow, and the state reports it
        (``consecutive_skips``, ``steps_at_min``). An int ``n`` raises a
        ``SkippedStepsError`` on the host on the n-th skipped step in a row,
        naming the non-finite gradient leaves; no update is applied either way.
      track_underflow: record the fractions of gradient elements that are 0
        and below float16's smallest normal once scaled (``zero_fraction``,
        ``below_normal_fraction``): a high value says the scale is too low.
        Costs two counting reductions over the gradients.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``LossScaleState``.

    Raises:
      ValueError: when a setting is out of range (named in the message).
      TypeError: when ``inner`` is not an optax transformation.

    Example:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=2.0**10)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
      >>> loss, grads = ls.value_and_grad(loss_fn)(state, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["w"]
      Array([0.8, 0.8, 0.8], dtype=float32)
    """
    initial = validate.scale("initial_scale", initial_scale)
    minimum = validate.scale("min_scale", min_scale)
    maximum = validate.scale("max_scale", max_scale, allow_inf=True)
    validate.scale_bounds(("initial_scale", initial), ("min_scale", minimum), ("max_scale", maximum))
    rule = DynamicRule(
        initial_scale=initial,
        growth_factor=validate.growth_factor("growth_factor", growth_factor),
        backoff_factor=validate.backoff_factor("backoff_factor", backoff_factor),
        growth_interval=validate.count("growth_interval", growth_interval),
        min_scale=minimum,
        max_scale=maximum,
        hysteresis=validate.count("hysteresis", hysteresis),
        consecutive_hysteresis=validate.flag("consecutive_hysteresis", consecutive_hysteresis),
    )
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    return loss_scaled(inner, rule, options)


def predictive(
    inner: optax.GradientTransformation,
    initial_scale: float = 2.0**15,
    min_headroom: int = 1,
    headroom_interval: int = 20000,
    peak_half_life: float = 100.0,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    initial_headroom: int = 12,
    compute_dtype: Any = "float16",
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> LossScaleTransformation:
    """Loss scaling that aims the scale at the recent gradient peak.

    The update is ``dynamic``'s (unscale in float32, check, skip the whole
    inner update on overflow); only the rule that moves the scale differs.
    Where ``dynamic`` reacts (it halves after an overflow and doubles after
    ``growth_interval`` clean steps), this rule predicts: from the largest
    gradient magnitude of every step, which the finite check computes anyway,
    it keeps a running peak (``grad_peak``, halving every ``peak_half_life``
    steps) and sets the scale to the power of two that puts that peak
    ``headroom`` binades below the largest float16 value. The scale follows
    the gradients down and up within steps, so it backs off before a slow
    rise of the gradients overflows and grows as soon as they shrink.

    The headroom learns how much larger than the parameter gradients the
    float16 values of the backward pass get. The first clean step measures
    how far below the float16 maximum its gradients were (at most
    ``initial_headroom`` counts); from there the scale climbs one binade a
    clean step until the first overflow, which sets the headroom two binades
    above what the scale had then (one skipped step), or until
    ``min_headroom`` is reached. After that the headroom drops by one every
    ``headroom_interval`` clean steps (a probe that may cost a skip; torch's
    rule probes every 2000 steps). Overflows in a row back off by 2, 4, 16,
    256, ...; an overflow before any clean step drops the scale to
    ``min_scale``. Every rule of the update is in ``_state.PredictiveRule``.

    Args:
      inner: the optimizer to wrap.
      initial_scale: the scale of the first step (as ``dynamic``'s).
      min_headroom: the smallest margin, in powers of two, kept between the
        predicted largest scaled value and the dtype's largest value.
      headroom_interval: clean steps in a row after which the headroom drops
        by one, >= 1.
      peak_half_life: steps over which a past gradient peak counts half as
        much, >= 1.
      min_scale: floor of the scale, > 0.
      max_scale: ceiling of the scale, may be ``inf``.
      initial_headroom: the most headroom the first measurement keeps,
        >= ``min_headroom``: an upper bound on how much larger than the
        parameter gradients the backward pass's values may get.
      compute_dtype: the dtype of the backward pass, whose largest value is
        the overflow threshold (float16: 65504).
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as in ``dynamic``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``LossScaleState`` with ``headroom`` and ``grad_peak``.

    Example:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.predictive(optax.sgd(0.1))
      >>> state = tx.init(jnp.zeros(2))
      >>> for _ in range(3):  # gradients of loss * scale; the largest unscaled one is 2**-8
      ...     _, state = tx.update(jnp.array([2.0**-8, 0.0]) * state.scale, state)
      ...     print(float(state.scale), int(state.headroom))
      32768.0 8
      65536.0 7
      131072.0 6
    """
    initial = validate.scale("initial_scale", initial_scale)
    minimum = validate.scale("min_scale", min_scale)
    maximum = validate.scale("max_scale", max_scale, allow_inf=True)
    validate.scale_bounds(("initial_scale", initial), ("min_scale", minimum), ("max_scale", maximum))
    lowest = validate.count("min_headroom", min_headroom, -64, 64)
    first = validate.count("initial_headroom", initial_headroom, -64, 64)
    if first < lowest:
        raise ValueError(f"initial_headroom ({initial_headroom!r}) must be >= min_headroom ({min_headroom!r})")
    half_life = validate.real("peak_half_life", peak_half_life)
    if not 1 <= half_life < math.inf:
        raise ValueError(f"peak_half_life must be finite and >= 1 step, got {peak_half_life!r}")
    dtype = validate.floating_dtype("compute_dtype", compute_dtype)
    rule = PredictiveRule(
        initial_scale=initial,
        initial_headroom=first,
        min_headroom=lowest,
        headroom_interval=validate.count("headroom_interval", headroom_interval),
        peak_half_life=half_life,
        min_scale=minimum,
        max_scale=maximum,
        overflow_threshold=min(float(jnp.finfo(dtype).max), validate.FLOAT32_MAX),
    )
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    return loss_scaled(inner, rule, options)


def static(
    inner: optax.GradientTransformation,
    scale: float,
    *,
    max_grad_norm: float | None = None,
    track_grad_norm: bool = False,
    locate_overflows: bool = False,
    axis_name: Hashable | None = None,
    max_consecutive_skips: int | None = None,
    track_underflow: bool = False,
) -> LossScaleTransformation:
    """A fixed loss scale around ``inner``; non-finite steps are still skipped.

    Args:
      inner: the optimizer to wrap.
      scale: the loss scale, finite and > 0.
      max_grad_norm, track_grad_norm, locate_overflows, axis_name,
        max_consecutive_skips, track_underflow: as in ``dynamic``.

    Example:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.static(optax.sgd(1.0), scale=128.0)
      >>> state = tx.init(jnp.zeros(2))
      >>> updates, state = tx.update(jnp.array([128.0, jnp.inf]), state)
      >>> updates, bool(state.skipped)
      (Array([0., 0.], dtype=float32), True)
    """
    options = keyword_options(
        max_grad_norm, track_grad_norm, locate_overflows, axis_name, max_consecutive_skips, track_underflow
    )
    return loss_scaled(inner, StaticRule(validate.scale("scale", scale)), options)


def no_op(inner: optax.GradientTransformation, skip_nonfinite: bool = False) -> LossScaleTransformation:
    """No loss scaling (scale 1), with the same state as ``dynamic``.

    For bfloat16 and float32 training, so that switching precision does not
    change the shape of the optimizer state or the training loop.

    Args:
      inner: the optimizer to wrap.
      skip_nonfinite: by default the inner update runs on every step with no
        check, at no cost; ``True`` checks the gradients and skips non-finite
        steps as ``static(inner, 1.0)`` does.

    Example:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.no_op(optax.sgd(1.0))
      >>> float(ls.get_scale(tx.init(jnp.zeros(2))))
      1.0
    """
    skip_nonfinite = validate.flag("skip_nonfinite", skip_nonfinite)
    return loss_scaled(inner, StaticRule(1.0), Options(check_finite=skip_nonfinite))
