"""What ``loss_scale.flax``'s NNX gradients share: the loss in a loss
function's output, and the gradients of an NNX model with per-segment
boundaries in force."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from loss_scale._segments import SegmentedGradient


def nnx_segmented(scaled: Callable, diff_filter: Any, model: Any, args: list, kwargs: dict, state: Any) -> Any:
    """``(value, grads)`` of ``nnx_value_and_grad`` with the boundaries of
    ``state`` in force (``loss_scale.segment``), as ``nnx.grad`` gives them:
    the gradients an ``nnx.State`` of the variables ``diff_filter``
    selects, and the model's other variables updated as ``scaled`` left
    them (batch statistics, RNG counters). ``None`` when the loss function
    has no boundary."""
    graphdef, diff, rest = nnx.split(model, diff_filter, ...)

    def objective(diff, *args, **kwargs):
        # Fresh variables of this trace for the rest too (the model's own
        # may not be mutated from inside it).
        copy = nnx.merge(graphdef, diff, jax.tree.map(lambda x: x, rest))
        target, out = scaled(copy, *args, **kwargs)
        return target, (out, nnx.state(copy, nnx.Not(diff_filter)))

    segmented = SegmentedGradient.prepare(objective, 0, (diff, *args), kwargs, state)
    if segmented is None:
        return None
    grads, (out, updated) = segmented.plain()
    nnx.update(model, updated)
    return out, grads


def loss_of(out: Any, has_aux: bool) -> Any:
    """The loss in ``loss_fn``'s output, with ``jax.grad``'s error where
    ``has_aux`` is set and the output is not a ``(loss, aux)`` pair."""
    if not has_aux:
        return out
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise TypeError(
            f"expected function with aux output to return a two-element tuple, but got type {type(out)} with value "
            f"{out!r}"
        )
    return out[0]
