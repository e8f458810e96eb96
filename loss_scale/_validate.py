"""Every check of a user's setting, in one place.

Each function takes the name of the argument as the user wrote it (a
preset passes its peer's name: ``init_scale``, ``loss_scale_window``) and
the value, and returns the value as the rule will use it, or raises a
``TypeError`` (wrong type) or ``ValueError`` (out of range) that names the
argument and the value. Values are checked in the dtype the rule computes
in: scales and factors in float32, counters in int32. So a setting that is
accepted cannot fail later, and no setting silently becomes something else
(a scale of 1e39 would be inf in float32, 1e-46 would be 0, a factor of
1 + 1e-9 would be 1).

Settings are Python numbers (or NumPy scalars, or concrete 0-d arrays):
strings such as ``"1024"``, ``bool`` (``True`` is not a scale of 1) and
traced values are refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loss_scale._types import LOSS_SEGMENT

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
INT32_MAX = int(np.iinfo(np.int32).max)


def _number(name: str, value: Any, kind: str) -> Any:
    """``value`` as a Python or NumPy scalar, or a TypeError naming ``name``."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a concrete number (settings are fixed when the optimizer is built), got a traced value"
        )
    if isinstance(value, np.ndarray | jax.Array) and value.shape == ():
        value = value.item()
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind}, got {value!r} of type {type(value).__name__}")
    return value


def real(name: str, value: Any) -> float:
    """A real number (int or float, not NaN)."""
    number = float(_number(name, value, "a real number"))
    if math.isnan(number):
        raise ValueError(f"{name} must be a number, got nan")
    return number


