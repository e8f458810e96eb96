"""``low_precision``: bfloat16/float16 parameters and optimizer state, with
updates that are not lost to rounding."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale._errors import warn_about_full_precision_params
from loss_scale._low_precision._rounding import (
    is_half,
    random_bits,
    round_nearest,
    round_stochastic,
    update_kahan,
    update_nearest,
    update_stochastic,
)
from loss_scale._low_precision._state import LowPrecisionState, check_compensation, moment_owners
from loss_scale._state import LossScaleState
from loss_scale._update import LossScaleTransformation

ROUNDINGS = ("kahan", "stochastic", "nearest")
STATE_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))
_KEY_IMPL = "threefry2x32"


def low_precision(
    inner: optax.GradientTransformation,
    rounding: str = "kahan",
    *,
    state_dtype: Any = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Trains bfloat16 or float16 parameters directly, without float32
    master weights, and without losing the updates that are smaller than
    half a unit in the last place of their parameter.

    ``inner`` computes its update in float32, from the gradients, the
    parameters and (with ``state_dtype``) its moments upcast to float32;
    each new half-precision parameter is then rounded to the parameter's
    dtype as ``rounding`` says:

    * ``"kahan"`` (the default): to nearest, and a compensation buffer per
      half-precision parameter (its shape and dtype) keeps what the rounding
      lost and adds it back at the next step (Kahan summation, as in Zamirai
      et al. 2020, "Revisiting BFloat16 Training", and optimi's
      ``kahan_sum``). After every step ``p_new + c_new == p + c + update``
      in float32, up to the rounding of ``c_new`` itself: updates far below
      the parameter's resolution add up as they would in float32. Costs one
      parameter-sized buffer.
    * ``"stochastic"``: up or down at random, with probabilities that make
      the expected new parameter the exact one (torchao's bfloat16
      optimizers, llm.c, Gopher). No buffer; each step's rounding adds
      noise of at most one unit in the last place.
    * ``"nearest"``: to nearest, what ``optax.apply_updates`` does alone;
      small updates are lost. For comparison, or for parameters whose
      updates are large against them.

    The returned updates are float32, chosen so that
    ``optax.apply_updates(params, updates)`` (which adds in float32 and
    casts to the parameter's dtype) gives exactly the rounded new
    parameters (the float32 sum is that parameter, or, where the update
    is many binades larger than the parameter, a float32 neighbour of it
    that the cast rounds back). So it works wherever
    updates are applied with ``optax.apply_updates``: ``ls.apply_gradients``,
    flax's ``TrainState.apply_gradients``, ``loss_scale.flax.Optimizer``,
    ``loss_scale.equinox.apply_gradients``.

    float32 and float64 parameters (and integer ones), and their state, are
    updated exactly as ``inner`` alone updates them, bit for bit, with no
    buffer: mixing a float32 LayerNorm with bfloat16 matrices is fine.
    Params with no bfloat16 or float16 leaf at all (a forgotten cast) save
    nothing: ``init`` warns (``FullPrecisionParamsWarning``).

    State. ``state_dtype=None`` keeps the dtypes ``inner.init(params)``
    gives, step after step (optax's optimizers keep a parameter's moments
    in its dtype). Given (``jnp.bfloat16``, ``jnp.float16``, ``jnp.float32``),
    the moments of the half-precision parameters are stored in it: the
    floating leaves of the inner state that are at a half-precision
    parameter's place in a subtree with the params' structure (optax's
    ``mu``, ``nu``, ``trace``...) and have its shape. Either way such a
    moment is upcast to float32 for the inner update, and the new one is
    rounded back to its dtype stochastically (to nearest with ``rounding=
    "nearest"``), so that an exponential average keeps moving: with
    ``b2=0.999``, ``0.999 * nu`` rounds back to ``nu`` in bfloat16, but its
    expected value under stochastic rounding is ``0.999 * nu``. Every other
    leaf of the inner state is returned by ``inner`` itself and kept in its
    dtype. The inner state stays the inner optimizer's own objects, so
    ``optax.tree_utils.tree_get(opt_state, "mu")`` finds them.

    Random bits. The state holds a threefry key's data (uint32[2], made from
    ``seed``), split on every step into the next key and one seed per
    rounded leaf; each element's bits hash its index with its leaf's seed.
    They depend on nothing else: the same on every device and under any
    sharding, so replicated parameters stay identical on every replica, and
    a run resumed from a checkpoint continues bit for bit. Under ``vmap``
    (an ensemble) every model reads the same bits unless their keys differ
    (``state._replace(key=...)``).

    Loss scaling. Wrap this transformation, not the other way round:
    ``ls.dynamic(ls.low_precision(inner))``. A skipped step then leaves the
    parameters, the compensation, the key and the inner state bit for bit
    as they were. float16 parameters need loss scaling (their gradients
    underflow, as in any float16 training); their moments are best stored
    in bfloat16 or float32 (``state_dtype``): in float16, Adam's second
    moments below 6e-8 underflow to zero, which ``Float16StateWarning``
    reports (the compensation buffer, float16 by design, is not reported).

    Args:
      inner: the optimizer, an ``optax.GradientTransformation`` (extra
        arguments such as ``value=`` are passed on to it).
      rounding: ``"kahan"``, ``"stochastic"`` or ``"nearest"``.
      state_dtype: ``None``, or the floating dtype (bfloat16, float16,
        float32, float64) in which the half-precision parameters' moments
        are stored.
      seed: an int, the seed of the key.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``LowPrecisionState``. Its ``update`` needs ``params``.

    Raises:
      ValueError: ``rounding`` is not one of the three, ``state_dtype`` is
        not one of the floating dtypes above, or ``inner`` is a loss-scaling
        transformation (wrap the other way round).
      TypeError: ``inner`` is not an optax transformation, ``seed`` is not
        an int.

    Examples:
      1.0 in bfloat16 plus a thousand updates of 1e-4, each below half its
      resolution (2**-8 = 0.0039):

      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> def run(tx):
      ...     params = {"w": jnp.ones(1, jnp.bfloat16)}
      ...     state = tx.init(params)
      ...     grads = {"w": jnp.full(1, -1e-4, jnp.float32)}
      ...     def step(carry, _):
      ...         params, state = carry
      ...         updates, state = tx.update(grads, state, params)
      ...         return (optax.apply_updates(params, updates), state), None
      ...     (params, _), _ = jax.lax.scan(step, (params, state), length=1000)
      ...     return float(params["w"][0])
      >>> run(optax.sgd(1.0)), run(ls.low_precision(optax.sgd(1.0), "nearest"))
      (1.0, 1.0)
      >>> run(ls.low_precision(optax.sgd(1.0), "kahan"))
      1.1015625
    """
    if isinstance(inner, LossScaleTransformation):
        raise ValueError(
            "inner is a loss-scaling transformation: wrap low_precision in it instead, "
            "ls.dynamic(ls.low_precision(optax.adam(1e-3))), so that a skipped step keeps the compensation "
            "and the key as well as the inner state"
        )
    inner = _as_transformation(inner)
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(map(repr, ROUNDINGS))}, got {rounding!r}")
    stored = _state_dtype(state_dtype)
    key_data = _key_data(seed)
    kahan, stochastic = rounding == "kahan", rounding != "nearest"

    def init_fn(params: optax.Params) -> LowPrecisionState:
        param_leaves, treedef = jax.tree.flatten(params)
        _refuse_narrow_floats(params)
        warn_about_full_precision_params(params)
        inner_state = inner.init(params)
        if any(isinstance(x, LossScaleState) for x in jax.tree.leaves(inner_state, is_leaf=_is_loss_scale_state)):
            raise ValueError(
                "the inner optimizer's state holds a LossScaleState: a loss-scaling transformation is inside "
                "low_precision (e.g. in an optax.chain). Wrap low_precision in it instead: "
                "ls.dynamic(ls.low_precision(inner))"
            )
        if stored is not None:
            dtype = jax.dtypes.canonicalize_dtype(stored)  # float64 is float32 without jax_enable_x64
            owners = moment_owners(inner_state, treedef, param_leaves)
            leaves, state_treedef = jax.tree.flatten(inner_state)
            leaves = [x if owner is None else x.astype(dtype) for x, owner in zip(leaves, owners, strict=True)]
            inner_state = state_treedef.unflatten(leaves)
        compensation = treedef.unflatten([jnp.zeros_like(p) if kahan and is_half(p) else None for p in param_leaves])
        return LowPrecisionState(compensation, jnp.array(key_data), inner_state)

    def update_fn(
        updates: optax.Updates, state: LowPrecisionState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, LowPrecisionState]:
        if params is None:
            raise ValueError("ls.low_precision's update needs the params: tx.update(grads, opt_state, params)")
        if not isinstance(state, LowPrecisionState):
            raise TypeError(
                f"state must be the LowPrecisionState made by this transformation's init, got {type(state).__name__}"
            )
        param_leaves, treedef = jax.tree.flatten(params)
        buffers = check_compensation(state.compensation, params, kahan)
        half = [is_half(p) for p in param_leaves]

        # The inner update, in float32 for the half-precision leaves.
        grads = treedef.flatten_up_to(updates)
        grads32 = [g.astype(jnp.float32) if h and g is not None else g for g, h in zip(grads, half, strict=True)]
        params32 = [p.astype(jnp.float32) if h else p for p, h in zip(param_leaves, half, strict=True)]
        owners = moment_owners(state.inner_state, treedef, param_leaves)
        old_leaves, state_treedef = jax.tree.flatten(state.inner_state)
        leaves32 = [x if o is None else x.astype(jnp.float32) for x, o in zip(old_leaves, owners, strict=True)]
        deltas, inner_state = inner.update(
            treedef.unflatten(grads32), state_treedef.unflatten(leaves32), treedef.unflatten(params32), **extra_args
        )
        deltas = treedef.flatten_up_to(deltas)
        new_leaves, new_treedef = jax.tree.flatten(inner_state)
        if new_treedef != state_treedef:
            raise TypeError(
                f"the inner optimizer's update changed the structure of its state from {state_treedef} to "
                f"{new_treedef}; low_precision keeps it step after step"
            )

        # One random stream per stochastically rounded leaf, and the next key.
        rounded_params = [i for i, h in enumerate(half) if h and rounding == "stochastic"]
        rounded_moments = [j for j, o in enumerate(owners) if o is not None and stochastic]
        keys = jax.random.split(
            jax.random.wrap_key_data(state.key, impl=_KEY_IMPL), 1 + len(rounded_params + rounded_moments)
        )
        seeds = jax.random.key_data(keys[1:])
        streams = dict(
            zip([("param", i) for i in rounded_params] + [("moment", j) for j in rounded_moments], seeds, strict=True)
        )

        out, new_buffers = [], list(buffers)
        for i, (p, delta, buffer) in enumerate(zip(param_leaves, deltas, buffers, strict=True)):
            if not half[i]:
                out.append(delta)
                continue
            delta = delta.astype(jnp.float32)
            if rounding == "kahan":
                update, new_buffers[i] = update_kahan(p, buffer, delta)
            elif rounding == "stochastic":
                update = update_stochastic(p, delta, random_bits(streams["param", i], p.shape))
            else:
                update = update_nearest(p, delta)
            out.append(update)

        kept = []
        for j, (old, new) in enumerate(zip(old_leaves, new_leaves, strict=True)):
            if owners[j] is not None and stochastic:
                new = round_stochastic(new.astype(jnp.float32), old.dtype, random_bits(streams["moment", j], new.shape))
            elif owners[j] is not None:
                new = round_nearest(new.astype(jnp.float32), old.dtype)
            elif hasattr(old, "dtype") and hasattr(new, "dtype") and new.dtype != old.dtype:
                new = new.astype(old.dtype)
            kept.append(new)

        new_state = LowPrecisionState(
            treedef.unflatten(new_buffers), jax.random.key_data(keys[0]), state_treedef.unflatten(kept)
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_transformation(inner: Any) -> optax.GradientTransformationExtraArgs:
    """``inner``, checked, with extra-args support."""
    if isinstance(inner, optax.GradientTransformation):
        return optax.with_extra_args_support(inner)
    init, update = getattr(inner, "init", None), getattr(inner, "update", None)
    if callable(init) and callable(update):  # duck-typed transformations such as optax.MultiSteps
        return optax.GradientTransformationExtraArgs(init, update)
    hint = ""
    if callable(inner):
        hint = " (did you pass an optimizer factory without calling it, e.g. optax.adam instead of optax.adam(1e-3)?)"
    raise TypeError(
        f"inner must be an optax.GradientTransformation, got {inner!r} of type {type(inner).__name__}{hint}"
    )


def _state_dtype(state_dtype: Any) -> jnp.dtype | None:
    """``state_dtype`` as a NumPy dtype, or a ValueError naming it (as the
    package refuses any dtype it has no use for)."""
    if state_dtype is None:
        return None
    try:
        known = jnp.dtype(state_dtype) in STATE_DTYPES
    except TypeError:  # not a dtype at all
        known = False
    if not known:
        raise ValueError(
            "state_dtype must be None or a floating dtype: jnp.bfloat16, jnp.float16, jnp.float32 or jnp.float64; "
            f"got {state_dtype!r}"
        )
    return jnp.dtype(state_dtype)


def _key_data(seed: Any) -> jax.Array:
    """The raw threefry key data made from ``seed``, or a TypeError naming it."""
    if isinstance(seed, bool | np.bool_) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int, got {seed!r} of type {type(seed).__name__}")
    try:
        return jax.random.key_data(jax.random.key(int(seed), impl=_KEY_IMPL))
    except OverflowError:
        raise ValueError(f"seed must fit in 64 bits, got {seed}") from None


def _refuse_narrow_floats(params: optax.Params) -> None:
    """A TypeError naming the first parameter whose floating dtype is
    narrower than 16 bits (float8 formats), which low_precision does not
    round."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 2:
            raise TypeError(
                f"low_precision rounds bfloat16 and float16 parameters (and leaves wider ones as they are); "
                f"parameter {jax.tree_util.keystr(path) or '(the params)'} is {dtype}"
            )


def _is_loss_scale_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)
