"""The segment marker and the two custom-VJP identities the per-segment
gradient is built from.

``segment(x, name)`` is an identity. Traced, it leaves one ``custom_vjp``
equation per call under the name scope ``loss_scale.segment[name]``, which
is how ``analysis.py`` finds the boundaries in a loss function's jaxpr; its
own backward pass is the identity too, so a marked model differentiated by
``jax.grad`` (or by a loss-scaling optimizer without segments) is exactly
the unmarked one. Only the per-segment gradient (``_segments.gradients``)
gives a marker its factor, by evaluating the jaxpr with ``rescaled`` in its
place.
"""

from __future__ import annotations

import os
import re
import types
from typing import Any

import jax
import jax.numpy as jnp

from loss_scale import _validate as validate
from loss_scale._types import PyTree

SCOPE = "loss_scale.segment"
# The last component of an equation's name stack, e.g.
# "Encoder/loss_scale.segment[encoder]" or "vmap(loss_scale.segment[encoder])".
_MARKER_SCOPE = re.compile(r"loss_scale\.segment\[([^\[\]/]+)\]\)*$")
_CUSTOM_VJP = ("custom_vjp_call", "custom_vjp_call_jaxpr")
# This package's directory: its frames are never the user's code.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@jax.custom_vjp
def _identity(leaves: list[jax.Array]) -> list[jax.Array]:
    return leaves


def _identity_fwd(leaves):
    return leaves, None


def _identity_bwd(_, cotangents):
    return (cotangents,)


_identity.defvjp(_identity_fwd, _identity_bwd)


def segment(x: PyTree, name: str) -> PyTree:
    """Marks a boundary in the backward pass: ``x`` and everything computed
    before it belong to segment ``name``, whose cotangents a per-segment
    loss scale (``loss_scale.predictive(..., segments=...)``) multiplies by
    a power of two of their own.

    The forward pass is the identity. In the backward pass, the cotangent
    of ``x`` is multiplied by the segment's factor ``2**e`` (``e`` kept in
    the optimizer state, chosen from measured peaks) before it flows on to
    what computed ``x``: a model whose later layers have large cotangents
    and whose early layers have small ones (a deep unnormalised network, a
    recurrent network unrolled far back in time, a large output head over a
    small embedding) gets a scale per part, where one global scale would
    overflow the first or flush the last to zero. Factors compound: below
    two boundaries the cotangents carry both factors. Every parameter's
    gradient is brought back to the global scale exactly (powers of two, in
    float32) where the parameter is used, so the optimizer sees gradients
    as with one scale.

    Outside a per-segment gradient (``jax.grad``, or a loss-scaling
    optimizer without ``segments``) the marker does nothing: its backward
    pass is the identity, and the compiled program is the unmarked one.
    It may be used inside ``jax.jit``, ``jax.checkpoint``, ``jax.vmap``,
    ``lax.cond`` and ``lax.scan`` bodies (a boundary crossed once per
    iteration compounds per iteration), in flax linen and NNX modules and
    in Equinox modules.

    Args:
      x: an array or a pytree of arrays (activations; or, for a parameter
        used on both sides of boundaries, the parameter itself, passed
        along with the activations, see the guide). Non-floating leaves
        pass through.
      name: the segment's name, one of the ``segments`` the optimizer was
        built with.

    Returns:
      ``x``, unchanged.

    Examples:
      >>> import jax, jax.numpy as jnp, loss_scale as ls
      >>> def loss_fn(w, x):
      ...     h = ls.segment(jnp.tanh(x @ w["embed"]), "embed")  # embed below, head above
      ...     return jnp.mean((h @ w["head"]) ** 2)
      >>> w = {"embed": jnp.ones((3, 4)), "head": jnp.ones((4, 2))}
      >>> grads = jax.grad(loss_fn)(w, jnp.ones((5, 3)))  # plain jax.grad: the marker does nothing
      >>> bool(jnp.all(grads["embed"] == jax.grad(lambda w, x: jnp.mean((jnp.tanh(x @ w["embed"]) @ w["head"]) ** 2))(
      ...     w, jnp.ones((5, 3)))["embed"]))
      True
    """
    validate.segment_name("name", name)
    leaves, tree = jax.tree.flatten(x)
    floating = [i for i, leaf in enumerate(leaves) if _is_floating(leaf)]
    if not floating:
        return x
    with jax.named_scope(f"{SCOPE}[{name}]"):
        marked = _identity([leaves[i] for i in floating])
    for i, leaf in zip(floating, marked, strict=True):
        leaves[i] = leaf
    return jax.tree.unflatten(tree, leaves)


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def marker_name(eqn: Any) -> str | None:
    """The segment name of a marker equation, ``None`` for any other."""
    if eqn.primitive.name not in _CUSTOM_VJP:
        return None
    match = _MARKER_SCOPE.search(str(eqn.source_info.name_stack))
    return match.group(1) if match else None


