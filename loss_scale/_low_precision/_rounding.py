"""Rounding a float32 value to a narrower float: to nearest, stochastically,
and with Kahan compensation, plus the random bits stochastic rounding reads.

Everything here is elementwise and branch-free (no ``cond``, no division),
so that it fuses into the optimizer's own elementwise pass and runs as it is
under ``ls.dynamic``'s select path.

Exactness of the updates. A new parameter ``q`` is always one of the two
values of the parameter's dtype next to ``x = float32(p) + y`` (``y`` a
float32 update), where ``x`` is itself computed in float32. For such a
``q``, ``q - p`` is a float32 value (no rounding), so ``u = float32(q) -
float32(p)`` gives ``float32(p) + u == q`` exactly: ``optax.apply_updates``
(which adds in float32 and casts to the parameter's dtype) reproduces ``q``
bit for bit. The tests check it over millions of random values, magnitudes
from float16's subnormals to bfloat16's 2**60 and near-total cancellations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The parameter dtypes that get a rounded update (and a compensation buffer
# under "kahan"); wider floats are updated as the inner optimizer says.
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def is_half(x: object) -> bool:
    """Whether ``x`` is a bfloat16 or float16 array (or tracer)."""
    return getattr(x, "dtype", None) in HALF_DTYPES


def _mix(x: jax.Array) -> jax.Array:
    """A bijective 32-bit integer hash with good avalanche (Wellons's
    "lowbias32"): a few multiplies, shifts and xors per element."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def random_bits(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 random bits of ``shape`` from ``seed`` (uint32[2], one stream).

    A counter-based generator: element ``i`` (in row-major order) gets
    ``mix(mix(i ^ seed[0]) + seed[1])``. It depends on the element's index
    and the seed alone, so the bits are the same on every device and under
    every sharding of the array, and cost a dozen integer operations per
    element (a threefry hash per element costs about eight times that,
    which would dominate the optimizer step on a CPU). The seeds themselves
    come from ``jax.random`` (threefry), one per leaf and step.
    """
    size = int(np.prod(shape, dtype=np.int64))
    if size >= 2**32:
        raise ValueError(f"stochastic rounding numbers the elements of a leaf in uint32: {shape} has too many")
    index = jax.lax.iota(jnp.uint32, size).reshape(shape)
    return _mix(_mix(index ^ seed[0]) + seed[1])


def _uniform(bits: jax.Array) -> jax.Array:
    """float32 in [0, 1), multiples of 2**-24, from uint32 bits."""
    return (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def _toward(a: jax.Array, x: jax.Array) -> jax.Array:
    """The value of ``a``'s dtype next to ``a`` on the side of ``x``, for
    ``a`` the nearest value to ``x``: one step of the bit pattern away from
    zero where ``|x| > |a|``, toward zero where ``|x| < |a|`` (so ``a`` is
    not 0 there). A zero ``a`` keeps ``x``'s sign, so its step away is the
    smallest subnormal on ``x``'s side."""
    unsigned = _UNSIGNED[a.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(a, unsigned)
    away = jnp.abs(x) > jnp.abs(a.astype(jnp.float32))
    one = jnp.asarray(1, unsigned)
    return jax.lax.bitcast_convert_type(jnp.where(away, bits + one, bits - one), a.dtype)


def round_nearest(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` rounded to the nearest value of ``dtype`` (ties to even), as
    ``astype`` does."""
    return x.astype(dtype)


def round_stochastic(x: jax.Array, dtype: jnp.dtype, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to one of its two neighbours in ``dtype``,
    the farther one with probability ``distance to the nearer / gap``: the
    expected result is ``x`` itself.

    The rounding error ``x - nearest`` and the gap between the neighbours (a
    power of two) are exact in float32, and the comparison ``uniform * gap <
    |error|`` needs no division; a uniform in multiples of 2**-24 makes the
    probability exact wherever the error has at most 24 significant bits
    relative to the gap (always from float32 to bfloat16 or float16 normals).
    A value that rounds to an infinity (beyond the dtype's range) or a NaN
    stays what rounding to nearest gives. ``dtype`` float32 or wider: a cast.
    """
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return x.astype(dtype)
    nearest = x.astype(dtype)
    error = jnp.abs(x - nearest.astype(jnp.float32))
    other = _toward(nearest, x)
    gap = jnp.abs(other.astype(jnp.float32) - nearest.astype(jnp.float32))
    farther = (_uniform(bits) * gap < error) & jnp.isfinite(nearest)
    return jnp.where(farther, other, nearest)


def update_nearest(p: jax.Array, delta: jax.Array) -> jax.Array:
    """The float32 update that moves ``p`` to ``p + delta`` rounded to
    nearest in ``p``'s dtype: what ``optax.apply_updates(p, delta)`` gives,
    with ``p + update`` exact."""
    p32 = p.astype(jnp.float32)
    return round_nearest(p32 + delta, p.dtype).astype(jnp.float32) - p32


def update_stochastic(p: jax.Array, delta: jax.Array, bits: jax.Array) -> jax.Array:
    """The float32 update that moves ``p`` to ``p + delta`` rounded
    stochastically in ``p``'s dtype."""
    p32 = p.astype(jnp.float32)
    return round_stochastic(p32 + delta, p.dtype, bits).astype(jnp.float32) - p32


def update_kahan(p: jax.Array, compensation: jax.Array, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(update, new compensation)``: the compensated sum ``y = delta +
    compensation`` is added to ``p`` and rounded to nearest; the new
    compensation is what that rounding lost, ``y - update`` (exact in
    float32 up to its own rounding, then rounded to nearest in the
    compensation's dtype). So ``p_new + c_new == p + c + delta`` up to
    ``c_new``'s rounding: no update is lost, however small against ``p``.

    Where the new parameter is not finite (an overflow, a NaN update) the
    compensation is reset to 0 rather than carrying an infinity into every
    later step."""
    p32 = p.astype(jnp.float32)
    y = delta + compensation.astype(jnp.float32)
    update = round_nearest(p32 + y, p.dtype).astype(jnp.float32) - p32
    residual = jnp.where(jnp.isfinite(update), y - update, 0.0)
    return update, residual.astype(compensation.dtype)
