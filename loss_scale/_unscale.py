"""Dividing gradients by the loss scale, in at least float32.

Only inexact (floating or complex) leaves are gradients. Integer and boolean
leaves carry no gradient signal and pass through untouched; ``None`` and
``optax.MaskedNode`` are empty subtrees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from loss_scale._grid import round_to
from loss_scale._types import PyTree


def is_float_leaf(x: jax.Array) -> bool:
    """Whether ``x`` is an array whose values can be scaled (inexact dtype)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def unscale_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype in which a leaf of ``dtype`` is unscaled: at least float32.

    8- and 16-bit gradients are divided in float32 so that the division
    itself does not lose precision; float64 and complex stay as they are
    (float8 formats have no implicit promotion in JAX, hence no
    ``promote_types``).
    """
    if jnp.finfo(dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


# Scales above this have a float32 reciprocal below float32's smallest normal.
_LARGE_SCALE = 2.0**126


def _factors(scale: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """``(reciprocal, correction)`` with ``x / scale == x * reciprocal *
    correction`` in ``dtype`` (see ``unscaled_value``): scalars, computed once
    per dtype of a tree rather than once per leaf."""
    scale = scale.astype(dtype)
    large = scale > _LARGE_SCALE
    reciprocal = jnp.where(large, 2.0**64 / scale, 1 / scale)
    correction = jnp.where(large, 2.0**-64, 1.0).astype(dtype)
    return reciprocal, correction


def unscaled_value(x: jax.Array, scale: jax.Array, factors: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """``x / scale`` in ``unscale_dtype(x.dtype)`` (at least float32), as
    ``x * (1 / scale)`` with the reciprocal rounded to that dtype: torch's
    unscale, bit for bit.

    For a scale above 2**126 that reciprocal is a float32 subnormal, which
    CPUs and GPUs flush to zero; there ``x * (2**64 / scale) * 2**-64`` keeps
    the reciprocal normal. Its first product is at most ``|x| * 2**-62``, so
    no intermediate overflows (a split such as ``x * (4 / s) * 0.25`` would,
    for ``1 < s < 4`` and ``|x|`` near the dtype's largest value).
    ``factors``, from ``_factors(scale, unscale_dtype(x.dtype))``, saves
    recomputing them.
    """
    dtype = unscale_dtype(x.dtype)
    reciprocal, correction = factors if factors is not None else _factors(scale, dtype)
    return x.astype(dtype) * reciprocal * correction


def unscale_leaf(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` computed in at least float32 and returned in ``x.dtype``
    (rounded there on every backend: an optimizer that widens a half
    gradient reads the rounded value, ``_grid.round_to``)."""
    if not is_float_leaf(x):
        return x
    return round_to(unscaled_value(x, scale), x.dtype)


def unscale_tree(tree: PyTree, scale: jax.Array, clip_factor: jax.Array | None = None) -> PyTree:
    """``unscale_leaf`` over every floating leaf of ``tree``, then, with
    ``clip_factor`` (a float32 scalar, 1 when no clipping is needed), a
    multiplication by it in the same elementwise pass."""
    factors: dict[jnp.dtype, tuple[jax.Array, jax.Array]] = {}

    def leaf(x):
        if not is_float_leaf(x):
            return x
        dtype = unscale_dtype(x.dtype)
        if dtype not in factors:
            factors[dtype] = _factors(scale, dtype)
        value = unscaled_value(x, scale, factors[dtype])
        if clip_factor is not None:
            value = value * clip_factor.astype(dtype)
        return round_to(value, x.dtype)

    return jax.tree.map(leaf, tree)
