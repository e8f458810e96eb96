"""Types along ``shard_map``'s manual axes: which axes a value varies
along, and making both branches of a conditional agree on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from loss_scale._types import AxisName, PyTree


def axis_names(axis_name: AxisName) -> set:
    """The names in ``axis_name`` (one name, or a tuple of them)."""
    return set(axis_name) if isinstance(axis_name, tuple) else {axis_name}


def varying_axes(x) -> frozenset:
    """The manual mesh axes (``shard_map``) along which the type ``x`` varies
    (empty outside ``shard_map`` and with ``check_vma=False``)."""
    manual = getattr(x, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(x, "vma", None) or ())


def match_varying(x: jax.Array, like) -> jax.Array:
    """``x`` marked as varying along the ``shard_map`` axes ``like`` varies
    along, so that both branches of a ``lax.cond`` have the same type. Only
    the type changes, never the values."""
    return vary_along(x, varying_axes(like))


def vary_along(x: jax.Array, axes: frozenset) -> jax.Array:
    """``x`` marked as varying along the ``shard_map`` axes ``axes`` (and
    those it varies along already); the values do not change."""
    missing = axes - varying_axes(jax.typeof(x))
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
