"""Comparing pytrees of arrays in the tests: bit for bit, or within a stated
tolerance.

Every helper first checks that the two trees have the same structure, and
that each pair of leaves has the same shape and (unless ``check_dtypes=False``)
the same dtype; then it compares the values. A failure names the leaf by its
path (``jax.tree_util.keystr``), after ``what`` (the caller's context), and
shows both values.

* ``assert_trees_bitwise``: the same bits, element for element (a NaN equals
  only a NaN with the same payload; 0.0 and -0.0 differ).
* ``assert_trees_close``: ``|actual - expected| <= atol + rtol * |expected|``
  element by element, computed in float64, as ``np.testing.assert_allclose``
  (NaNs equal NaNs, an infinity only itself); ``rtol`` and ``atol`` may be
  functions of the leaf's dtype, for tolerances of a leaf's own rounding.
  ``rtol=0, atol=0`` is value equality.
* ``assert_trees_close_to_largest``: each element within ``rtol`` times the
  largest magnitude of its expected leaf (at least ``floor``), for values
  whose small elements carry the rounding of the large ones (sums in float16).

Leaves may be arrays, numpy arrays, numpy scalars, Python numbers (taken as
JAX takes them: ``jnp.asarray``, so a Python int is an int32 where 64-bit
mode is off), typed PRNG keys (compared by their key data, after their key
dtypes) and float0 arrays (which hold no bits: dtype and shape only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Tolerance = float | Callable[[np.dtype], float]


def _array(x: Any) -> Any:
    return x if hasattr(x, "dtype") else jnp.asarray(x)


def _numpy(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _leaf_pairs(actual: Any, expected: Any, what: str, check_dtypes: bool) -> Iterator[tuple[str, Any, Any]]:
    """``(message prefix, actual leaf, expected leaf)`` for each leaf, as
    numpy arrays, after checking the structures, shapes and dtypes."""
    actual_leaves, actual_def = jax.tree_util.tree_flatten_with_path(actual)
    expected_leaves, expected_def = jax.tree_util.tree_flatten_with_path(expected)
    assert actual_def == expected_def, (
        f"{what or 'trees'}: structures differ:\n  actual   {actual_def}\n  expected {expected_def}"
    )
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves, strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        a, e = _array(a), _array(e)
        if check_dtypes:
            assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != expected {e.dtype}"
        a, e = _numpy(a), _numpy(e)
        assert a.shape == e.shape, f"{where}: shape {a.shape} != expected {e.shape}"
        yield where, a, e


def assert_trees_bitwise(actual: Any, expected: Any, what: str = "") -> None:
    """``actual`` and ``expected`` hold the same bits: same structure, and
    each leaf the same dtype, shape and bytes."""
    for where, a, e in _leaf_pairs(actual, expected, what, check_dtypes=True):
        if a.dtype.itemsize == 0:  # float0: no bits to compare
            continue
        a_bytes = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, a.dtype.itemsize)
        e_bytes = np.ascontiguousarray(e).reshape(-1).view(np.uint8).reshape(e.size, e.dtype.itemsize)
        differ = np.any(a_bytes != e_bytes, axis=1)
        if differ.any():
            first = tuple(int(i) for i in np.unravel_index(int(np.argmax(differ)), a.shape))
            raise AssertionError(
                f"{where}: not bit for bit equal, {int(differ.sum())} of {a.size} elements differ "
                f"(first at {first}: {a[first]!r} != expected {e[first]!r})\n actual: {a!r}\n expected: {e!r}"
            )


def _tolerance(tol: Tolerance, dtype: np.dtype) -> float:
    return float(tol(dtype)) if callable(tol) else float(tol)


def assert_trees_close(
    actual: Any, expected: Any, *, rtol: Tolerance, atol: Tolerance, what: str = "", check_dtypes: bool = True
) -> None:
    """Each element of ``actual`` within ``atol + rtol * |expected|`` of
    ``expected``'s, in float64 (``np.testing.assert_allclose``). ``rtol`` and
    ``atol`` are numbers, or functions of the actual leaf's dtype."""
    for where, a, e in _leaf_pairs(actual, expected, what, check_dtypes):
        np.testing.assert_allclose(
            np.asarray(a, np.float64),
            np.asarray(e, np.float64),
            rtol=_tolerance(rtol, a.dtype),
            atol=_tolerance(atol, a.dtype),
            err_msg=where,
        )


def assert_trees_close_to_largest(
    actual: Any, expected: Any, *, rtol: float, floor: float = 0.0, what: str = "", check_dtypes: bool = True
) -> None:
    """Each element of ``actual`` within ``rtol * max(m, floor)`` of
    ``expected``'s, ``m`` the largest magnitude in the expected leaf, in
    float64."""
    for where, a, e in _leaf_pairs(actual, expected, what, check_dtypes):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        atol = rtol * max(float(np.abs(e).max(initial=0.0)), floor)
        np.testing.assert_allclose(a, e, rtol=0, atol=atol, err_msg=where)
