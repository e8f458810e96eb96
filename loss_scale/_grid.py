"""A float32 value rounded to a narrower float's grid without leaving
float32, in operations the compiler keeps.

``x.astype(bfloat16).astype(float32)`` rounds ``x`` in jax's semantics, but
XLA may compute in more precision than a program asks for
(``xla_allow_excess_precision``, on by default), and XLA:GPU deletes such a
float -> half -> float convert pair: the value read back is ``x`` itself.
XLA:CPU keeps the pair, so only the hardware shows it. Wherever a rounded
value is read again in float32 (an unscaled gradient the optimizer widens,
the peak the finite check compares, a Kahan compensation), the package
rounds with ``nearest_on_grid`` instead: ``lax.reduce_precision``, XLA's
own operation for this, which it keeps. A cast to a half dtype remains only
where the value is stored in it.

Casts that put a value into the dtype an operation computes in stay casts:
``ls.autocast``'s, ``range_report``'s ``compute_dtype``, a per-segment
rescale's return to the cotangent's dtype. Where XLA:GPU drops one of
those, it computes in more precision, exactly as it does in the user's own
half-precision program, which those features rewrite or report on.
``tests/test_rounding_kept.py`` runs the programs with every pair deleted
and requires the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The dtypes whose rounding ``reduce_precision`` gives: IEEE layouts with
# infinities. float8 formats differ (e4m3fn has no infinity and a largest
# value of 448, where its IEEE reading would overflow at 240) and round
# through a cast, as their own arithmetic does.
_IEEE = frozenset(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


def nearest_on_grid(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` rounded to the nearest value of ``dtype`` (ties to even), kept
    in ``x``'s dtype: bit for bit ``x.astype(dtype).astype(x.dtype)``
    (infinities beyond ``dtype``'s range, NaNs kept), on every backend.

    ``lax.reduce_precision`` gives bfloat16's rounding and float16's normal
    range; XLA's operation flushes float16's subnormals to zero, so below
    float16's smallest normal, where the grid is fixed at 2**-24, the value
    is ``round(x * 2**24) * 2**-24`` (powers of two: exact; ``round`` ties
    to even). A ``dtype`` at least as wide as ``x``'s returns ``x``; a
    float8 one is a cast round trip.

    Examples:
      >>> import jax.numpy as jnp
      >>> float(nearest_on_grid(jnp.float32(1.0 + 2.0**-9), jnp.bfloat16))
      1.0
      >>> float(nearest_on_grid(jnp.float32(3 * 2.0**-26), jnp.float16)) == 2.0**-24
      True
    """
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= x.dtype.itemsize:
        return x
    if dtype not in _IEEE:  # float8 formats: see _IEEE
        return x.astype(dtype).astype(x.dtype)
    finfo, wide = jnp.finfo(dtype), jnp.finfo(x.dtype)
    rounded = jax.lax.reduce_precision(x, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
    if finfo.minexp > wide.minexp:  # a narrower exponent range (float16): a fixed grid below its normals
        step = np.asarray(finfo.smallest_subnormal, x.dtype)
        fixed = jax.lax.round(x * (1 / step), jax.lax.RoundingMethod.TO_NEAREST_EVEN) * step
        rounded = jnp.where(jnp.abs(x) < np.asarray(finfo.smallest_normal, x.dtype), fixed, rounded)
    return rounded


def round_to(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` rounded to nearest in ``dtype`` and returned in it, as
    ``x.astype(dtype)``, for a value that a later operation may read back
    in a wider dtype: the rounding then happens on every backend (see the
    module's docstring)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating):
        x = nearest_on_grid(x, dtype)
    return x.astype(dtype)
