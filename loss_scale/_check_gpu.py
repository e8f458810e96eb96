"""The finite check as a GPU runs it.

XLA:GPU splits a reduction of a whole large array into two kernels, and a
reduction of its rows is one. So on CUDA and ROCm the check
(``_check._peak_of_batches``) reduces each big gradient leaf over its rows,
the small leaves a few per kernel, and reads every result once more in one
last reduction. ``lax.platform_dependent`` keeps this form out of every
other platform's program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def magnitude(x: jax.Array) -> jax.Array:
    """``|x|`` elementwise, in ``x``'s real dtype; for complex ``x`` the larger
    of ``|re|`` and ``|im|``, which is finite exactly when both parts are (and
    does not overflow where ``|re + i im|`` would)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.maximum(jnp.abs(jnp.real(x)), jnp.abs(jnp.imag(x)))
    return jnp.abs(x)


# A big leaf is reduced in two steps on a GPU (``_check._peak_of_batches``) only
# where its rows are at least this long: each row's result is written, copied
# and read once more, at most 12 bytes against at least 512 read for the row,
# so at most about 2% more traffic than reducing it whole.
MIN_PARTIAL_ROW = 256


def by_rows(part: jax.Array) -> bool:
    # A big leaf of two or more axes is a part [1, *shape]: its rows are
    # along the leaf's leading axis.
    return part.ndim >= 3 and part.size >= part.shape[1] * MIN_PARTIAL_ROW


def _magnitude_or_inf(x: jax.Array) -> jax.Array:
    """``|x|``, and ``inf`` where ``x`` is NaN: a float ``max`` over it is
    inf exactly when an element is not finite, and no NaN is left for the
    ``max`` to drop. One reduction of one array, the lightest a GPU runs.
    In ``x``'s real dtype where that holds an infinity, else float32 (which
    holds every magnitude of a narrower format exactly)."""
    x = jax.lax.stop_gradient(x)
    wide = _with_inf(x.dtype)
    return jnp.where(jnp.isnan(x), jnp.array(jnp.inf, wide), magnitude(x).astype(wide))


def _with_inf(dtype: jnp.dtype) -> jnp.dtype:
    """``dtype``'s real dtype where it holds an infinity, else float32 (the
    formats without one, float8 e4m3fn and narrower, are all smaller)."""
    real = jnp.finfo(dtype).dtype
    return real if np.isinf(np.array(np.inf).astype(real)) else jnp.dtype(jnp.float32)


# A batch of small leaves is reduced on a GPU at most this many leaves per
# kernel: a stack fused into the reduction that reads it is emitted as a
# choice among its operands at every element, whose code grows with their
# number (62 operands took LLVM half a second to compile).
SMALL_LEAVES_PER_KERNEL = 16


def _row_results(part: jax.Array) -> jax.Array:
    """A big leaf's row maxima (its leading axis kept), or its maximum."""
    first = 2 if by_rows(part) else 0
    return jnp.max(_magnitude_or_inf(part), axis=tuple(range(first, part.ndim))).reshape(-1)


def _small_results(leaves: list[jax.Array]) -> list[jax.Array]:
    """One maximum per small leaf of a batch: at most
    ``SMALL_LEAVES_PER_KERNEL`` of them flattened, zero-padded to the
    widest and stacked, one reduction each."""
    results = []
    for at in range(0, len(leaves), SMALL_LEAVES_PER_KERNEL):
        rows = [leaf.reshape(-1) for leaf in leaves[at : at + SMALL_LEAVES_PER_KERNEL]]
        width = max(row.size for row in rows)
        stacked = _magnitude_or_inf(jnp.stack([jnp.pad(row, (0, width - row.size)) for row in rows]))
        results.append(jnp.max(stacked, axis=1, initial=0.0))
    return results


def reduced_by_rows(groups: list[tuple[bool, list[jax.Array]]]) -> tuple[jax.Array, jax.Array]:
    """``(max|x|, all(isfinite(x)))`` over every element of ``groups``: per
    batch of the check, whether it is one big leaf, and its ``parts`` (the
    big leaf as ``[1, *shape]``, or the small leaves)."""
    dtype = jnp.finfo(groups[0][1][0].dtype).dtype  # the peak of complex leaves is real
    results = []
    for big, parts in groups:
        results += [_row_results(parts[0])] if big else _small_results(parts)
    # The results are one array, written by a kernel of its own (XLA emits
    # a concatenation operand by operand) and read by one more reduction;
    # fused into that reduction, a concatenation of a hundred operands took
    # LLVM seconds to compile (see SMALL_LEAVES_PER_KERNEL).
    (joined,) = jax.lax.optimization_barrier((jnp.concatenate(results),))
    peak = jnp.max(joined, initial=0.0)
    return peak.astype(dtype), jnp.isfinite(peak)
