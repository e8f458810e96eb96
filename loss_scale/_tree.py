"""Tree utilities: the finite check, unscaling and zeros that the update needs.

Every function here treats only inexact (floating or complex) leaves as
gradients. Integer and boolean leaves carry no gradient signal and pass
through untouched; ``None`` and ``optax.MaskedNode`` are empty subtrees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def unscaled_leaf_finite(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Whether every element of ``unscale_leaf(x, scale)`` is finite.

    Computed from ``max|x|`` alone, by unscaling it exactly as the elements
    are unscaled: the unscale is monotone, so the largest unscaled magnitude
    comes from the largest scaled one. This stays exact when ``scale < 1``,
    where a finite gradient can overflow once divided.
    """
    return jnp.isfinite(unscale_leaf(max_abs(x), scale))


def leaf_finite_flags(tree: PyTree, scale: jax.Array) -> list[jax.Array]:
    """One bool scalar per floating leaf: is that leaf finite once unscaled."""
    return [unscaled_leaf_finite(x, scale) for x in jax.tree.leaves(tree) if is_float_leaf(x)]


def all_flags(flags: list[jax.Array]) -> jax.Array:
    """Logical and of scalar flags; ``True`` for an empty list."""
    if not flags:
        return jnp.array(True)
    return jnp.all(jnp.stack(flags))


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
    return all_flags([jnp.isfinite(max_abs(x)) for x in jax.tree.leaves(tree) if is_float_leaf(x)])


def unscale_leaf(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` computed in at least float32 and returned in ``x.dtype``."""
    if not is_float_leaf(x):
        return x
    dtype = compute_dtype(x.dtype)
    scale = scale.astype(dtype)
    # XLA rewrites x / s as x * (1 / s), and for s > 2**126 that reciprocal is
    # a float32 subnormal, which CPUs and GPUs flush to zero. For s > 1,
    # x * (4 / s) * 0.25 keeps the reciprocal normal and the last multiply is
    # exact: the same product as torch's x * (1 / s), without the flush.
    large = scale > 1
    reciprocal = jnp.where(large, 4 / scale, 1 / scale)
    correction = jnp.where(large, 0.25, 1.0).astype(dtype)
    return (x.astype(dtype) * reciprocal * correction).astype(x.dtype)


def unscale_tree(tree: PyTree, scale: jax.Array) -> PyTree:
    """``unscale_leaf`` over every floating leaf of ``tree``."""
    return jax.tree.map(lambda x: unscale_leaf(x, scale), tree)


def zeros_like_shapes(shapes: PyTree) -> PyTree:
    """Zeros with the shapes and dtypes of a tree of ``ShapeDtypeStruct``."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
