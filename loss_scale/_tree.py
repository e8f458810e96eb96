"""Tree utilities: the finite check, unscaling and zeros that the update needs.

Every function here treats only inexact (floating or complex) leaves as
gradients. Integer and boolean leaves carry no gradient signal and pass
through untouched; ``None`` and ``optax.MaskedNode`` are empty subtrees.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._types import PyTree


def is_float_leaf(x: jax.Array) -> bool:
    """Whether ``x`` is an array whose values can be scaled (inexact dtype)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype in which a leaf of ``dtype`` is unscaled: at least float32.

    16-bit gradients are divided in float32 so that the division itself does
    not lose precision; float64 stays float64.
    """
    return jnp.promote_types(dtype, jnp.float32)


def max_abs(x: jax.Array) -> jax.Array:
    """``max(|x|)`` in ``x``'s own dtype (exact); NaN anywhere gives NaN.

    A max reads each element once and XLA can fuse it with the op that
    produced ``x``, which makes it the cheapest complete inf/nan detector: the
    max of the magnitudes is finite exactly when every element is.
    """
    if x.size == 0:
        return jnp.zeros((), jnp.real(x).dtype)
    return jnp.max(jnp.abs(x))


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of every floating leaf of ``tree`` is finite.

    One reduction per leaf (``max|x|``), read once; integer leaves are
    ignored. An empty tree is finite.

    Args:
      tree: any pytree of arrays.

    Returns:
      A bool scalar: ``False`` when any inf or nan is present.

    Example:
      >>> import jax.numpy as jnp, loss_scale as ls
      >>> bool(ls.all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    flags = [jnp.isfinite(max_abs(x)) for x in jax.tree.leaves(tree) if is_float_leaf(x)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def unscaled_value(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` in ``compute_dtype(x.dtype)`` (at least float32)."""
    dtype = compute_dtype(x.dtype)
    scale = scale.astype(dtype)
    # XLA rewrites x / s as x * (1 / s), and for s > 2**126 that reciprocal is
    # a float32 subnormal, which CPUs and GPUs flush to zero. For s > 1,
    # x * (4 / s) * 0.25 keeps the reciprocal normal and the last multiply is
    # exact: the same product as torch's x * (1 / s), without the flush.
    large = scale > 1
    reciprocal = jnp.where(large, 4 / scale, 1 / scale)
    correction = jnp.where(large, 0.25, 1.0).astype(dtype)
    return x.astype(dtype) * reciprocal * correction


def unscale_leaf(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` computed in at least float32 and returned in ``x.dtype``."""
    if not is_float_leaf(x):
        return x
    return unscaled_value(x, scale).astype(x.dtype)


def unscale_tree(tree: PyTree, scale: jax.Array) -> PyTree:
    """``unscale_leaf`` over every floating leaf of ``tree``."""
    return jax.tree.map(lambda x: unscale_leaf(x, scale), tree)


def _varying_axes(x) -> frozenset:
    """The manual mesh axes (``shard_map``) along which ``x``'s type varies."""
    manual = getattr(x, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(x, "vma", ()))


def match_varying(x: jax.Array, like) -> jax.Array:
    """``x`` marked as varying along the ``shard_map`` axes ``like`` varies
    along, so that both branches of a ``lax.cond`` have the same type. Only
    the type changes, never the values."""
    missing = _varying_axes(like) - _varying_axes(jax.typeof(x))
    if not missing:
        return x
    cast = getattr(jax.lax, "pcast", None)
    if cast is not None:
        return cast(x, tuple(sorted(missing)), to="varying")
    return jax.lax.pvary(x, tuple(sorted(missing)))


def zeros_like_shapes(shapes: PyTree) -> PyTree:
    """Zeros with the shapes, dtypes (and ``shard_map`` axis types) of a tree
    of ``ShapeDtypeStruct``."""
    return jax.tree.map(lambda s: match_varying(jnp.zeros(s.shape, s.dtype), s), shapes)


class GradStats(NamedTuple):
    """What one pass over the scaled gradients tells about the unscaled ones.

    Attributes:
      leaf_finite: bool[n], one flag per leaf of the gradient tree (in
        ``jax.tree.leaves`` order); non-floating leaves count as finite.
      grad_max: float32, the largest unscaled magnitude (inf or nan when a
        gradient is not finite).
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


def gradient_stats(tree: PyTree, scale: jax.Array, with_norm: bool = False, with_underflow: bool = False) -> GradStats:
    """The finite check, the largest magnitude and optionally the norm and
    the underflow fractions.

    Each floating leaf is reduced once with ``max|x|``; the optional
    statistics add reductions over the same values (XLA can fuse them into
    one read, but that depends on the backend).
    """
    leaves = jax.tree.leaves(tree)
    # Each leaf's max|x|, grouped by dtype and unscaled one group at a time:
    # one vector op per dtype rather than one scalar op (one GPU kernel) per leaf.
    groups: dict[jnp.dtype, list[tuple[int, jax.Array]]] = {}
    squares, zeros, tiny, count = [], [], [], 0
    for i, x in enumerate(leaves):
        if not is_float_leaf(x):
            continue
        peak = max_abs(x)
        groups.setdefault(peak.dtype, []).append((i, peak))
        if with_norm:
            unscaled = unscale_leaf(x, scale).astype(compute_dtype(x.dtype))  # as the inner sees it
            squares.append(jnp.sum(jnp.real(unscaled * jnp.conj(unscaled))).astype(jnp.float32))
        if with_underflow:
            magnitude = jnp.abs(x)
            zeros.append(jnp.sum(magnitude == 0, dtype=jnp.int32))
            tiny.append(jnp.sum(magnitude < FLOAT16_TINY, dtype=jnp.int32))
            count += x.size
    order, flags, maxima = [], [], []
    for items in groups.values():
        # The same unscale as the elements get (in at least float32, back to
        # the leaf's dtype), so a maximum that overflows its dtype once
        # unscaled is caught as the elements would be.
        unscaled = unscale_leaf(jnp.stack([peak for _, peak in items]), scale)
        order += [i for i, _ in items]
        flags.append(jnp.isfinite(unscaled))
        maxima.append(unscaled.astype(jnp.float32))
    taken = set(order)
    others = [i for i in range(len(leaves)) if i not in taken]  # non-floating leaves: finite
    flags.append(jnp.ones((len(others),), jnp.bool_))
    leaf_finite = jnp.concatenate(flags)
    if order + others != list(range(len(leaves))):
        leaf_finite = leaf_finite[np.argsort(order + others)]  # back to leaf order
    grad_max = jnp.max(jnp.concatenate(maxima)) if maxima else jnp.zeros((), jnp.float32)
    sq_norm = (sum(squares) if squares else jnp.zeros((), jnp.float32)) if with_norm else None
    underflow = None
    if with_underflow:
        counts = jnp.stack([sum(zeros, jnp.int32(0)), sum(tiny, jnp.int32(0))]).astype(jnp.float32)
        underflow = counts / max(count, 1)
    return GradStats(leaf_finite, grad_max, sq_norm, underflow)


def unscale_and_clip_tree(tree: PyTree, scale: jax.Array, clip_factor: jax.Array | None) -> PyTree:
    """``unscale_tree``, then a multiplication by ``clip_factor`` (a float32
    scalar, 1 when no clipping is needed) in the same elementwise pass."""
    if clip_factor is None:
        return unscale_tree(tree, scale)

    def leaf(x):
        if not is_float_leaf(x):
            return x
        return (unscaled_value(x, scale) * clip_factor.astype(compute_dtype(x.dtype))).astype(x.dtype)

    return jax.tree.map(leaf, tree)
