"""The finite check against the obvious implementation, ``numpy.isfinite``.

Every fast path that decides whether a step is skipped is compared with
numpy over leaf sizes from 1 to 2**20 (around 4096 especially, where
XLA:CPU's float ``max`` starts dropping NaN), every float dtype, each kind of
non-finite value at several positions, eagerly and under ``jit``. A check
that trusts a reduction's NaN propagation fails here.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loss_scale as ls
from loss_scale._check import gradient_stats, largest_magnitude

SIZES = [1, 3, 4095, 4096, 4097, 8192, 65537, 2**20 + 7]
REAL = ["float16", "bfloat16", "float32", "float64", "float8_e5m2", "float8_e4m3fn"]
COMPLEX = ["complex64", "complex128"]
KINDS = [np.nan, np.inf, -np.inf]
X64 = {"float64", "complex128"}


def np_dtype(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def positions(size):
    rng = np.random.default_rng(size)
    return sorted({0, size // 2, size - 1, int(rng.integers(size))})


def poisoned(size, dtype, index, value, imaginary=False):
    x = np.full(size, 0.5, np.float64).astype(dtype)
    if imaginary:
        x[index] = x[index] + 1j * value
    else:
        x[index] = value
    return x


def expected_finite(x):
    return bool(np.isfinite(np.asarray(x)).all())


@pytest.fixture(params=["eager", "jit"])
def mode(request):
    return request.param


def run(fn, mode):
    return jax.jit(fn) if mode == "jit" else fn


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", REAL + COMPLEX)
def test_all_finite_equals_numpy(size, dtype, mode):
    with jax.enable_x64(dtype in X64):
        dt = np_dtype(dtype)
        check, stats = run(ls.all_finite, mode), run(gradient_stats, mode)
        clean = np.full(size, 0.5, np.float64).astype(dt)
        if np.issubdtype(dt, np.complexfloating):
            # Finite, though |z| overflows: 3e38+3e38j is finite for numpy and for the check.
            top = float(np.finfo(dt).max)
            clean[-1] = top * 0.9 + 1j * top * 0.9
        else:
            clean[-1] = np.asarray(ml_dtypes.finfo(dt).max, dt)  # the largest finite value is finite
        # The clean array goes through the same two programs as the poisoned ones below.
        assert bool(check({"x": jnp.asarray(clean), "y": jnp.ones(3)})) is True
        flags = stats([jnp.ones(3), jnp.asarray(clean)], jnp.float32(1.0)).leaf_finite
        assert list(np.asarray(flags)) == [True, True]
        cases = 0
        for kind in KINDS:
            if np.isinf(kind) and dt == np_dtype("float8_e4m3fn"):
                continue  # no inf in this format: it would be stored as nan, tested above
            for index in positions(size):
                for imaginary in [False, True] if np.issubdtype(dt, np.complexfloating) else [False]:
                    x = poisoned(size, dt, index, kind, imaginary)
                    got = bool(check({"x": jnp.asarray(x), "y": jnp.ones(3)}))
                    assert got == expected_finite(x), (dtype, size, kind, index, imaginary, mode)
                    # The update's own check: one variadic reduction per leaf.
                    flags = stats([jnp.ones(3), jnp.asarray(x)], jnp.float32(2.0)).leaf_finite
                    assert list(np.asarray(flags)) == [True, expected_finite(x)], (dtype, size, kind, index, mode)
                    cases += 1
        assert cases >= 1


# Op by op, each update compiles its conditional anew: three sizes eagerly
# (the check itself is tested eagerly at every size above).
UPDATE_CASES = [
    (size, mode) for size in SIZES for mode in ["jit", "eager"] if mode == "jit" or size in (1, 4096, SIZES[-1])
]


@pytest.mark.parametrize(("size", "mode"), UPDATE_CASES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_update_skips_exactly_when_numpy_finds_a_non_finite_value(size, dtype, mode):
    with jax.enable_x64(dtype in X64):
        dt = np_dtype(dtype)
        params = {"x": jnp.zeros(size, dt), "y": jnp.zeros(3)}
        tx = ls.static(optax.sgd(1.0), scale=4.0)
        state = tx.init(params)
        update = run(tx.update, mode)
        where = positions(size) if mode == "jit" else positions(size)[1:2]
        for kind in [None, *KINDS]:
            for index in where if kind is not None else [0]:
                x = np.full(size, 2.0, np.float64).astype(dt)
                if kind is not None:
                    x[index] = kind
                updates, new_state = update({"x": jnp.asarray(x), "y": jnp.ones(3)}, state, params)
                skipped = not expected_finite(x)
                assert bool(new_state.skipped) == skipped, (dtype, size, kind, index, mode)
                assert bool(jnp.all(jnp.isfinite(updates["x"]))), (dtype, size, kind, index, mode)
                if not skipped:
                    np.testing.assert_array_equal(np.asarray(updates["x"], np.float64), -0.5)


@pytest.mark.parametrize("size", [1, 4097, 8192, 2**20 + 7])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_largest_magnitude_equals_numpy(size, dtype):
    # What value_grad_and_peak and range_report read a cotangent's peak with:
    # max|x| in float32, inf as soon as one element is not finite.
    with jax.enable_x64(dtype in X64):
        dt = np_dtype(dtype)
        largest = jax.jit(largest_magnitude)
        x = np.random.default_rng(size).normal(size=size).astype(dt)
        assert float(largest(jnp.asarray(x))) == float(np.float32(np.max(np.abs(x))))  # rounded to float32
        for kind in KINDS:
            for index in positions(size):
                poisoned = x.copy()
                poisoned[index] = kind
                assert float(largest(jnp.asarray(poisoned))) == np.inf, (dtype, size, kind, index)
        assert float(largest(jnp.zeros((0,), dt))) == 0.0


def numpy_unscale(x, scale):
    """torch's unscale: multiply by the float32 reciprocal, in at least float32."""
    wide = np.float64 if x.dtype == np.float64 else np.float32
    reciprocal = wide(np.float32(1 / np.float64(np.float32(scale))))
    with np.errstate(over="ignore"):  # an overflow to inf is the answer this oracle gives
        return (x.astype(wide) * reciprocal).astype(x.dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("scale", [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 2.0**15])
def test_overflow_in_the_unscale_is_a_skip_exactly_when_numpy_says_so(dtype, scale):
    # Magnitudes around the dtype's largest value: dividing by a scale below
    # 1 can overflow a finite gradient; dividing by one above 1 never does.
    dt = np_dtype(dtype)
    top = float(ml_dtypes.finfo(dt).max)
    rng = np.random.default_rng(int(scale * 1000))
    tx = ls.static(optax.sgd(1.0), scale=scale)
    state = tx.init({"x": jnp.zeros(5000, dt)})
    update = jax.jit(tx.update)
    for fraction in [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]:
        x = (rng.uniform(0, top * fraction, 5000)).astype(dt)
        x[rng.integers(5000)] = np.asarray(top * fraction, dt)
        expected = expected_finite(numpy_unscale(x, scale))
        updates, new_state = update({"x": jnp.asarray(x)}, state)
        assert bool(new_state.skipped) == (not expected), (dtype, scale, fraction)
        if expected:
            np.testing.assert_array_equal(np.asarray(-updates["x"]), numpy_unscale(x, scale))


def test_grad_max_is_the_largest_unscaled_magnitude_or_inf():
    x = np.random.default_rng(0).normal(size=8192).astype(np.float32)
    stats = jax.jit(gradient_stats)({"x": jnp.asarray(x)}, jnp.float32(4.0))
    assert float(stats.grad_max) == float(np.max(np.abs(x)) * np.float32(0.25))
    x[100] = np.nan
    stats = jax.jit(gradient_stats)({"x": jnp.asarray(x)}, jnp.float32(4.0))
    assert float(stats.grad_max) == np.inf and not bool(stats.leaf_finite[0])


SPECIALS = st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, 3e38, -3e38, 65504.0, 1e-8])


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    specials=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), SPECIALS), max_size=4),
    scale=st.sampled_from([0.5, 1.0, 3.0, 2.0**10]),
)
def test_hypothesis_check_equals_numpy(shape, dtype, specials, scale):
    dt = np_dtype(dtype)
    x = np.random.default_rng(len(specials)).normal(size=shape).astype(dt)
    flat = x.reshape(-1)
    with np.errstate(over="ignore"):  # a value past the dtype's range is meant to become inf
        for where, value in specials:
            flat[int(where * flat.size)] = value
    assert bool(ls.all_finite([jnp.asarray(x)])) == expected_finite(x)
    stats = gradient_stats([jnp.asarray(x), jnp.arange(3)], jnp.float32(scale))
    assert list(np.asarray(stats.leaf_finite)) == [expected_finite(numpy_unscale(x, scale)), True]
