"""Rounding a float32 value to a narrower float: to nearest, stochastically,
and with Kahan compensation, plus the random bits stochastic rounding reads.

Everything here is elementwise and branch-free, so that it fuses into the
optimizer's own elementwise pass, and is made of operations that
``ls.dynamic``'s select path keeps (its bit casts are ``GUARDED`` there).

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

Roundings the compiler keeps. Where a rounded value is read again in
float32 (the update ``q - p``, Kahan's compensation ``y - update``), it is
computed on the narrower dtype's grid without leaving float32
(``nearest_on_grid`` in ``_grid.py``, ``stochastic_on_grid`` here): as a
cast round trip XLA:GPU would delete the rounding, the update would be the
unrounded delta and the compensation 0, and bfloat16 parameters would stop
moving under small updates with no error. ``tests/test_rounding_kept.py``
runs the programs with every such pair deleted, as XLA:GPU does. The only
casts to a half dtype are those of values stored in it (the rounded
moments, the compensation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._grid import nearest_on_grid

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


# The golden ratio's 32-bit step (odd: i * it is a bijection of uint32).
_GOLDEN = 0x9E3779B9


def random_bits(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 random bits of ``shape`` from ``seed`` (uint32[2], one stream).

    A counter-based generator in the manner of SplitMix: element ``i`` (in
    row-major order) gets ``mix(i * 0x9E3779B9 + seed[0]) ^ seed[1]``, one
    bijective hash of a Weyl sequence. With a uniform seed each element's
    bits are exactly uniform (the hash is a bijection), which is all that
    stochastic rounding's unbiasedness needs; across elements the hash's
    avalanche decorrelates them. They depend on the element's index and the
    seed alone, so the bits are the same on every device and under every
    sharding of the array. Cost: eight integer operations per element,
    recomputed in every loop that rounds a leaf (XLA:CPU fuses each output
    on its own): a second round of the hash showed as 0.03 to 0.06 of an
    update-bound training step, and a threefry hash per element costs about
    eight times as much. The seeds themselves come from ``jax.random``
    (threefry), one per leaf and step.
    """
    size = int(np.prod(shape, dtype=np.int64))
    if size >= 2**32:
        raise ValueError(f"stochastic rounding numbers the elements of a leaf in uint32: {shape} has too many")
    index = jax.lax.iota(jnp.uint32, size).reshape(shape)
    return _mix(index * jnp.uint32(_GOLDEN) + seed[0]) ^ seed[1]


