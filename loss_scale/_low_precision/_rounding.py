"""Rounding a float32 value to a narrower float: to nearest, stochastically,
and with Kahan compensation, plus the random bits stochastic rounding reads.

Everything here is elementwise and branch-free, written with operations
that are finite on finite operands (no bit casts of values computed from the
gradients), so that it fuses into the optimizer's own elementwise pass and
``ls.dynamic``'s select path keeps it.

Exactness of the updates. A new parameter ``q`` is always one of the two
values of the parameter's dtype next to ``x = float32(p) + y`` (``y`` a
float32 update), where ``x`` is itself computed in float32, and the update
returned is ``u = float32(q) - float32(p)``. Where ``q`` is within a few
binades of ``p``, or far below it (a near-total cancellation: ``x`` then is
``p + y`` exactly, on a grid that ``q`` shares), ``q - p`` is a float32
value and ``float32(p) + u == q`` exactly. Where ``q`` is many binades above
``p`` the difference is rounded, and ``float32(p) + u`` is ``q`` or a
float32 neighbour of it (near a power of two no float32 ``u`` gives ``q``
itself); a float32 unit is far below half a step of bfloat16 or float16,
so the cast to the parameter's dtype gives ``q``. Either way
``optax.apply_updates`` (which adds in float32 and casts) reproduces ``q``
bit for bit. The tests check it on hundreds of thousands of random values,
magnitudes from float16's subnormals to bfloat16's 2**60, updates from
2**-40 to 2**40 times the parameter and near-total cancellations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The parameter dtypes that get a rounded update (and a compensation buffer
# under "kahan"); wider floats are updated as the inner optimizer says.
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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


# Per rounded dtype: its explicit mantissa bits, and its smallest gap
# between neighbours (float16's subnormals are multiples of 2**-24;
# bfloat16's, below float32's smallest normal, are flushed to zero by
# float32 arithmetic on most hardware anyway, so its grid stops at 2**-126).
_FORMATS = {jnp.dtype(jnp.bfloat16): (7, 2.0**-126), jnp.dtype(jnp.float16): (10, 2.0**-24)}


def round_nearest(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` rounded to the nearest value of ``dtype`` (ties to even), as
    ``astype`` does."""
    return x.astype(dtype)


def _power_of_two_below(magnitude: jax.Array) -> jax.Array:
    """The largest power of two <= ``magnitude`` (float32, >= 0, finite),
    0 for 0: rounded to one significant bit it is that power or the next
    one, halved where it went up. Computed on half the magnitude, whose
    rounding up cannot overflow, and doubled (exact)."""
    half = magnitude * np.float32(0.5)
    power = jax.lax.reduce_precision(half, exponent_bits=8, mantissa_bits=0)
    return jnp.where(power > half, power * np.float32(0.5), power) * np.float32(2.0)


def round_stochastic(x: jax.Array, dtype: jnp.dtype, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to one of its two neighbours in ``dtype``
    (bfloat16 or float16), the upper one (in magnitude) with probability
    ``distance to the lower / gap``: the expected result is ``x`` itself.

    ``|x| / gap`` (``gap`` between the neighbours, a power of two: the
    division is exact) has at most ``23 - mantissa`` fractional bits; adding
    a uniform of exactly that many bits and taking the floor rounds up with
    exactly that probability, with no float32 rounding anywhere (below
    float16's normals, where ``|x| / gap`` can have more fractional bits,
    within 2**-13 of it). Float arithmetic only, no bit casts: every
    operation is finite on finite operands (or a division by the gap, a
    nonzero power of two), so ``ls.dynamic``'s select path keeps it, and XLA
    fuses the computation of ``x`` into it instead of keeping ``x`` in a
    float32 buffer.

    Values beyond the dtype's range become infinities, as in rounding to
    nearest (within one gap below it, with the probability of rounding up);
    infinities and NaNs stay what they are. A float32 or wider ``dtype`` is
    a cast.
    """
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return x.astype(dtype)
    mantissa, smallest_gap = _FORMATS[dtype]
    magnitude = jnp.abs(x)
    finite = jnp.isfinite(x)
    safe = jnp.where(finite, magnitude, np.float32(0.0))
    gap = jnp.maximum(_power_of_two_below(safe) * np.float32(2.0**-mantissa), np.float32(smallest_gap))
    fraction_bits = 23 - mantissa
    uniform = (bits >> (32 - fraction_bits)).astype(jnp.float32) * np.float32(2.0**-fraction_bits)
    rounded = jnp.floor(safe / gap + uniform) * gap
    # Zeros (of either sign), infinities and NaNs are their own rounding.
    rounded = jnp.where(finite & (x != 0), jnp.where(x < 0, -rounded, rounded), x)
    return rounded.astype(dtype)


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
