"""The warnings and the error that the update can raise: float16 optimizer
state, ``ls.low_precision`` given no half-precision parameter, and a run of
skipped steps longer than the user allows (checked in the update, or on the
host with ``check_skips``)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loss_scale._find import find_state
from loss_scale._state import LossScaleState
from loss_scale._types import PyTree


class Float16StateWarning(UserWarning):
    """The wrapped optimizer keeps part of its state in float16.

    Warned by a loss-scaling transformation's ``init``, naming the float16
    leaves: in float16, Adam's ``eps=1e-8`` is 0 and second moments below
    6e-8 underflow to 0, which gives nan or huge updates. Keep float32
    params (cast to float16 inside the loss function), and the optimizer
    state is float32. bfloat16 state has float32's range and is not
    flagged.

    Examples:
      >>> import warnings
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = ls.dynamic(optax.adam(1e-3)).init({"w": jnp.zeros(2, jnp.float16)})
      >>> [w.category.__name__ for w in caught]
      ['Float16StateWarning']
      >>> str(caught[0].message)[:58]
      "the optimizer state has float16 leaves ([0].mu['w'], [0].n"
    """


class FullPrecisionParamsWarning(UserWarning):
    """``ls.low_precision`` was given no bfloat16 or float16 parameter.

    Warned by its ``init``: every leaf is then updated exactly as the inner
    optimizer alone updates it, in its own (wider) dtype, and nothing is
    saved. The usual cause is a forgotten cast of the params to bfloat16
    before ``tx.init``. Filter it where float32 params are meant (a
    comparison run).

    Examples:
      >>> import warnings
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = ls.low_precision(optax.adam(1e-3)).init({"w": jnp.zeros(2, jnp.float32)})
      >>> [w.category.__name__ for w in caught]
      ['FullPrecisionParamsWarning']
    """


def warn_about_full_precision_params(params: PyTree) -> None:
    """A ``FullPrecisionParamsWarning`` when ``params`` has floating leaves
    and none of them is bfloat16 or float16."""
    dtypes = {
        jnp.dtype(leaf.dtype)
        for leaf in jax.tree.leaves(params)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
    }
    if dtypes and not dtypes & {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
        shown = ", ".join(sorted(d.name for d in dtypes))
        warnings.warn(
            f"ls.low_precision was given no bfloat16 or float16 parameter (the params are {shown}): every "
            "parameter is updated as the inner optimizer alone updates it and nothing is saved. Cast the params "
            "before init, e.g. params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params).",
            FullPrecisionParamsWarning,
            stacklevel=3,
        )


def warn_about_float16_state(inner_state: optax.OptState) -> None:
    """float16 optimizer state is a classic source of silent instability:
    Adam's eps=1e-8 rounds to 0 in float16 (an update of 0/0 = nan once a
    second moment underflows), and squared gradients below about 6e-8
    underflow to 0. bfloat16 has float32's range and is not flagged, nor
    are the fields a state declares float16 by design (``ls.low_precision``'s
    compensation buffer: a rounding error, not a moment)."""
    paths = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(_without_float16_by_design(inner_state))[0]
        if getattr(leaf, "dtype", None) == jnp.float16
    ]
    if paths:
        shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
        warnings.warn(
            f"the optimizer state has float16 leaves ({shown}). In float16, Adam's eps=1e-8 is 0 and second "
            "moments below 6e-8 underflow to 0, which gives nan or huge updates. Keep float32 master params "
            "(cast to float16 inside the loss function) so the optimizer state is float32, or, with float16 "
            "params under ls.low_precision, store the moments in bfloat16 or float32 (state_dtype=jnp.bfloat16).",
            Float16StateWarning,
            stacklevel=4,
        )


def _without_float16_by_design(tree: PyTree) -> PyTree:
    """``tree`` with ``None`` in the fields that a NamedTuple state names in
    its ``_float16_by_design`` class attribute (other leaves keep their
    paths)."""

    def declares(node: object) -> bool:
        return bool(getattr(type(node), "_float16_by_design", ()))

    def strip(node: object) -> object:
        if not declares(node):
            return node
        exempt = type(node)._float16_by_design
        return node._replace(
            **{f: None if f in exempt else _without_float16_by_design(getattr(node, f)) for f in node._fields}
        )

    return jax.tree.map(strip, tree, is_leaf=declares)


class SkippedStepsError(FloatingPointError):
    """More consecutive steps were skipped than the user allows.

    Raised by a transformation built with ``max_consecutive_skips=n`` on the
    n-th skipped step in a row, and by ``loss_scale.check_skips``. Its
    message starts with ``"loss_scale: "`` and says how many steps were
    skipped, the scale now, and why the last one was (the non-finite
    gradient leaves, or a non-finite loss passed as ``value=``).

    Where it can be caught as it is:

    * called eagerly (``tx.update`` outside ``jit``), the update raises it
      directly;
    * ``loss_scale.check_skips(opt_state, n)``, called on the host after a
      (jitted) step, raises it from the state it returns.

    Inside ``jit`` (and ``vmap``, ``shard_map``, ``nnx.jit``,
    ``eqx.filter_jit``...) it is raised in a host callback, and JAX's
    runtime hands the caller a ``jax.errors.JaxRuntimeError`` instead (after
    logging "jax.debug.callback failed" with the traceback to stderr); its
    message contains ``"SkippedStepsError: loss_scale: "`` followed by this
    error's message. Catch that, or build the transformation without
    ``max_consecutive_skips`` and call ``check_skips`` after each step.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0, max_consecutive_skips=2)
      >>> params = {"w": jnp.ones(2)}
      >>> grads = {"w": jnp.array([1.0, jnp.inf])}
      >>> _, opt_state = tx.update(grads, tx.init(params), params)
      >>> try:
      ...     tx.update(grads, opt_state, params)   # eagerly: the error itself
      ... except ls.SkippedStepsError as error:
      ...     print(str(error)[:70])
      loss_scale: 2 consecutive steps skipped (max_consecutive_skips=2); the
      >>> try:   # under jit: the runtime's error, recognised by its message
      ...     jax.block_until_ready(jax.jit(tx.update)(grads, opt_state, params))
      ... except jax.errors.JaxRuntimeError as error:
      ...     if "SkippedStepsError: loss_scale: " not in str(error):
      ...         raise
      ...     print("stopped")
      stopped
    """


def check_skips(opt_state: PyTree, max_consecutive_skips: int) -> None:
    """Raises ``SkippedStepsError`` when ``opt_state`` shows at least
    ``max_consecutive_skips`` skipped steps in a row.

    The host-side form of the ``max_consecutive_skips=`` option: call it
    outside ``jit``, after a step, on the state the step returned, and the
    error is the documented one, which ``except loss_scale.SkippedStepsError``
    catches (inside ``jit`` the option's error reaches the caller as a
    ``jax.errors.JaxRuntimeError``). It reads two scalars from the device,
    so it waits for the step to finish. The non-finite gradient leaves are
    numbered (as in ``jax.tree.leaves(params)``) when the transformation was
    built with ``locate_overflows=True``.

    Args:
      opt_state: any optimizer state that holds one loss-scale state (that
        of a ``vmap``-ed transformation too: it raises for the first stuck
        model).
      max_consecutive_skips: the number of skipped steps in a row, >= 1,
        from which it raises.

    Raises:
      SkippedStepsError: when ``consecutive_skips >= max_consecutive_skips``.
      TypeError: when called inside ``jit`` or another transformation.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.dynamic(optax.sgd(0.1), initial_scale=8.0)
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> step = jax.jit(tx.update)
      >>> _, opt_state = step({"w": jnp.array([1.0, jnp.inf])}, opt_state, params)
      >>> ls.check_skips(opt_state, 2)   # one skip: nothing
      >>> _, opt_state = step({"w": jnp.array([1.0, jnp.inf])}, opt_state, params)
      >>> try:
      ...     ls.check_skips(opt_state, 2)
      ... except ls.SkippedStepsError as error:
      ...     print(str(error)[:65])
      loss_scale: 2 consecutive steps skipped (max_consecutive_skips=2)
    """
    if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int):
        raise TypeError(f"max_consecutive_skips must be an int, got {type(max_consecutive_skips).__name__}")
    if max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
    state = find_state(opt_state)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
        raise TypeError(
            "loss_scale.check_skips reads the state on the host: call it outside jit, on the state a step "
            "returned; inside jit, build the transformation with max_consecutive_skips= instead"
        )
    skips = np.asarray(state.consecutive_skips)
    stuck = np.flatnonzero(skips.reshape(-1) >= max_consecutive_skips)
    if stuck.size == 0:
        return
    index = np.unravel_index(stuck[0], skips.shape)
    located = state.record.nonfinite_leaves
    bad = None if located is None else [str(i) for i in np.flatnonzero(np.asarray(located)[index])]
    message = skipped_steps_message(
        int(skips[index]),
        max_consecutive_skips,
        float(np.asarray(state.scale)[index]),
        int(np.asarray(state.skip_reason)[index]),
        None if bad is None else [f"leaf {i}" for i in bad],
    )
    if bad:
        message += (
            " (leaves numbered as in jax.tree.leaves(params); loss_scale.overflow_paths(opt_state, params) names them)"
        )
    if skips.ndim:
        message += f" (model {tuple(int(i) for i in index)} of the batched state)"
    raise SkippedStepsError(message)


def skipped_steps_message(
    skips: int, limit: int, scale: float, reason: int, bad_leaves: list[str] | None, floor: float | None = None
) -> str:
    """The message of ``SkippedStepsError``: only what the counters show.

    ``bad_leaves`` names the non-finite gradient leaves of the last step
    (``None`` where they are not known); ``floor`` is the lowest scale the
    rule can reach (``None`` where it is not known)."""
    steps = "step" if skips == 1 else "steps"
    head = (
        f"loss_scale: {skips} consecutive {steps} skipped (max_consecutive_skips={limit}); the scale is now {scale:g}. "
    )
    if reason == 2:
        return head + (
            "The last one was a forward failure: the loss passed as value= was not finite, so the forward pass "
            "itself overflowed or produced nan, which no loss scale can fix. Look for bad data, a diverged "
            "model, or an op that overflows in float16 in the forward pass (compute it in float32)."
        )
    if bad_leaves is None:
        where = "build the transformation with locate_overflows=True to name the non-finite gradient leaves"
    else:
        where = f"non-finite gradient leaves: {', '.join(bad_leaves) or '(none)'}"
    if floor is not None and scale <= floor:
        advice = (
            f"The scale has reached its minimum ({floor:g}), so no lower one can be tried: look for bad data, "
            "a diverged model, or an op that overflows in float16 whatever the loss scale."
        )
    else:
        advice = (
            "Where the scale is still above min_scale, a lower scale may make the gradients finite: a larger "
            "max_consecutive_skips (or a lower initial_scale) lets it back off further. Where it is at "
            "min_scale (metrics' loss_scale/steps_at_min counts the steps taken there), look for bad data, a "
            "diverged model, or an op that overflows in float16 whatever the loss scale."
        )
    return head + f"The last one was a gradient overflow; {where}. " + advice


def raise_when_stuck(
    state: LossScaleState,
    leaf_finite: jax.Array,
    grads: PyTree,
    limit: int,
    floor: float | None = None,
) -> None:
    """Raises ``SkippedStepsError`` on the step where ``limit`` skips in a
    row are reached, with the scale and the names of the non-finite
    gradient leaves; ``floor``, the rule's lowest scale, lets the message
    say whether it was reached.

    With concrete counters (``tx.update`` called eagerly) it raises here,
    in Python, so that ``except SkippedStepsError`` catches it. Traced (under
    ``jit``, ``vmap``...) it raises in a host callback, which JAX's runtime
    reports as a ``jax.errors.JaxRuntimeError`` carrying the message. The
    callback checks the count itself: under ``vmap`` the ``lax.cond`` that
    guards it becomes a select, and the callback runs on every step (once
    per batch element)."""
    paths = [
        jax.tree_util.keystr(path) or "(the gradient array itself)"
        for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]
    ]

    def report(skips, scale, leaf_finite, reason):
        if int(skips) != limit:
            return
        bad = [path for path, ok in zip(paths, np.asarray(leaf_finite), strict=True) if not ok]
        raise SkippedStepsError(skipped_steps_message(int(skips), limit, float(scale), int(reason), bad, floor))

    arguments = (state.consecutive_skips, state.scale, leaf_finite, state.skip_reason)
    if not any(isinstance(x, jax.core.Tracer) for x in arguments):
        report(*arguments)
        return

    def callback():
        jax.debug.callback(report, *arguments)

    jax.lax.cond(state.consecutive_skips == limit, callback, lambda: None)