def _float32(number: float) -> float:
    """``number`` rounded to float32 (inf beyond its range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(number))


def scale(name: str, value: Any, *, allow_inf: bool = False) -> float:
    """A loss scale: a positive normal float32 (from float32's smallest normal,
    about 1.2e-38, to its largest value, about 3.4e38), or ``inf`` where
    ``allow_inf`` (a ceiling). Returns its float32 value."""
    number = _number(name, value, "a real number")
    number = float(number)
    if allow_inf and number == math.inf:
        return number
    inf_note = " (inf allowed)" if allow_inf else ""
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be finite and > 0{inf_note}, got {value!r}")
    rounded = _float32(number)
    if not math.isfinite(rounded):
        raise ValueError(f"{name} must be at most float32's largest value ({FLOAT32_MAX:g}), got {value!r}")
    if rounded < FLOAT32_TINY:
        raise ValueError(
            f"{name} must be at least float32's smallest normal ({FLOAT32_TINY:g}), got {value!r} "
            f"(in float32: {rounded!r})"
        )
    return rounded


def growth_factor(name: str, value: Any) -> float:
    """A factor > 1 in float32 (finite). Returns its float32 value."""
    number = real(name, value)
    rounded = _float32(number)
    if not rounded > 1:
        note = f" (in float32 it is {rounded!r})" if number > 1 else ""
        raise ValueError(f"{name} must be > 1, got {value!r}{note}")
    if not math.isfinite(rounded):
        raise ValueError(f"{name} must be at most float32's largest value ({FLOAT32_MAX:g}), got {value!r}")
    return rounded


def backoff_factor(name: str, value: Any) -> float:
    """A factor in (0, 1) in float32, at least float32's smallest normal.
    Returns its float32 value."""
    number = real(name, value)
    rounded = _float32(number)
    if not 0 < rounded < 1 or number <= 0:
        note = f" (in float32 it is {rounded!r})" if 0 < number < 1 else ""
        raise ValueError(f"{name} must be in (0, 1), got {value!r}{note}")
    if rounded < FLOAT32_TINY:
        raise ValueError(f"{name} must be at least float32's smallest normal ({FLOAT32_TINY:g}), got {value!r}")
    return rounded


def positive(name: str, value: Any) -> float:
    """A finite number > 0 that is a normal float32 (a threshold such as a
    gradient norm). Returns its float32 value."""
    return scale(name, value)


def count(name: str, value: Any, minimum: int = 1, maximum: int = INT32_MAX, *, integral_float: bool = False) -> int:
    """An int in ``[minimum, maximum]`` (int32 by default, the counters'
    dtype). ``integral_float`` also takes ``1000.0``, for peers that type the
    setting as a float."""
    if integral_float and isinstance(value, float | np.floating) and float(value).is_integer():
        value = int(value)
    if isinstance(value, jax.core.Tracer | bool | np.bool_):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if isinstance(value, np.ndarray | jax.Array) and value.shape == () and jnp.issubdtype(value.dtype, jnp.integer):
        value = value.item()
    if not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if value > maximum:
        limit = "2**31 - 1, the largest int32" if maximum == INT32_MAX else str(maximum)
        raise ValueError(f"{name} must be <= {limit}, got {value!r}")
    return value


def flag(name: str, value: Any) -> bool:
    """A bool (``True``/``False`` or a NumPy bool)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def optional(check, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    """``None``, or ``check(name, value, ...)``."""
    return None if value is None else check(name, value, *args, **kwargs)


def axis_name(name: str, value: Any) -> Hashable | None:
    """``None`` or a mesh axis name: a hashable (a str, or a tuple of them)."""
    if value is None:
        return None
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{name} must be an axis name (a str or a tuple of them) or None, got {value!r}") from None
    if isinstance(value, bool | int | float):
        raise TypeError(f"{name} must be an axis name (a str or a tuple of them) or None, got {value!r}")
    return value


def scale_range(
    initial: tuple[str, Any], minimum: tuple[str, Any], maximum: tuple[str, Any]
) -> tuple[float, float, float]:
    """The initial, minimum and maximum scale, each a ``(name, value)`` pair,
    checked by ``scale`` (the maximum may be inf) and by ``scale_bounds``;
    returns their float32 values."""
    initial_value = scale(*initial)
    min_value = scale(*minimum)
    max_value = scale(*maximum, allow_inf=True)
    scale_bounds((initial[0], initial_value), (minimum[0], min_value), (maximum[0], max_value))
    return initial_value, min_value, max_value


def scale_bounds(initial: tuple[str, float], minimum: tuple[str, float], maximum: tuple[str, float]) -> None:
    """``minimum <= initial <= maximum``, each a ``(name, float32 value)``
    pair already checked by ``scale``."""
    (initial_name, initial_value), (min_name, min_value), (max_name, max_value) = initial, minimum, maximum
    if min_value > max_value:
        raise ValueError(f"{min_name} ({min_value!r}) must be <= {max_name} ({max_value!r})")
    if not min_value <= initial_value <= max_value:
        raise ValueError(
            f"{initial_name} must lie in [{min_name}, {max_name}] = [{min_value!r}, {max_value!r}], "
            f"got {initial_value!r}"
        )


def floating_dtype(name: str, value: Any) -> np.dtype:
    """A floating dtype, from a dtype, a scalar type or a NumPy name;
    ``None`` is refused (NumPy would read it as float64)."""
    if value is None:
        raise TypeError(f"{name} must be a dtype or a dtype name, got None")
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"{name} must be a dtype or a dtype name, got {value!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {dtype}")
    return dtype


def segment_name(name: str, value: Any) -> str:
    """A boundary's name (``loss_scale.segment``): a non-empty string
    without ``[``, ``]`` or ``/`` (they delimit JAX's name scopes), other
    than ``"loss"``, which names the loss's own segment."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty string, got {value!r}")
    if set(value) & set("[]/"):
        raise ValueError(f"{name} may not contain '[', ']' or '/', got {value!r}")
    if value == LOSS_SEGMENT:
        raise ValueError(
            f"{name}: {LOSS_SEGMENT!r} names the segment that holds the loss (the values no boundary separates "
            "from it); choose another name for a boundary"
        )
    return value


def segment_names(name: str, value: Any) -> tuple[str, ...]:
    """The boundaries of per-segment scaling: a non-empty sequence of
    distinct ``segment_name``s (not one string), sorted."""
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a sequence of segment names, e.g. ('embed', 'rnn'), got {value!r}")
    names = [segment_name(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if not names:
        raise ValueError(f"{name} must name at least one segment (leave it None for one global scale)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{name} names {repeated} more than once")
    return tuple(sorted(names))