def call_site(eqn: Any) -> tuple[str | None, types.TracebackType | None]:
    """Where the user's code made ``eqn`` (for a marker: the line that
    calls ``segment``), found in the traceback JAX kept when tracing it: the
    innermost frame outside JAX and outside this package, as
    ``"path:line (function)"`` and as a one-frame traceback, so that an
    error raised later (the analysis runs after the loss function was
    traced) can end at that line. ``(None, None)`` when the traceback is not
    available."""
    try:
        from jax._src.source_info_util import is_user_filename

        tb = eqn.source_info.traceback.as_python_traceback()
    except Exception:  # a private helper moved, or no traceback was kept
        return None, None
    found = None
    while tb is not None:  # outermost frame first
        filename = tb.tb_frame.f_code.co_filename
        if is_user_filename(filename) and not os.path.abspath(filename).startswith(_PACKAGE):
            found = tb
        tb = tb.tb_next
    if found is None:
        return None, None
    code = found.tb_frame.f_code
    where = f"{code.co_filename}:{found.tb_lineno} ({code.co_name})"
    return where, types.TracebackType(None, found.tb_frame, found.tb_lasti, found.tb_lineno)


@jax.custom_vjp
def rescaled(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x``, whose cotangent is multiplied by ``factor`` (a float32 power of
    two) in the backward pass: in float32, then rounded to ``x``'s dtype,
    so that the product is exact wherever it fits that dtype."""
    return x


def _rescaled_fwd(x, factor):
    return x, factor


def _rescaled_bwd(factor, ct):
    return (ct.astype(jnp.promote_types(ct.dtype, jnp.float32)) * factor).astype(ct.dtype), jnp.zeros_like(factor)


rescaled.defvjp(_rescaled_fwd, _rescaled_bwd)


@jax.custom_vjp
def probed(x: jax.Array, probe: jax.Array) -> jax.Array:
    """``x``, whose backward pass also writes what its cotangent looked like
    into the "cotangent" of ``probe`` (float32[3], zeros): the largest
    magnitude (inf when an element is not finite), how many elements are
    exactly 0 and how many are below the smallest normal of ``x``'s dtype
    (flushed or subnormal). Not a linear map: only for a ``probe`` used
    once, read from ``jax.grad`` and never differentiated further."""
    return x


def _probed_fwd(x, probe):
    return x, None


def _probed_bwd(_, ct):
    ct = jax.lax.stop_gradient(ct)
    return ct, cotangent_stats(ct)


def cotangent_stats(x: jax.Array) -> jax.Array:
    """float32[3]: the largest magnitude of ``x`` (inf when an element is
    not finite), how many elements are exactly 0, and how many are below the
    smallest normal of ``x``'s dtype. One reduction for all of them (a
    kernel, not four): the peak and the finite flag as ``peak_and_finite``
    computes them, and the two counts."""
    magnitude = jnp.abs(x)
    tiny = jnp.finfo(x.dtype).tiny
    operands = (
        magnitude.astype(jnp.float32),
        jnp.isfinite(x),
        (magnitude == 0).astype(jnp.float32),
        (magnitude < tiny).astype(jnp.float32),
    )
    init = (jnp.float32(0), jnp.array(True), jnp.float32(0), jnp.float32(0))
    peak, finite, zeros, below = jax.lax.reduce(operands, init, _stats_of, tuple(range(x.ndim)))
    return jnp.stack([jnp.where(finite, peak, jnp.inf), zeros, below])


def _stats_of(a, b):
    return jnp.maximum(a[0], b[0]), jnp.logical_and(a[1], b[1]), a[2] + b[2], a[3] + b[3]


probed.defvjp(_probed_fwd, _probed_bwd)