def round_nearest(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` rounded to the nearest value of ``dtype`` (ties to even), as
    ``astype`` does: for a value stored in ``dtype``. Where the rounded
    value is read again in float32, use ``nearest_on_grid``."""
    return x.astype(dtype)


def round_stochastic(x: jax.Array, dtype: jnp.dtype, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to one of its two neighbours in ``dtype``
    (bfloat16 or float16), the upper one (in magnitude) with probability
    ``distance to the lower / gap``: the expected result is ``x`` itself.
    For a value stored in ``dtype``; ``stochastic_on_grid`` gives the same
    value in float32, and says how."""
    return stochastic_on_grid(x, dtype, bits).astype(dtype)


def stochastic_on_grid(x: jax.Array, dtype: jnp.dtype, bits: jax.Array) -> jax.Array:
    """``round_stochastic``'s value kept in float32 (``astype(dtype)`` of
    it is exact), in operations that XLA keeps (see the module's
    docstring).

    On the bits: a neighbour in ``dtype`` is a float32 whose low ``23 -
    mantissa`` bits are zero. Adding a uniform integer of that many bits to
    ``x``'s bits and clearing them carries into the kept bits (rounding away
    from zero; a carry out of the mantissa steps the exponent) with
    probability exactly ``(low bits) / 2**(23 - mantissa)``, the distance to
    the lower neighbour over the gap: unbiased, no float32 rounding
    anywhere, and five operations per element with the NaN check (a float
    formulation that finds the gap from the magnitude costs about twenty,
    which showed as a fifth of an update-bound training step on a CPU,
    ``benchmarks/low_precision.py --parts cost``). Below float16's
    smallest normal its grid is fixed (2**-24, coarser than ten mantissa
    bits there): ``floor(|x| / 2**-24 + uniform)``, exact within 2**-13 of a
    gap. bfloat16's subnormals are float32's with the low half cleared, so
    the bits give them too (where the hardware keeps float32 subnormals).

    Values beyond the dtype's range become infinities, as in rounding to
    nearest (within one gap below it, with the probability of rounding up;
    for bfloat16 the carry reaches the infinity's bits, for float16 a
    value above its largest is set to one); zeros, infinities and NaNs stay
    what they are (a NaN is selected back: its payload could carry into the
    sign). The bit casts have derivative zero, as rounding has;
    ``ls.dynamic``'s select path guards them (``GUARDED`` in ``_skip.py``).
    A float32 or wider ``dtype`` returns ``x``.
    """
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return x
    finfo = jnp.finfo(dtype)
    dropped = 23 - finfo.nmant
    offset = bits >> (32 - dropped)
    kept = jnp.uint32((0xFFFFFFFF << dropped) & 0xFFFFFFFF)
    word = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type((word + offset) & kept, jnp.float32)
    if finfo.minexp > jnp.finfo(jnp.float32).minexp:  # a narrower exponent than float32 (float16): a fixed grid below
        smallest_normal, step = np.float32(finfo.smallest_normal), np.float32(finfo.smallest_subnormal)
        magnitude = jnp.abs(x)
        uniform = offset.astype(jnp.float32) * np.float32(2.0**-dropped)
        fixed = jnp.floor(magnitude * (1 / step) + uniform) * step  # powers of two: exact
        # x's sign on the magnitude from its bits: a comparison would lose a
        # zero's sign, and a float32 subnormal's where the CPU treats it as 0.
        sign = word & jnp.uint32(0x80000000)
        signed = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(fixed, jnp.uint32) | sign, jnp.float32)
        rounded = jnp.where(magnitude < smallest_normal, signed, rounded)
    if finfo.maxexp < jnp.finfo(jnp.float32).maxexp:  # float16: above its largest value is an infinity
        infinity = jnp.where(x < 0, np.float32(-np.inf), np.float32(np.inf))
        rounded = jnp.where(jnp.abs(rounded) > np.float32(finfo.max), infinity, rounded)
    return jnp.where(x != x, x, rounded)


def update_nearest(p: jax.Array, delta: jax.Array) -> jax.Array:
    """The float32 update that moves ``p`` to ``p + delta`` rounded to
    nearest in ``p``'s dtype: what ``optax.apply_updates(p, delta)`` gives,
    with ``p + update`` exact."""
    p32 = p.astype(jnp.float32)
    return nearest_on_grid(p32 + delta, p.dtype) - p32


def update_stochastic(p: jax.Array, delta: jax.Array, bits: jax.Array) -> jax.Array:
    """The float32 update that moves ``p`` to ``p + delta`` rounded
    stochastically in ``p``'s dtype."""
    p32 = p.astype(jnp.float32)
    return stochastic_on_grid(p32 + delta, p.dtype, bits) - p32


def update_kahan(p: jax.Array, compensation: jax.Array, delta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(update, new compensation)``: the compensated sum ``y = delta +
    compensation`` is added to ``p`` and rounded to nearest; the new
    compensation is what that rounding lost, ``y - update`` (exact in
    float32 up to its own rounding, then rounded to nearest in the
    compensation's dtype). So ``p_new + c_new == p + c + delta`` up to
    ``c_new``'s rounding: no update is lost, however small against ``p``.
    The rounded sum is computed on the grid in float32
    (``nearest_on_grid``): as a cast round trip the compiler may skip the
    rounding, and the compensation would then always be 0.

    Where the new parameter is not finite (an overflow, a NaN update) the
    compensation is reset to 0 rather than carrying an infinity into every
    later step."""
    p32 = p.astype(jnp.float32)
    y = delta + compensation.astype(jnp.float32)
    update = nearest_on_grid(p32 + y, p.dtype) - p32
    residual = jnp.where(jnp.isfinite(update), y - update, 0.0)
    return update, residual.astype(compensation.dtype)
