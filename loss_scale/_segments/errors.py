"""``SegmentError`` and the messages of the analysis's two commonest
refusals: a boundary the optimizer does not know, and a 16-bit value whose
uses reach the loss at different scales."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

from loss_scale._probe import _describe
from loss_scale._segments.marker import call_site


class SegmentError(ValueError):
    """A loss function whose boundaries per-segment scaling cannot apply.

    Raised where the gradient functions (``loss_scale.value_and_grad``,
    ``loss_scale.value_grad_and_peak`` and their flax and Equinox versions)
    trace a loss function with the state of an optimizer built with
    ``segments``: a boundary whose name is not one of them (the message
    names the closest, and the error's traceback ends at the
    ``loss_scale.segment`` call), a 16-bit value used in two segments of
    different scales (a boundary inside one branch of a residual block), a
    boundary inside a ``while_loop``, a ``custom_vjp`` function or a nested
    ``scan``. The message names the value or the boundary, where the loss
    function makes it, and the fix. A ``ValueError``.

    Examples:
      >>> import jax.numpy as jnp, optax, loss_scale as ls
      >>> tx = ls.predictive(optax.sgd(0.1), segments=("encoder",))
      >>> params = {"w": jnp.ones(2)}
      >>> def loss_fn(p):
      ...     return jnp.sum(ls.segment(jnp.tanh(p["w"]), "encodr"))  # misspelt
      >>> try:
      ...     ls.value_and_grad(loss_fn)(tx.init(params), params)
      ... except ls.SegmentError as error:
      ...     print(error)
      <doctest ...>:2 (loss_fn): the loss function marks a boundary 'encodr' that
      is not one of the optimizer's segments ['encoder']. Did you mean 'encoder'?
      Otherwise add 'encodr' to the segments of loss_scale.predictive(...,
      segments=...).
    """


def undeclared(names: Sequence[str], name: str, eqn: Any) -> SegmentError:
    """The error for a boundary whose name is not one of the optimizer's
    segments ``names``, at the user's ``segment`` call: named in the
    message, and the last frame of the error's traceback (the analysis runs
    after the loss function was traced, so the call is no longer on the
    stack)."""
    where, traceback = call_site(eqn)
    close = difflib.get_close_matches(name, names, n=1)
    fix = f"Did you mean {close[0]!r}? Otherwise add" if close else "Add"
    error = SegmentError(
        f"{where or _describe(eqn, '')}: the loss function marks a boundary {name!r} that is not one of the "
        f"optimizer's segments {list(names)}. {fix} {name!r} to the segments of "
        "loss_scale.predictive(..., segments=...)."
    )
    return error.with_traceback(traceback)


def mixed(
    describe: Callable[[Any], str],
    var: Any,
    first: Any,
    second: Any,
    eqn: Any,
    kind: str,
    step: int | None = None,
) -> SegmentError:
    """The error for a 16-bit ``var`` whose uses reach the loss through
    segments of potentials ``first`` and ``second`` (in words:
    ``describe``). ``kind`` is what ``var`` is: ``"parameter"`` (a
    differentiated input), ``"activation"`` (computed by the loss function)
    or ``"value"`` (an input of a function the loss calls, which may be
    either); the fix differs."""
    where = f" ({_describe(eqn, '')})" if eqn is not None else ""
    at = f" at scan step {step}" if step is not None else ""
    dtype, shape = var.aval.dtype, tuple(var.aval.shape)
    if kind == "parameter":
        used_in = describe(second if not any(first) else first)
        return SegmentError(
            f"a parameter of dtype {dtype} and shape {shape} is used in segment {used_in}{at}{where}, and "
            f"per-segment scaling brings every parameter's gradient back to the global scale, which a {dtype} "
            "gradient cannot hold exactly. Keep parameters in float32 and cast them to float16 where they are "
            "used (the mixed-precision recipe)"
        )
    mixed = (
        f"of dtype {dtype} and shape {shape} is used in two segments of different scales{at} "
        f"({describe(first)}; {describe(second)}){where}: a boundary is on some of its paths to the "
        f"loss and not on others, so its cotangent would be the sum of cotangents of different scales, which a "
        f"{dtype} value cannot hold."
    )
    residual = (
        "put the boundary where every path from the value to the loss crosses it: for a boundary inside one "
        "branch of a residual block (h + f(h)), on the residual stream, after the residual addition "
        "(h = ls.segment(h + f(h), name)); or pass the value through the boundary with the branch's "
        "activations (ls.segment((out, h), name)) and use what it returns"
    )
    if kind == "activation":
        return SegmentError(
            f"an activation (a value the loss function computes, not a parameter) {mixed} "
            f"{residual[0].upper()}{residual[1:]}"
        )
    return SegmentError(
        f"a value {mixed} If it is an activation, {residual}. If it is a {dtype} parameter, keep it in float32 "
        "and cast it where it is used"
    )


def kind_of(var: Any, invars: Sequence[Any], seeded: set) -> str:
    """What ``var`` is, for ``mixed``: a parameter (seeded), a value handed
    in to the jaxpr whose inputs are ``invars``, or an activation (computed
    in it)."""
    if var in seeded:
        return "parameter"
    return "value" if var in invars else "activation"
