"""The warning and the error that the update can raise: float16 optimizer
state, and a run of skipped steps longer than the user allows."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax

from loss_scale._state import LossScaleState
from loss_scale._types import PyTree


class Float16StateWarning(UserWarning):
    """The wrapped optimizer keeps part of its state in float16."""


def warn_about_float16_state(inner_state: optax.OptState) -> None:
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
            stacklevel=4,
        )


class SkippedStepsError(FloatingPointError):
    """Raised (through ``jax.debug.callback``) when more consecutive steps than
    ``max_consecutive_skips`` were skipped. Under ``jit`` it reaches the caller
    wrapped in a ``jax.errors.JaxRuntimeError`` that carries its message."""


def raise_when_stuck(state: LossScaleState, leaf_finite: jax.Array, grads: PyTree, limit: int) -> None:
    """A host callback, run only on the step where the limit is reached, that
    raises with the scale and the names of the non-finite gradient leaves.

    The callback checks the count itself: under ``vmap`` the ``lax.cond``
    that guards it becomes a select, and the callback runs on every step
    (once per batch element)."""
    paths = [
        jax.tree_util.keystr(path) or "(the gradient array itself)"
        for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]
    ]

    def report(skips, scale, leaf_finite, reason):
        if int(skips) != limit:
            return
        head = (
            f"loss_scale: {int(skips)} consecutive steps skipped (max_consecutive_skips={limit}); "
            f"the scale is {float(scale):g}. "
        )
        if int(reason) == 2:
            raise SkippedStepsError(
                head + "The last one was a forward failure: the loss passed as value= was not finite, so the "
                "forward pass itself overflowed or produced nan, which no loss scale can fix. Look for bad data, "
                "a diverged model, or an op that overflows in float16 in the forward pass (compute it in float32)."
            )
        bad = [path for path, ok in zip(paths, leaf_finite, strict=True) if not ok]
        raise SkippedStepsError(
            head + f"The last one was a gradient overflow; non-finite gradient leaves: {', '.join(bad) or '(none)'}. "
            "The gradients overflow at any scale: look for bad data, a diverged model, or an op that "
            "overflows in float16 whatever the loss scale."
        )

    def callback():
        jax.debug.callback(report, state.consecutive_skips, state.scale, leaf_finite, state.skip_reason)

    jax.lax.cond(state.consecutive_skips == limit, callback, lambda: None)
