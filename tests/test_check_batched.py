"""The check over trees of many small leaves, which it reduces a few at a
time (stacked and zero-padded), against numpy leaf by leaf: flags, the
largest magnitude, the norm and the underflow fractions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loss_scale import _check, _check_gpu
from loss_scale._check import SMALL_LEAF, gradient_stats

F16_TINY = float(np.finfo(np.float16).tiny)


def numpy_stats(leaves, scale):
    """The obvious implementation: every statistic of every leaf, in float64."""
    finite, peaks, squares, zeros, tiny, count = [], [], 0.0, 0, 0, 0
    for x in leaves:
        if not jnp.issubdtype(x.dtype, jnp.floating):  # numpy does not count bfloat16 as floating
            finite.append(True)
            continue
        with np.errstate(over="ignore"):  # an overflow to inf is the answer
            unscaled = (x.astype(np.float32) * np.float32(1 / np.float64(np.float32(scale)))).astype(x.dtype)
        ok = bool(np.isfinite(unscaled).all())
        finite.append(ok)
        peaks.append(float(np.max(np.abs(unscaled.astype(np.float64)))) if ok and x.size else (0.0 if ok else np.inf))
        squares += float(np.sum(unscaled.astype(np.float64) ** 2))
        magnitude = np.abs(x.astype(np.float64))
        zeros += int(np.sum(magnitude == 0))
        tiny += int(np.sum(magnitude < F16_TINY))
        count += x.size
    return finite, max(peaks, default=0.0), squares, (zeros / max(count, 1), tiny / max(count, 1))


def make_leaves(sizes, dtypes, poison, seed):
    rng = np.random.default_rng(seed)
    leaves = []
    for i, (size, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
        if dtype == "int32":
            leaves.append(np.arange(size, dtype=np.int32))
            continue
        x = (rng.normal(size=size) * 10.0 ** rng.integers(-9, 3)).astype(dtype)
        x[rng.random(size) < 0.2] = 0
        if i in poison and size:
            x[rng.integers(size)] = poison[i]
        leaves.append(x)
    return leaves


def check(leaves, scale):
    """Both forms of the check, with a flag per leaf and without (each batch
    reduced whole, the batches combined elementwise), against numpy."""
    finite, peak, squares, underflow = numpy_stats(leaves, scale)
    for per_leaf in (True, False):
        stats = jax.jit(gradient_stats, static_argnums=(2, 3, 4, 5))(
            [jnp.asarray(x) for x in leaves], jnp.float32(scale), True, True, None, per_leaf
        )
        if per_leaf:
            assert list(np.asarray(stats.leaf_finite)) == finite
        else:
            assert stats.leaf_finite is None
        assert bool(stats.finite) == all(finite), per_leaf
        if all(finite):
            np.testing.assert_allclose(float(stats.grad_max), peak, rtol=1e-6)
            np.testing.assert_allclose(float(stats.sq_norm), squares, rtol=1e-4)
        else:
            assert float(stats.grad_max) == np.inf
            assert float(stats.sq_norm) == np.inf
        np.testing.assert_allclose(np.asarray(stats.underflow), underflow, rtol=1e-6)


def test_many_small_leaves_of_mixed_sizes_and_dtypes():
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(0, 3000, size=120)] + [SMALL_LEAF, SMALL_LEAF + 1, 1, 1, 7]
    dtypes = [rng.choice(["float32", "float16", "bfloat16", "int32"]) for _ in sizes]
    leaves = make_leaves(sizes, dtypes, {}, 1)
    check(leaves, 2.0**10)
    for kind in [np.nan, np.inf, -np.inf]:
        poisoned = {int(i): kind for i in rng.choice(len(sizes), size=3, replace=False)}
        check(make_leaves(sizes, dtypes, poisoned, 1), 2.0**10)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=25),
    data=st.data(),
    scale=st.sampled_from([0.5, 1.0, 2.0**12]),
)
def test_hypothesis_batched_statistics_equal_numpy(sizes, data, scale):
    dtypes = data.draw(st.lists(st.sampled_from(["float32", "float16"]), min_size=len(sizes), max_size=len(sizes)))
    poison = data.draw(st.dictionaries(st.integers(0, len(sizes) - 1), st.sampled_from([np.nan, np.inf]), max_size=2))
    check(make_leaves(sizes, dtypes, poison, len(sizes)), scale)


@pytest.mark.parametrize("scale", [0.25, 1.0])
def test_a_small_leaf_that_overflows_only_once_unscaled_is_found_among_many(scale):
    leaves = [np.ones(64, np.float16) for _ in range(50)]
    leaves[17] = np.full(64, 60000.0, np.float16)  # x / 0.25 overflows float16
    check(leaves, scale)


def test_the_small_leaves_of_a_tiny_model_are_checked_by_one_reduction():
    # Four leaves in four size classes (a 316-parameter MLP's), whose merged
    # batch is small: one reduction, not one per class.
    leaves = [jnp.ones((10, 16)), jnp.ones(16), jnp.ones((16, 8)), jnp.ones(8)]
    jaxpr = jax.make_jaxpr(gradient_stats)(leaves, jnp.float32(1.0))
    reductions = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "reduce"]
    assert len(reductions) == 1
    assert reductions[0].invars[0].aval.shape == (4, 256)  # padded to the widest class
    check([np.asarray(x) for x in leaves[:2]] + [np.full((16, 8), np.inf, np.float32), np.ones(8, np.float32)], 1.0)


@pytest.fixture
def reduced_by_rows(monkeypatch):
    """The check as a GPU compiles it (``_check_gpu.reduced_by_rows``: big
    leaves reduced over their rows first, then every row's result and every
    small leaf at once), run here in place of the CPU's form; the number of
    times it was traced. Traces made with it are dropped before and after."""
    traced = []

    def by_rows(batches):
        traced.append(len(batches))
        return _check_gpu.reduced_by_rows([(batch.parts[0].size > SMALL_LEAF, batch.parts) for batch in batches])

    jax.clear_caches()
    monkeypatch.setattr(_check, "_peak_of_batches", by_rows)
    yield traced
    jax.clear_caches()


@pytest.mark.parametrize(
    "shapes",
    [
        [(64, 512), (512,), (300, 7)],  # rows of 512: reduced by rows
        [(2, 3, 4096), (24, 1024), (9,)],  # a leaf of three axes, rows along the first
        [(40000, 2), (20000,)],  # rows too short, a long vector: reduced whole
        [(128, 256), (128, 256), (64, 16), (16,)],
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_gpus_reduction_by_rows_finds_what_numpy_finds(reduced_by_rows, shapes, dtype):
    sizes = [int(np.prod(shape)) for shape in shapes]

    def leaves(poison):
        flat = make_leaves(sizes, [dtype] * len(sizes), poison, 3)
        return [x.reshape(shape) for x, shape in zip(flat, shapes, strict=True)]

    check(leaves({}), 2.0**8)
    for kind in (np.nan, np.inf, -np.inf):
        check(leaves({0: kind}), 2.0**8)
        check(leaves({len(shapes) - 1: kind}), 1.0)
    assert reduced_by_rows  # the GPU's form was the one traced


def test_the_gpus_reduction_by_rows_finds_a_poison_in_the_last_row(reduced_by_rows):
    for row in (0, 63):
        x = np.ones((64, 512), np.float32)
        x[row, 511] = np.nan
        check([x, np.ones(10, np.float32)], 1.0)
    big = np.ones((64, 512), np.float32)
    big[63, 0] = 3e38  # finite, but overflows once unscaled
    check([big], 0.5)


def test_the_gpus_form_on_many_small_leaves_empty_ones_and_integers(reduced_by_rows):
    # Small leaves only: the GPU's form reads them through the one
    # concatenation, where the last reduction takes their magnitudes.
    rng = np.random.default_rng(5)
    sizes = [int(s) for s in rng.integers(0, 3000, size=60)] + [0, 0, SMALL_LEAF, SMALL_LEAF + 1, 1]
    dtypes = [rng.choice(["float32", "float16", "bfloat16", "int32"]) for _ in sizes]
    check(make_leaves(sizes, dtypes, {}, 2), 2.0**10)
    for kind in (np.nan, np.inf, -np.inf):
        floating = [i for i, d in enumerate(dtypes) if d != "int32" and sizes[i]]
        check(make_leaves(sizes, dtypes, {floating[-1]: kind}, 2), 2.0**10)
    check([np.zeros(0, np.float32), np.zeros((0, 3), np.float16)], 1.0)  # nothing to read: finite, peak 0
    assert reduced_by_rows


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_the_gpus_form_on_float8_leaves_with_and_without_an_infinity(reduced_by_rows, dtype):
    # e4m3fn holds no infinity: its magnitudes are taken in float32, where a
    # NaN becomes inf; e5m2 holds one and stays in its own format.
    big = np.ones((64, 512), np.float32).astype(dtype)
    small = (np.arange(100, dtype=np.float32) / 4).astype(dtype)
    stats = jax.jit(gradient_stats, static_argnums=(2, 3, 4, 5))(
        [jnp.asarray(big), jnp.asarray(small)], jnp.float32(1.0), False, False, None, False
    )
    assert bool(stats.finite) and float(stats.grad_max) == float(small.astype(np.float32).max())
    for poisoned in ("big", "small"):
        leaves = [big.copy(), small.copy()]
        target = leaves[0] if poisoned == "big" else leaves[1]
        target.reshape(-1)[7] = np.nan
        stats = jax.jit(gradient_stats, static_argnums=(2, 3, 4, 5))(
            [jnp.asarray(x) for x in leaves], jnp.float32(1.0), False, False, None, False
        )
        assert not bool(stats.finite), poisoned
        assert float(stats.grad_max) == np.inf
    assert reduced_by_rows


def test_the_gpus_form_on_complex_leaves(reduced_by_rows):
    big = (np.ones((64, 512)) + 2j * np.ones((64, 512))).astype(np.complex64)
    small = (np.arange(10) - 3j * np.arange(10)).astype(np.complex64)
    stats = jax.jit(gradient_stats, static_argnums=(2, 3, 4, 5))(
        [jnp.asarray(big), jnp.asarray(small)], jnp.float32(1.0), False, False, None, False
    )
    assert bool(stats.finite) and float(stats.grad_max) == 27.0  # the larger of |re| and |im|
    small[4] = complex(1.0, np.nan)
    stats = jax.jit(gradient_stats, static_argnums=(2, 3, 4, 5))(
        [jnp.asarray(big), jnp.asarray(small)], jnp.float32(1.0), False, False, None, False
    )
    assert not bool(stats.finite)
    assert reduced_by_rows
