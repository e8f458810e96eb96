"""Counters that stop at their dtype's largest value instead of wrapping.

A run long enough to count 2**31 steps (or a ``vmap`` over many models that
started from a restored state) must not see ``skipped_steps`` turn negative:
every counter of the state is advanced with ``increment``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def increment(count: jax.Array, by: jax.Array | bool | int = 1) -> jax.Array:
    """``count + by`` for an integer ``count`` and a ``by`` of 0 or more,
    held at ``count``'s dtype's largest value rather than wrapping.

    Examples:
      >>> import jax.numpy as jnp
      >>> from loss_scale._saturating import increment
      >>> increment(jnp.int32(2**31 - 1))
      Array(2147483647, dtype=int32)
      >>> increment(jnp.int32(3), jnp.array(False))
      Array(3, dtype=int32)
    """
    count = jnp.asarray(count)
    largest = jnp.iinfo(count.dtype).max
    by = jnp.asarray(by).astype(count.dtype)
    return jnp.where(count > largest - by, largest, count + by).astype(count.dtype)
