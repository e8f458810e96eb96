"""The finite check and the gradient statistics: the update's hot path.

One read of every gradient leaf decides whether the step is applied, and
gives the largest unscaled magnitude (which the predictive rule and the
metrics use); the optional statistics (norm, underflow fractions) reduce
over the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._sharding import axis_names, varying_axes
from loss_scale._types import AxisName, PyTree
from loss_scale._unscale import compute_dtype, is_float_leaf, unscale_leaf


def _magnitude(x: jax.Array) -> jax.Array:
    """``|x|`` elementwise, in ``x``'s real dtype; for complex ``x`` the larger
    of ``|re|`` and ``|im|``, which is finite exactly when both parts are (and
    does not overflow where ``|re + i im|`` would)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.maximum(jnp.abs(jnp.real(x)), jnp.abs(jnp.imag(x)))
    return jnp.abs(x)


def peak_and_finite(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(max|x|, all(isfinite(x)))`` of one floating leaf, in one pass.

    One variadic reduction reads each element once and yields both. The
    finite flag comes from ``isfinite`` and a logical and, whose results IEEE
    arithmetic fixes; it never relies on a float ``max`` propagating NaN,
    which XLA does not promise (on XLA:CPU, jaxlib 0.10.2, ``jnp.max`` over a
    float32 array of 4096 or more elements drops NaN: ``max|x|`` of
    ``ones(8192).at[100].set(nan)`` is 1.0). The peak is only meaningful when
    the flag is True; with a NaN present it may be anything.

    The peak is in ``x``'s real dtype (exact); complex leaves give the larger
    of ``|re|`` and ``|im|`` (see ``_magnitude``). A leaf with no elements is
    finite with peak 0.
    """
    magnitude = _magnitude(x)
    zero = jnp.zeros((), magnitude.dtype)
    peak, finite = jax.lax.reduce(
        (magnitude, jnp.isfinite(x)), (zero, jnp.array(True)), _max_and_all, tuple(range(x.ndim))
    )
    return peak, finite


def _max_and_all(a, b):
    # A module-level function, so that op-by-op calls reuse its compilation.
    return jnp.maximum(a[0], b[0]), jnp.logical_and(a[1], b[1])


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of every floating leaf of ``tree`` is finite.

    Each floating leaf is read once (``isfinite`` and a logical-and
    reduction: exact on every backend, whatever its float ``max`` does with
    NaN); integer and boolean leaves are ignored. An empty tree is finite.

    Args:
      tree: any pytree of arrays.

    Returns:
      A bool scalar: ``False`` when any inf or nan is present.

    Example:
      >>> import jax.numpy as jnp, loss_scale as ls
      >>> bool(ls.all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
      False
      >>> bool(ls.all_finite({"w": jnp.ones(8192).at[100].set(jnp.nan)}))
      False
    """
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if is_float_leaf(x)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


class GradStats(NamedTuple):
    """What one pass over the scaled gradients tells about the unscaled ones.

    Attributes:
      leaf_finite: bool[n], one flag per leaf of the gradient tree (in
        ``jax.tree.leaves`` order); non-floating leaves count as finite.
      grad_max: float32, the largest unscaled magnitude (inf when a gradient
        is not finite).
      sq_norm: float32, the squared global norm of the unscaled gradients, or
        ``None`` when it was not asked for.
      underflow: float32[2], the fractions of gradient elements that are
        exactly 0 and whose scaled magnitude is below float16's smallest
        normal (6.1e-5), or ``None`` when not asked for.
    """

    leaf_finite: jax.Array
    grad_max: jax.Array
    sq_norm: jax.Array | None
    underflow: jax.Array | None = None


FLOAT16_TINY = float(jnp.finfo(jnp.float16).tiny)


def gradient_stats(
    tree: PyTree,
    scale: jax.Array,
    with_norm: bool = False,
    with_underflow: bool = False,
    axis_name: AxisName | None = None,
) -> GradStats:
    """The finite check, the largest magnitude and optionally the norm and
    the underflow fractions.

    Each floating leaf is read once by ``peak_and_finite``; the optional
    statistics add reductions over the same values (XLA can fuse them into
    one read, but that depends on the backend).

    A leaf is finite once unscaled exactly when its elements are finite and
    its peak, unscaled as the elements are (in at least float32, then back to
    the leaf's dtype), is finite: the unscale is monotonic, so the largest
    unscaled magnitude is the unscaled largest magnitude. That catches a
    finite gradient that overflows when divided by a scale below 1.

    With ``axis_name`` (inside ``shard_map`` or ``pmap``) every replica gets
    the same flags and maximum, so all take the same branch and keep the same
    scale. The norm and the underflow counts add up the leaves that JAX types
    as varying along the axis (slices of a sharded parameter) over it; the
    others are replicated, and counted once.
    """
    leaves = jax.tree.leaves(tree)
    # Each leaf's max|x|, grouped by dtype and unscaled one group at a time:
    # one vector op per dtype rather than one scalar op (one GPU kernel) per leaf.
    groups: dict[jnp.dtype, list[tuple[int, jax.Array, jax.Array]]] = {}
    # Per-leaf sums (square norm, zeros, below float16's normal, elements),
    # split by whether they are summed over the axis.
    sums = {False: [], True: []}
    for i, x in enumerate(leaves):
        if not is_float_leaf(x):
            continue
        peak, finite = peak_and_finite(x)
        groups.setdefault(peak.dtype, []).append((i, peak, finite))
        if with_norm or with_underflow:
            row = []
            if with_norm:
                unscaled = unscale_leaf(x, scale).astype(compute_dtype(x.dtype))  # as the inner sees it
                row.append(jnp.sum(jnp.real(unscaled * jnp.conj(unscaled))).astype(jnp.float32))
            if with_underflow:
                magnitude = _magnitude(x)
                row += [
                    jnp.sum(magnitude == 0, dtype=jnp.float32),
                    jnp.sum(magnitude < FLOAT16_TINY, dtype=jnp.float32),
                    jnp.float32(x.size),
                ]
            sharded = axis_name is not None and bool(axis_names(axis_name) & varying_axes(jax.typeof(x)))
            sums[sharded].append(jnp.stack(row))
    order, flags, maxima = [], [], []
    for items in groups.values():
        unscaled = unscale_leaf(jnp.stack([peak for _, peak, _ in items]), scale)
        finite = jnp.stack([finite for _, _, finite in items]) & jnp.isfinite(unscaled)
        order += [i for i, _, _ in items]
        flags.append(finite)
        maxima.append(jnp.where(finite, unscaled.astype(jnp.float32), jnp.inf))
    taken = set(order)
    others = [i for i in range(len(leaves)) if i not in taken]  # non-floating leaves: finite
    flags.append(jnp.ones((len(others),), jnp.bool_))
    leaf_finite = jnp.concatenate(flags)
    if order + others != list(range(len(leaves))):
        leaf_finite = leaf_finite[np.argsort(order + others)]  # back to leaf order
    grad_max = jnp.max(jnp.concatenate(maxima)) if maxima else jnp.zeros((), jnp.float32)
    if axis_name is not None:
        leaf_finite = jax.lax.pmin(leaf_finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
        grad_max = jax.lax.pmax(grad_max, axis_name)
    width = int(with_norm) + 3 * int(with_underflow)
    totals = jnp.zeros((width,), jnp.float32)
    if sums[True]:
        totals = totals + jax.lax.psum(jnp.sum(jnp.stack(sums[True]), axis=0), axis_name)
    if sums[False]:
        totals = totals + jnp.sum(jnp.stack(sums[False]), axis=0)
    sq_norm = totals[0] if with_norm else None
    underflow = None
    if with_underflow:
        zeros, tiny, count = totals[width - 3], totals[width - 2], totals[width - 1]
        underflow = jnp.stack([zeros, tiny]) / jnp.maximum(count, 1)
    return GradStats(leaf_finite, grad_max, sq_norm, underflow)
